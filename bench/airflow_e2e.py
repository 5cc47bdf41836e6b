"""Airflow end to end: backfills through a real scheduler, api-server and dag-processor.

Two DAGs of the same shape (three chained tasks, ``bench/dags/``): ``bench_plain_noop``
(plain ``@task`` no-ops) and ``bench_idempotent_noop`` (``@task.idempotent_run`` no-ops).
One stack (``devtools.airflow_stack``: SQLite metadata, LocalExecutor) serves both:

1. a short untimed warm-up backfill of each DAG (the idempotent one does its work);
2. timed rounds, each on a fresh window of N dates: the idempotent DAG's keys for the
   window are completed first (in-process, ``run_idempotently``), then ``airflow backfill
   create`` of the window for each DAG, the order alternating per round. Every idempotent
   task is therefore a no-op decision (checked: the pass records exactly N x 3 ``noop``
   attempts and nothing else).

Fresh windows rather than ``--reprocess-behavior completed`` reruns: on this SQLite stack
under load, ``backfill create`` that clears 30 existing runs dies on "database is locked"
part-way now and then, leaving a half-made backfill whose runs never start (seen twice).

Figures per pass: ``wall`` = from ``airflow backfill create`` to every run terminal, as
an operator experiences it (includes the CLI's ~4 s start-up); ``span`` = first task start
to last task end, from the metadata DB; and the mean task-instance duration.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg

from bench.common import BenchResult, Size, at_most, database, median, say
from devtools import airflow_env
from devtools.airflow_stack import AirflowStack, StackError, airflow_stack
from devtools.postgres import PostgresServer

TITLE = "Airflow end to end: backfill of completed keys vs plain no-op tasks"
DAGS_FOLDER = Path(__file__).resolve().parent / "dags"
PLAIN, IDEMPOTENT = "bench_plain_noop", "bench_idempotent_noop"
TASKS = 3
# Windows of dates go forward from here; backfill creates no run for a date still to come.
FIRST_DATE = dt.date(2026, 2, 2)
RATIO_LIMIT = 1.10
WARMUP_DATES = 2
# The task runner logs how long it took to parse the DAG file before running the task.
_PARSE_MS = re.compile(r'"dag_file_parse_ms":\s*([0-9.]+)')


def _ts(value: Any) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def _pass(stack: AirflowStack, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
    last = first + dt.timedelta(days=dates - 1)
    runs = stack.backfill(dag_id, first.isoformat(), last.isoformat(), timeout=120 + 8 * dates)
    wall = stack.timings["last_backfill"]
    if len(runs) != dates or {r.state for r in runs} != {"success"}:
        raise RuntimeError(
            f"{dag_id}: {len(runs)} runs, states {sorted({str(r.state) for r in runs})}\n"
            + stack.describe_runs(dag_id, [r.run_id for r in runs])
        )
    rows = stack.query(
        "SELECT ti.start_date, ti.end_date, ti.state FROM task_instance ti "
        "JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id "
        "JOIN backfill_dag_run b ON b.dag_run_id = r.id WHERE b.backfill_id = ?",
        (stack.last_backfill_id,),
    )
    if len(rows) != dates * TASKS or {r["state"] for r in rows} != {"success"}:
        raise RuntimeError(f"{dag_id}: unexpected task instances {[tuple(r) for r in rows][:5]}")
    parse_ms, decision_ms = [], []
    for r in runs:
        for task_id in (f"step_{i}" for i in range(1, TASKS + 1)):
            log = stack.task_log(dag_id, r.run_id, task_id)
            found = _PARSE_MS.search(log)
            if found:
                parse_ms.append(float(found.group(1)))
            decided = _decision_ms(log)
            if decided is not None:
                decision_ms.append(decided)
    starts = [_ts(r["start_date"]) for r in rows]
    ends = [_ts(r["end_date"]) for r in rows]
    durations = [(e - s).total_seconds() for s, e in zip(starts, ends, strict=True)]
    return {
        "wall": wall,
        "span": (max(ends) - min(starts)).total_seconds(),
        "task": sum(durations) / len(durations),
        "parse_ms": median(parse_ms) if parse_ms else float("nan"),
        "decision_ms": median(decision_ms) if decision_ms else float("nan"),
    }


def _decision_ms(log: str) -> float | None:
    """From the operator's first line (``job=... run_key=...``) to the runner's no-op line:
    connection lookup, connect, schema check, lock, read, noop attempt row, unlock."""
    start = end = None
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        event = str(entry.get("event", ""))
        if start is None and event.startswith("job="):
            start = _ts(entry["timestamp"])
        elif start is not None and "found existing completed run" in event:
            end = _ts(entry["timestamp"])
            break
    return (end - start).total_seconds() * 1000 if start and end else None


def _abandon_backfill(stack: AirflowStack, dag_id: str) -> None:
    """End the DAG's unfinished backfill: its queued/running runs failed, itself complete.

    Under load ``airflow backfill create`` can die on SQLite's "database is locked" after
    it created part of a backfill; its runs may then never start and the DAG refuses any
    new backfill ("Another backfill is running").
    """
    backfill_id = stack.latest_backfill_id(dag_id)
    if backfill_id is None:
        return
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
    with closing(sqlite3.connect(stack.db_path, timeout=60)) as conn, conn:
        conn.execute(
            "UPDATE dag_run SET state = 'failed' WHERE backfill_id = ?"
            " AND state IN ('queued', 'running')",
            (backfill_id,),
        )
        conn.execute(
            "UPDATE backfill SET completed_at = ? WHERE id = ? AND completed_at IS NULL",
            (now, backfill_id),
        )


def _nothing(_first: dt.date) -> None:
    return None


class _Windows:
    """Consecutive, never reused windows of dates (one per pass, shared by both DAGs)."""

    def __init__(self) -> None:
        self.next = FIRST_DATE

    def take(self, dates: int) -> dt.date:
        first, self.next = self.next, self.next + dt.timedelta(days=dates)
        if self.next > dt.datetime.now(dt.timezone.utc).date():
            raise RuntimeError(f"window {first} + {dates} days reaches today: move FIRST_DATE")
        return first


def _pass_retrying(
    stack: AirflowStack,
    dag_id: str,
    first: dt.date,
    dates: int,
    windows: _Windows,
    before: Callable[[dt.date], None],
    notes: list[str],
) -> dict[str, float]:
    """:func:`_pass` on ``first`` (after ``before(first)``); once more on a fresh window if
    the stack got stuck."""
    before(first)
    try:
        return _pass(stack, dag_id, first, dates)
    except StackError as exc:
        first_line = str(exc).splitlines()[0][:200]
        say(f"airflow: {dag_id} pass failed ({first_line}); abandoning it, retrying once")
        notes.append(f"One pass of {dag_id} got stuck and was redone on fresh dates: {first_line}")
        _abandon_backfill(stack, dag_id)
        retry = windows.take(dates)
        before(retry)
        return _pass(stack, dag_id, retry, dates)


def _completed_keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM idempotency.job_runs WHERE status = 'completed'"
        ).fetchone()
    return int(row[0]) if row else 0


def _outcomes_since(dsn: str, since: dt.datetime) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT outcome, count(*) FROM idempotency.job_run_attempts"
            " WHERE started_at >= %s GROUP BY 1",
            (since,),
        ).fetchall()
    return {outcome: int(count) for outcome, count in rows}


def _now(dsn: str) -> dt.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _complete_keys_in_process(dsn: str, first: dt.date, dates: int) -> None:
    """Complete the idempotent DAG's keys of a window without Airflow (the run at logical
    date D has run key D - 1 day: ``@daily`` is a CronTriggerTimetable)."""
    from airflow_idempotency import run_idempotently

    for day in range(dates):
        run_key = (first + dt.timedelta(days=day - 1)).isoformat()
        for task in range(1, TASKS + 1):
            run_idempotently(
                connect=lambda: psycopg.connect(dsn),
                job_name=f"{IDEMPOTENT}.step_{task}",
                run_key=run_key,
                work=lambda _run: None,
            )


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("airflow_e2e", TITLE)
    dates = size.airflow_dates
    home = Path(tempfile.mkdtemp(prefix="bench-airflow-"))
    timed: dict[str, list[dict[str, float]]] = {PLAIN: [], IDEMPOTENT: []}
    try:
        with database(server, "bench_airflow") as dsn:
            env = {"AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": airflow_env.airflow_connection_json(dsn)}
            with airflow_stack(home / "home", DAGS_FOLDER, extra_env=env) as stack:
                say(f"airflow: stack up in {stack.timings.get('start', 0):.0f} s")
                for dag_id in (PLAIN, IDEMPOTENT):
                    stack.unpause(dag_id)
                windows = _Windows()
                warmup_dates = min(WARMUP_DATES, dates) if size.airflow_warmup else 0
                first: dict[str, dict[str, float]] = {}
                if warmup_dates:  # untimed: DAG parsing, caches; the idempotent DAG works
                    warm = windows.take(warmup_dates)
                    for dag_id in (PLAIN, IDEMPOTENT):
                        first[dag_id] = _pass_retrying(
                            stack, dag_id, warm, warmup_dates, windows, _nothing, result.notes
                        )
                        say(f"airflow: warm-up pass {dag_id} {first[dag_id]['wall']:.1f} s")
                    if _completed_keys(dsn) < warmup_dates * TASKS:
                        raise RuntimeError(f"warm-up completed {_completed_keys(dsn)} keys")

                def complete_window(start: dt.date) -> None:
                    _complete_keys_in_process(dsn, start, dates)

                for round_no in range(size.airflow_rounds):
                    window = windows.take(dates)
                    order = (PLAIN, IDEMPOTENT) if round_no % 2 == 0 else (IDEMPOTENT, PLAIN)
                    for dag_id in order:
                        since = _now(dsn)
                        before = complete_window if dag_id == IDEMPOTENT else _nothing
                        figures = _pass_retrying(
                            stack, dag_id, window, dates, windows, before, result.notes
                        )
                        if dag_id == IDEMPOTENT:
                            seen = _outcomes_since(dsn, since)
                            noops = seen.pop("noop", 0)
                            # completed: the keys completed in-process just before the pass
                            if set(seen) - {"completed"} or noops < dates * TASKS:
                                raise RuntimeError(f"the pass recorded {noops} noops and {seen}")
                        timed[dag_id].append(figures)
                        say(
                            f"airflow: {dag_id} wall {figures['wall']:.1f} s, "
                            f"span {figures['span']:.1f} s, task {figures['task']:.2f} s"
                        )
    finally:
        if os.environ.get("BENCH_KEEP_AIRFLOW_HOME"):
            say(f"airflow: home kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)

    def med(dag_id: str, key: str) -> float:
        return median([f[key] for f in timed[dag_id]])

    def each(dag_id: str, key: str) -> str:
        return ", ".join(f"{f[key]:.1f}" for f in timed[dag_id])

    n_tis = dates * TASKS
    if first:
        result.add(
            f"warm-up pass, idempotent DAG doing its work, {min(WARMUP_DATES, dates)} dates",
            first[IDEMPOTENT]["wall"],
            "s",
            note=f"untimed; plain DAG {first[PLAIN]['wall']:.1f} s",
        )
    for dag_id, label in ((PLAIN, "plain no-op DAG"), (IDEMPOTENT, "idempotent DAG, all no-op")):
        result.add(
            f"backfill wall, {label}",
            med(dag_id, "wall"),
            "s",
            note=f"{dates} dates x {TASKS} tasks; passes: {each(dag_id, 'wall')} s",
        )
    wall_ratio = med(IDEMPOTENT, "wall") / med(PLAIN, "wall")
    result.add(
        "ratio idempotent / plain, backfill wall",
        wall_ratio,
        "x",
        f"<= {RATIO_LIMIT:g}",
        at_most(wall_ratio, RATIO_LIMIT),
        "backfill create -> all runs terminal",
    )
    span_ratio = med(IDEMPOTENT, "span") / med(PLAIN, "span")
    result.add(
        "ratio idempotent / plain, task span",
        span_ratio,
        "x",
        f"<= {RATIO_LIMIT:g}",
        at_most(span_ratio, RATIO_LIMIT),
        f"first task start -> last task end: {med(IDEMPOTENT, 'span'):.1f} vs "
        f"{med(PLAIN, 'span'):.1f} s",
    )
    task_ratio = med(IDEMPOTENT, "task") / med(PLAIN, "task")
    result.add(
        "ratio idempotent / plain, mean task duration",
        task_ratio,
        "x",
        note=f"{med(IDEMPOTENT, 'task') * 1000:.0f} vs {med(PLAIN, 'task') * 1000:.0f} ms "
        f"per task instance ({n_tis} per pass)",
    )
    result.add(
        "no-op decision inside the idempotent task, median",
        med(IDEMPOTENT, "decision_ms"),
        "ms",
        note="task log: operator's first line -> runner's no-op line",
    )
    result.add(
        "DAG-file parse in the task process, idempotent | plain",
        med(IDEMPOTENT, "parse_ms"),
        "ms",
        note=f"plain {med(PLAIN, 'parse_ms'):.0f} ms (median, from the task logs)",
    )
    result.notes.append(
        f"{dates} daily dates per pass, {TASKS} chained tasks per run, "
        f"{size.airflow_rounds} timed pass(es) per DAG, each round on fresh dates and in "
        "alternating order, after an untimed warm-up pass of each DAG (none at size tiny); "
        "medians. Stack: "
        "devtools.airflow_stack (SQLite metadata DB, LocalExecutor, parallelism 4, "
        "scheduler heartbeat 2 s), one for both DAGs so they share the same scheduler and "
        "workers. Each idempotent pass is verified to record exactly dates x 3 `noop` "
        "attempts. A plain no-op task instance lasts "
        f"{med(PLAIN, 'task') * 1000:.0f} ms here, so anything the idempotent task adds "
        "per task (imports, connection, decision, a result dict pushed as XCom) is large "
        "relative to it; the pass ratio depends on how much of a pass is task CPU rather "
        "than scheduler latency. The wall figure includes `airflow backfill create` (~4 s of CLI "
        'start-up, plus retries when SQLite reports "database is locked"), which adds '
        "seconds at random to single passes: wall - span per pass, plain "
        + ", ".join(f"{f['wall'] - f['span']:.1f}" for f in timed[PLAIN])
        + " s; idempotent "
        + ", ".join(f"{f['wall'] - f['span']:.1f}" for f in timed[IDEMPOTENT])
        + " s. The span and per-task figures are the steadier comparison."
    )
    result.notes.append(
        "**Where the idempotent task's extra time goes.** Little of it in the decision "
        f"({med(IDEMPOTENT, 'decision_ms'):.0f} ms median, row above, including the "
        "connection lookup through the API server and connect). Most of it is imports, "
        "which the task runner counts in its DAG-file parse (row above, `dag_file_parse_ms`): "
        "`@task.idempotent_run` and RunContext bring psycopg (~70-100 ms with its C "
        "extension and bundled libpq/OpenSSL) and PostgresHook with providers.common.sql, "
        "sqlparse and psycopg2 (~45 ms), measured with `python -X importtime` on a quiet "
        "machine. Importing them lazily would move that time, not remove it: the task "
        "runner parses the DAG file and then executes the task in the same process, and "
        "execution needs psycopg and the hook (only the dag-processor's parse would get "
        "lighter). The provider's own modules add ~30 ms more here because this checkout is "
        "installed editable and PYTHONDONTWRITEBYTECODE keeps them from being cached (a "
        "wheel install compiles them). With four task slots on two cores, task CPU fills the "
        "pass, so the span ratio follows the per-task figures rather than the scheduler. "
        "**What limits it:** the target of 1.10 leaves an idempotent task about "
        f"{med(PLAIN, 'task') * 100:.0f} ms (10 % of a plain task's "
        f"{med(PLAIN, 'task') * 1000:.0f} ms) for importing a Postgres driver, connecting and "
        "deciding; importing psycopg alone takes longer than that, so no task that talks to "
        "Postgres meets it on this stack, whatever the contract does after connecting (its "
        "decision is the row above). Not changed: PostgresHook could be bypassed by "
        "connecting with psycopg from the Airflow connection directly (~45 ms a task), at "
        "the price of re-implementing the hook's handling of connection extras (SSL, IAM, "
        "options). "
        "**Bytecode:** this machine sets PYTHONDONTWRITEBYTECODE=1 and uv installs without "
        "compiling by default, so until dev.py passed `--compile-bytecode` every task process "
        "compiled Airflow, psycopg and the hook from source (psycopg alone 260 ms instead of "
        "70 ms): the previous report's 426 vs 92 ms parse was measured that way. The Docker "
        "image already sets UV_COMPILE_BYTECODE=1."
    )
    return result
