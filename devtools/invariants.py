"""The invoice example's date state and its invariants, in one place (their SQL: invariants.sql).

The tests (``tests/support/invoice_env.py``), the fault scenarios (``tests/support/faults.py``), the
demo (``devtools/demo/rig.py``) and chaos (``devtools/chaos/``) all read the example's
state and judge it through this module; the SQL is in ``invariants.sql``, one named query
per state read and per invariant. An invariant's query returns the rows that break it.

Invariants come in three kinds (:attr:`Invariant.when`):

- ``always``: facts about what happened, true at any moment, runs in flight or not. They
  count executions through two witnesses that an idempotent workload cannot absorb:
  ``work_witness`` (every committed work transaction of the example, with the database
  clock at its BEGIN and at its COMMIT) and ``accounting.requests`` (every request that
  reached the remote), plus ``witness_lock_losses`` (chaos's record of each lock session it
  ended, and when the session was gone) and ``witness_lease_losses`` (the lease mode's: each
  lease chaos took over, and when);
- ``quiescent``: the end state, once nothing runs;
- ``converged``: after every touched date was rerun until its jobs completed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import psycopg
from psycopg.rows import dict_row

from airflow_idempotency._sql import named_queries  # the example's loader (invoicing.queries)

FINALIZE = "finalize_invoices"
FINALIZE_JOBS = tuple(
    f"{FINALIZE}.{task}" for task in ("create_invoices", "rebuild_totals", "export_invoices")
)
RECONCILE_JOB = "daily_reconciliation"
JOBS = (*FINALIZE_JOBS, RECONCILE_JOB)
"""The jobs every date must have completed once converged (``reconcile_export`` runs only
with ``force_reconcile``, so it is not one of them)."""

When = Literal["always", "quiescent", "converged"]
Target = psycopg.Connection[Any] | str


@cache
def queries() -> dict[str, str]:
    """The statements of invariants.sql, by name."""
    return named_queries(Path(__file__).with_name("invariants.sql").read_text(encoding="utf-8"))


def fire_time(day: dt.date | str, at: str = "01:00", *, interval_start: bool = False) -> str:
    """The logical date of the scheduled run (daily at ``at`` UTC) that processes business
    date ``day``: it fires at D+1 ``at``, which is its logical date on Airflow 3 (a
    CronTriggerTimetable); ``interval_start`` gives Airflow 2's (a CronDataIntervalTimetable
    names the run by the start of its interval, D ``at``)."""
    date = dt.date.fromisoformat(day) if isinstance(day, str) else day
    fired = date if interval_start else date + dt.timedelta(days=1)
    return f"{fired.isoformat()}T{at}:00+00:00"


@contextlib.contextmanager
def _connected(target: Target) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(target, str):
        with psycopg.connect(target, connect_timeout=10) as conn:
            yield conn
    else:
        yield target


def rows(target: Target, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """The rows of query ``name`` of invariants.sql."""
    with _connected(target) as conn:
        return conn.execute(queries()[name], params or {}).fetchall()


def dict_rows(
    target: Target, name: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The rows of query ``name`` of invariants.sql, as dicts."""
    with _connected(target) as conn, conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries()[name], params or {}).fetchall()


# ------------------------------------------------------------------------- the date state


def date_state(target: Target, day: str) -> dict[str, Any]:
    """Everything a rerun of business date ``day`` must leave identical, row by row."""
    with _connected(target) as conn:
        d = {"day": day}
        return {
            "orders": rows(conn, "state_orders", d)[0][0],
            "invoices": rows(conn, "state_invoices", d),
            "uninvoiced_orders": rows(conn, "state_uninvoiced_orders", d)[0][0],
            "totals": rows(conn, "state_totals", d),
            "ledger": rows(conn, "state_ledger", d),
            "remote": rows(conn, "state_remote", d),
            "remote_duplicate_orders": [r[1:2] for r in rows(conn, "remote_duplicate_orders")],
            "jobs": job_statuses(conn, day),
        }


def portable_date_state(target: Target, day: str) -> dict[str, Any]:
    """:func:`date_state` without what differs between two databases that did the same
    work (the remote's invoice ids and the references made of them): comparable across
    databases. Those are checked for consistency inside one database instead
    (``ledger_not_confirmed_by_remote``)."""
    state = date_state(target, day)
    state["ledger"] = [(key, status) for key, status, _reference in state["ledger"]]
    state["remote"] = [(key, order_id) for key, _id, order_id in state["remote"]]
    del state["remote_duplicate_orders"]
    return state


def job_statuses(target: Target, day: str) -> dict[str, str]:
    """task -> job_runs.status of the finalize_invoices jobs of ``day`` (absent: never
    started; empty before the provider created its schema)."""
    with _connected(target) as conn:
        if not provider_schema_exists(conn):
            return {}
        return {
            job.removeprefix(f"{FINALIZE}."): status
            for job, status in rows(conn, "state_jobs", {"day": day})
        }


def provider_schema_exists(target: Target) -> bool:
    """Whether the provider has created its tables (the first run does)."""
    found = rows(target, "provider_schema_exists")
    return bool(found and found[0][0])


def date_counts(target: Target, day: dt.date | str) -> dict[str, int]:
    """One date's counts in every place the job writes to."""
    found = dict_rows(target, "state_counts", {"day": str(day)})[0]
    return {name: int(value) for name, value in found.items()}


def fingerprint(target: Target, days: Sequence[dt.date | str]) -> tuple[Any, ...]:
    """A digest of everything a no-op must leave alone on ``days``."""
    return rows(target, "state_fingerprint", {"keys": [str(d) for d in days]})[0]


def not_converged(target: Target, days: Sequence[dt.date | str]) -> list[dict[str, Any]]:
    """The dates of ``days`` not finished everywhere (with their counts): invoices =
    orders, all marked, totals count them all, every ledger row confirmed, exactly one
    remote invoice per order."""
    return dict_rows(target, "date_not_converged", {"keys": [str(d) for d in days]})


# ------------------------------------------------------------------------- invariants


@dataclass(frozen=True)
class Invariant:
    """One invariant: what it says, its query in invariants.sql, what a row of it is."""

    name: str
    query: str
    rows_are: str
    when: When
    params: tuple[tuple[str, str], ...] = ()  # fixed parameters of the query


INVARIANTS: tuple[Invariant, ...] = (
    # Executions, counted by the witnesses.
    Invariant(
        "at most one completed execution per key unless forced (witness)",
        "recomputed_without_force",
        "attempts that committed work on a completed key without force or an unfinished "
        "forced recompute before them (job, key, attempt, previous completion)",
        "always",
        (("seen_by", "witness"),),
    ),
    Invariant(
        "completed key never recomputed without force (attempt records)",
        "recomputed_without_force",
        "work attempts the provider recorded on a completed key without force",
        "always",
        (("seen_by", "records"),),
    ),
    Invariant(
        "no two attempts' work transactions of one key overlap",
        "work_transactions_overlap",
        "committed work transactions of two attempts of one key, overlapping in time",
        "always",
    ),
    Invariant(
        "no commit after the lock was lost",
        "commit_after_lock_lost",
        "work committed by an attempt after chaos saw its lock session gone",
        "always",
    ),
    Invariant(
        "no commit after a later attempt of the key started",
        "commit_after_successor_started",
        "work committed by an attempt after a later attempt of the same key had started",
        "always",
    ),
    Invariant(
        "a confirmed effect never reaches the remote again",
        "confirmed_effect_resent",
        "requests the remote received for a key after the ledger recorded it confirmed",
        "always",
    ),
    Invariant(
        "at most one remote invoice per order",
        "remote_duplicate_orders",
        "orders with more than one invoice in the accounting service",
        "always",
    ),
    Invariant(
        "every remote key names its own order",
        "remote_key_order_mismatch",
        "remote invoices whose idempotency key names another date or order",
        "always",
    ),
    # The end state.
    Invariant(
        "completed export: exactly one remote invoice per order",
        "export_not_one_remote_invoice_per_order",
        "orders of a date whose export is completed without exactly one remote invoice",
        "quiescent",
    ),
    Invariant(
        "completed export: every ledger row confirmed by the remote's invoice",
        "ledger_not_confirmed_by_remote",
        "ledger rows of a completed export not succeeded, or not naming the remote's invoice",
        "quiescent",
    ),
    Invariant(
        "completed create: invoices = orders",
        "create_not_every_order_invoiced",
        "dates whose create_invoices is completed with orders not invoiced",
        "quiescent",
    ),
    Invariant(
        "completed totals = fresh recomputation",
        "totals_not_recomputed",
        "daily_invoice_totals rows that differ from a recomputation from the invoices",
        "quiescent",
    ),
    Invariant(
        "one summary row per date",
        "summary_not_one_per_date",
        "dates with more than one reconciliation summary",
        "quiescent",
    ),
    Invariant(
        "job_runs completed by a completed attempt",
        "completed_run_not_by_completed_attempt",
        "completed job_runs whose current attempt did not complete (e.g. lock_lost)",
        "quiescent",
    ),
    Invariant(
        "no advisory lock left",
        "advisory_locks_left",
        "advisory locks held while nothing runs",
        "quiescent",
    ),
    # Converged.
    Invariant(
        "no running attempt without a live holder",
        "running_attempt_without_holder",
        "attempts still running whose lock session is gone, after convergence",
        "converged",
    ),
    Invariant(
        "converged: every job of every touched date completed",
        "job_not_completed",
        "job runs not completed after the convergence pass",
        "converged",
    ),
    Invariant(
        "converged: every touched date finished everywhere",
        "date_not_converged",
        "dates whose invoices, totals, ledger and remote do not all count every order",
        "converged",
    ),
)
EXECUTIONS = Invariant(
    "every execution has its attempt row",
    "execution_without_attempt",
    "task instances Airflow says succeeded with no attempt row of a successful outcome "
    "(dag, run, task, try)",
    "quiescent",
)
BY_NAME = {i.name: i for i in (*INVARIANTS, EXECUTIONS)}


@dataclass
class Violation:
    """An invariant that does not hold, with the rows that break it."""

    invariant: Invariant
    rows: list[dict[str, Any]]
    history: str = ""

    def text(self, shown: int = 20) -> str:
        lines = [f"  VIOLATED {self.invariant.name}: {self.invariant.rows_are}"]
        lines += [f"      {_row(r)}" for r in self.rows[:shown]]
        if len(self.rows) > shown:
            lines.append(f"      ... {len(self.rows) - shown} more")
        if self.history:
            lines.append(self.history)
        return "\n".join(lines)


@dataclass
class Checker:
    """Runs the invariants on one job database and counts how often each was checked."""

    checked: dict[str, int] = field(default_factory=dict)

    def check(self, target: Target, keys: Sequence[str], when: Sequence[When]) -> list[Violation]:
        """The invariants of the kinds ``when`` that do not hold for run keys ``keys``,
        each with the history of the keys it names."""
        found: list[Violation] = []
        with _connected(target) as conn:
            if not provider_schema_exists(conn):
                return found  # no run has started yet: nothing happened to check
            prepare(conn)
            for invariant in INVARIANTS:
                if invariant.when not in when:
                    continue
                params = {"keys": list(keys), "jobs": list(JOBS), **dict(invariant.params)}
                violated = dict_rows(conn, invariant.query, params)
                self.checked[invariant.name] = self.checked.get(invariant.name, 0) + 1
                if violated:
                    found.append(Violation(invariant, violated, history(conn, violated)))
        return found

    def check_executions(
        self, target: Target, succeeded: Sequence[tuple[str, str, str, int]]
    ) -> list[Violation]:
        """Task instances Airflow says succeeded (dag, run, task, try) without a
        successful attempt row."""
        params = {
            "dag_ids": [s[0] for s in succeeded],
            "run_ids": [s[1] for s in succeeded],
            "task_ids": [s[2] for s in succeeded],
            "tries": [s[3] for s in succeeded],
        }
        violated = dict_rows(target, EXECUTIONS.query, params)
        self.checked[EXECUTIONS.name] = self.checked.get(EXECUTIONS.name, 0) + 1
        return [Violation(EXECUTIONS, violated)] if violated else []


def check(target: Target, keys: Sequence[str], when: Sequence[When]) -> list[Violation]:
    """:meth:`Checker.check` once."""
    return Checker().check(target, keys, when)


def history(target: Target, violated: Sequence[dict[str, Any]], most: int = 3) -> str:
    """What happened to the keys the rows name (at most ``most`` of them): their attempts,
    their witness rows, the lock sessions chaos ended, the remote's requests."""
    subjects: list[tuple[str | None, str]] = []
    for row in violated:
        key = row.get("run_key")
        subject = (row.get("job_name"), str(key))
        if key is not None and subject not in subjects:
            subjects.append(subject)
    lines = []
    with _connected(target) as conn:
        for job_name, run_key in subjects[:most]:
            params = {"job_name": job_name, "run_key": run_key}
            lines.append(f"    history of {job_name or 'every job'} / {run_key}:")
            for title, query in (
                ("attempts (job_run_attempts)", "history_attempts"),
                ("work transactions (work_witness)", "history_witness"),
                ("locks lost to chaos (sessions ended, leases taken over)", "history_lock_losses"),
                ("requests at the remote (accounting.requests)", "history_requests"),
            ):
                try:
                    found = dict_rows(conn, query, params)
                except psycopg.errors.UndefinedTable:
                    conn.rollback()
                    found = []
                lines.append(f"      {title}: {len(found) or 'none'}")
                lines += [f"        {_row(r)}" for r in found]
    return "\n".join(lines)


def _row(row: dict[str, Any]) -> str:
    def shown(value: Any) -> str:
        if isinstance(value, dt.datetime):
            return value.astimezone(dt.timezone.utc).strftime("%H:%M:%S.%f")
        return str(value)

    return ", ".join(f"{k}={shown(v)}" for k, v in row.items() if v is not None)


# ------------------------------------------------------------------------- lock losses


def prepare(target: Target) -> None:
    """Create the tables of lock and lease losses unless they exist (chaos writes them; the
    invariants read them)."""
    with _connected(target) as conn:
        if rows(conn, "lock_losses_table_exists")[0][0]:
            return
        conn.execute(queries()["lock_losses_table"])
        if not conn.autocommit:
            conn.commit()


_NO_SCHEMA_YET = (
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
)


def run_lock_sessions(target: Target) -> list[dict[str, Any]]:
    """Sessions holding a run lock now, with the running attempt under each (if recorded);
    none before the provider created its schema."""
    try:
        return dict_rows(target, "run_lock_sessions")
    except _NO_SCHEMA_YET:
        return []


def live_leases(target: Target) -> list[dict[str, Any]]:
    """Live leases now (the lease mode), each with the running attempt that started under it;
    none before the provider created its schema."""
    try:
        return dict_rows(target, "live_leases")
    except _NO_SCHEMA_YET:
        return []
