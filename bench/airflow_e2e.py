"""Airflow end to end on both lines: backfills of completed keys vs plain and fair tasks.

Three DAGs of the same shape (three chained tasks, ``bench/dags/``): ``bench_plain_noop``
(plain ``@task`` no-ops), ``bench_fair_noop`` (plain tasks that open one connection through
PostgresHook and run one query: the fair baseline) and ``bench_idempotent_noop``
(``@task.idempotent_run`` no-ops). Two Airflow lines, in one run:

* Airflow 3.3: one stack (``devtools.airflow_stack``: SQLite metadata, LocalExecutor)
  serves the three DAGs, ``airflow backfill create``;
* Airflow 2.11 (when .venv-airflow2 exists): ``airflow dags backfill`` from the 2.11
  interpreter (bench/airflow2.py: Postgres metadata, LocalExecutor).

1. a short untimed warm-up backfill of each DAG on each line (the idempotent one works);
2. timed rounds, each on a fresh window of N dates per line: the idempotent DAG's keys for
   the window are completed first (in-process, ``run_idempotently``), then a backfill of
   the window for each DAG; the lines alternate which goes first, the DAGs rotate. Every
   idempotent task is therefore a no-op decision (checked: the pass records exactly N x 3
   ``noop`` attempts and nothing else).

Fresh windows rather than ``--reprocess-behavior completed`` reruns: on this SQLite stack
under load, ``backfill create`` that clears 30 existing runs dies on "database is locked"
part-way now and then, leaving a half-made backfill whose runs never start (seen twice).

Figures per pass: ``wall`` = from the backfill command to every run terminal, as an
operator experiences it (includes the CLI's start-up); ``span`` = first task start to last
task end, from the metadata DB; and the mean task-instance duration.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg

from bench.airflow2 import PARALLELISM, Airflow2Home, airflow2_python
from bench.common import (
    SUPERVISOR_ENV,
    BenchResult,
    Size,
    at_most,
    bytecode_env,
    database,
    median,
    say,
)
from devtools import airflow_env
from devtools.airflow_stack import AirflowStack, StackError, airflow_stack
from devtools.postgres import PostgresServer

TITLE = (
    "Airflow end to end, 3.3 and 2.11: backfill of completed keys vs plain no-op tasks "
    "and the fair baseline"
)
DAGS_FOLDER = Path(__file__).resolve().parent / "dags"
PLAIN, FAIR, IDEMPOTENT = "bench_plain_noop", "bench_fair_noop", "bench_idempotent_noop"
DAG_IDS = (PLAIN, FAIR, IDEMPOTENT)
LABELS = {
    PLAIN: "plain no-op DAG",
    FAIR: "fair baseline DAG (hook connection + 1 query)",
    IDEMPOTENT: "idempotent DAG, all no-op",
}
LINE3, LINE2 = "3.3", "2.11"
TASKS = 3
# Windows of dates go forward from here; backfill creates no run for a date still to come.
FIRST_DATE = dt.date(2026, 2, 2)
RATIO_LIMIT = 1.10
WARMUP_DATES = 2
LINES_ENV = "BENCH_AIRFLOW_LINES"  # e.g. "2.11": only that line (default: both)
PASS_RETRIES = 2  # fresh windows tried after a stuck 3.3 pass
# The task runner logs how long it took to parse the DAG file before running the task.
_PARSE_MS = re.compile(r'"dag_file_parse_ms":\s*([0-9.]+)')


def _ts(value: Any) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def _pass(stack: AirflowStack, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
    last = first + dt.timedelta(days=dates - 1)
    runs = stack.backfill(dag_id, first.isoformat(), last.isoformat(), timeout=120 + 8 * dates)
    wall = stack.timings["last_backfill"]
    # AirflowStack.backfill also returns the runs of every backfill id between this DAG's
    # previous backfill and this one, which with other DAGs' backfills in between are
    # earlier runs of this DAG with the same run ids: keep this window's.
    runs = [
        r
        for r in runs
        if r.logical_date is not None and first <= _ts(r.logical_date).date() <= last
    ]
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
    """:func:`_pass` on ``first`` (after ``before(first)``); again on a fresh window, up to
    ``PASS_RETRIES`` times, if the stack got stuck (SQLite's "database is locked" under load)."""
    window = first
    for attempt in range(PASS_RETRIES + 1):
        before(window)
        try:
            return _pass(stack, dag_id, window, dates)
        except StackError as exc:
            if attempt == PASS_RETRIES:
                raise
            first_line = str(exc).splitlines()[0][:200]
            say(f"airflow: {dag_id} pass failed ({first_line}); abandoning it, retrying")
            notes.append(
                f"One pass of {dag_id} got stuck and was redone on fresh dates: {first_line}"
            )
            _abandon_backfill(stack, dag_id)
            time.sleep(10)  # let the scheduler settle before the next backfill create
            window = windows.take(dates)
    raise AssertionError("unreachable")


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
    now: dt.datetime = row[0]
    return now


def _complete_keys_in_process(dsn: str, first: dt.date, dates: int, offset: int = -1) -> None:
    """Complete the idempotent DAG's keys of a window without Airflow. The run at logical
    date D has run key D + ``offset`` days: on Airflow 3 ``@daily`` is a
    CronTriggerTimetable (D - 1), on Airflow 2 a CronDataIntervalTimetable (D)."""
    from airflow_idempotency.runner import run_idempotently

    for day in range(dates):
        run_key = (first + dt.timedelta(days=day + offset)).isoformat()
        for task in range(1, TASKS + 1):
            run_idempotently(
                connect=lambda: psycopg.connect(dsn),
                job_name=f"{IDEMPOTENT}.step_{task}",
                run_key=run_key,
                work=lambda _run: None,
            )


def _figures(rows: list[dict[str, Any]], dag_id: str, dates: int, wall: float) -> dict[str, float]:
    """wall, span and mean task duration of one pass from its task instances."""
    if len(rows) != dates * TASKS or {r["state"] for r in rows} != {"success"}:
        raise RuntimeError(
            f"{dag_id}: {len(rows)} task instances, states {sorted({str(r['state']) for r in rows})}"
        )
    starts = [_ts(r["start"]) for r in rows]
    ends = [_ts(r["end"]) for r in rows]
    durations = [(e - s).total_seconds() for s, e in zip(starts, ends, strict=True)]
    return {
        "wall": wall,
        "span": (max(ends) - min(starts)).total_seconds(),
        "task": sum(durations) / len(durations),
        "parse_ms": float("nan"),
        "decision_ms": float("nan"),
    }


def _check_noops(dsn: str, since: dt.datetime, dates: int) -> None:
    """The idempotent pass recorded a noop for each of its task instances and nothing else
    (``completed``: the keys completed in-process just before it)."""
    seen = _outcomes_since(dsn, since)
    noops = seen.pop("noop", 0)
    if set(seen) - {"completed"} or noops < dates * TASKS:
        raise RuntimeError(f"the pass recorded {noops} noops and {seen}")


def _redone_on_fresh_dates(
    line: _Line,
    dag_id: str,
    first: dt.date,
    dates: int,
    attempt: Callable[[dt.date], dict[str, float]],
    what: str,
) -> dict[str, float]:
    """``attempt(first)``, redone on fresh dates (up to ``PASS_RETRIES`` times, each noted)
    when Airflow aborts it: 2.11's backfill job now and then dies on SQLAlchemy's
    DetachedInstanceError or loses its metadata connection under load (seen 2026-12-03, in
    a warm-up). ``what`` names the pass in the notes."""
    window = first
    for tried in range(PASS_RETRIES + 1):
        try:
            return attempt(window)
        except RuntimeError as exc:
            if tried == PASS_RETRIES:
                raise
            last_line = str(exc).strip().splitlines()[-1][:200]
            say(f"airflow {line.name}: {what} of {dag_id} failed ({last_line}); retrying")
            line.notes.append(
                f"One {line.name} {what} of {dag_id} was aborted by Airflow and redone on "
                f"fresh dates: {last_line}"
            )
            if isinstance(line, _Line3):
                _abandon_backfill(line.stack, dag_id)
            window = line.windows.take(dates)
    raise AssertionError("unreachable")


def _warm_up(line: _Line, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
    """The untimed warm-up pass, redone on fresh dates as the timed passes are."""
    return _redone_on_fresh_dates(
        line, dag_id, first, dates, lambda window: line.run_pass(dag_id, window, dates), "warm-up"
    )


def _rotate(items: tuple[str, ...], by: int) -> tuple[str, ...]:
    k = by % len(items)
    return items[k:] + items[:k]


class _Line:
    """One Airflow line of the comparison: how it runs a pass of a DAG over a window."""

    def __init__(self, name: str, dsn: str, offset: int, notes: list[str]) -> None:
        self.name = name
        self.dsn = dsn
        self.offset = offset
        self.notes = notes
        self.windows = _Windows()

    def run_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        raise NotImplementedError

    def timed_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        since = _now(self.dsn)
        if dag_id == IDEMPOTENT:
            _complete_keys_in_process(self.dsn, first, dates, self.offset)
        figures = self.run_pass(dag_id, first, dates)
        if dag_id == IDEMPOTENT:
            _check_noops(self.dsn, since, dates)
        return figures


class _Line3(_Line):
    def __init__(self, stack: AirflowStack, dsn: str, notes: list[str]) -> None:
        super().__init__(LINE3, dsn, -1, notes)
        self.stack = stack

    def run_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        return _pass_retrying(self.stack, dag_id, first, dates, self.windows, _nothing, self.notes)

    def timed_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        # _pass_retrying may move to a fresh window: the keys are completed for the window
        # actually run, and the noops counted over whatever it ran.
        since = _now(self.dsn)

        def before(start: dt.date) -> None:
            if dag_id == IDEMPOTENT:
                _complete_keys_in_process(self.dsn, start, dates, self.offset)

        figures = _pass_retrying(self.stack, dag_id, first, dates, self.windows, before, self.notes)
        if dag_id == IDEMPOTENT:
            _check_noops(self.dsn, since, dates)
        return figures


class _Line2(_Line):
    def __init__(self, home: Airflow2Home, dsn: str, notes: list[str]) -> None:
        super().__init__(LINE2, dsn, 0, notes)
        self.home = home

    def run_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        rows = self.home.backfill(dag_id, first, dates)
        return _figures(rows, dag_id, dates, self.home.last_backfill)

    def timed_pass(self, dag_id: str, first: dt.date, dates: int) -> dict[str, float]:
        """As the base class's; a backfill that Airflow 2.11 itself aborts (its backfill job
        can die on SQLAlchemy's DetachedInstanceError under load) is redone on fresh dates,
        up to ``PASS_RETRIES`` times, and noted."""
        since = _now(self.dsn)

        def attempt(window: dt.date) -> dict[str, float]:
            if dag_id == IDEMPOTENT:
                _complete_keys_in_process(self.dsn, window, dates, self.offset)
            return self.run_pass(dag_id, window, dates)

        figures = _redone_on_fresh_dates(self, dag_id, first, dates, attempt, "backfill")
        if dag_id == IDEMPOTENT:
            _check_noops(self.dsn, since, dates)
        return figures


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("airflow_e2e", TITLE)
    dates = size.airflow_dates
    home = Path(tempfile.mkdtemp(prefix="bench-airflow-"))
    py2 = airflow2_python()
    timed: dict[tuple[str, str], list[dict[str, float]]] = {}
    first: dict[tuple[str, str], dict[str, float]] = {}
    lines: list[_Line] = []
    migrate2 = 0.0
    try:
        with contextlib.ExitStack() as es:
            wanted = os.environ.get(LINES_ENV, f"{LINE3},{LINE2}").split(",")
            if set(wanted) - {LINE3, LINE2}:
                raise ValueError(f"{LINES_ENV}={','.join(wanted)}: the lines are {LINE3}, {LINE2}")
            if LINE3 in wanted:
                dsn3 = es.enter_context(database(server, "bench_airflow"))
                env = {
                    **airflow_env.connection_env(dsn3),
                    **bytecode_env(home),
                    **SUPERVISOR_ENV,
                }
                stack = es.enter_context(airflow_stack(home / "home", DAGS_FOLDER, extra_env=env))
                say(f"airflow: 3.3 stack up in {stack.timings.get('start', 0):.0f} s")
                for dag_id in DAG_IDS:
                    stack.unpause(dag_id)
                lines.append(_Line3(stack, dsn3, result.notes))
            else:
                result.notes.append(f"Airflow 3.3 left out ({LINES_ENV}).")
            if LINE2 not in wanted:
                result.notes.append(f"Airflow 2.11 left out ({LINES_ENV}).")
            elif py2:
                dsn2 = es.enter_context(database(server, "bench_airflow2"))
                meta2 = es.enter_context(database(server, "bench_airflow2_meta"))
                af2 = Airflow2Home(py2, home / "home2", meta2, DAGS_FOLDER, dsn2)
                migrate2 = af2.migrate()
                say(f"airflow: 2.11 metadata migrated in {migrate2:.0f} s")
                lines.append(_Line2(af2, dsn2, result.notes))
            else:
                result.notes.append(
                    "Airflow 2.11 left out: no .venv-airflow2 (`python3 dev.py setup --airflow 2`)."
                )
            for line in lines:
                for dag_id in DAG_IDS:
                    timed[line.name, dag_id] = []
            warmup_dates = min(WARMUP_DATES, dates) if size.airflow_warmup else 0
            if warmup_dates:  # untimed: DAG parsing, caches; the idempotent DAG works
                for line in lines:
                    warm = line.windows.take(warmup_dates)
                    for dag_id in DAG_IDS:
                        first[line.name, dag_id] = _warm_up(line, dag_id, warm, warmup_dates)
                        say(
                            f"airflow {line.name}: warm-up pass {dag_id} "
                            f"{first[line.name, dag_id]['wall']:.1f} s"
                        )
                    if _completed_keys(line.dsn) < warmup_dates * TASKS:
                        raise RuntimeError(f"warm-up completed {_completed_keys(line.dsn)} keys")
            for round_no in range(size.airflow_rounds):
                for line in lines[round_no % len(lines) :] + lines[: round_no % len(lines)]:
                    window = line.windows.take(dates)
                    for dag_id in _rotate(DAG_IDS, round_no):
                        figures = line.timed_pass(dag_id, window, dates)
                        timed[line.name, dag_id].append(figures)
                        say(
                            f"airflow {line.name}: {dag_id} wall {figures['wall']:.1f} s, "
                            f"span {figures['span']:.1f} s, task {figures['task']:.2f} s"
                        )
    finally:
        if os.environ.get("BENCH_KEEP_AIRFLOW_HOME"):
            say(f"airflow: home kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    dump = os.environ.get("BENCH_E2E_DUMP")
    if dump:  # the raw figures, to look into a run afterwards
        Path(dump).write_text(
            json.dumps(
                {
                    "timed": {f"{k[0]} {k[1]}": v for k, v in timed.items()},
                    "first": {f"{k[0]} {k[1]}": v for k, v in first.items()},
                }
            ),
            encoding="utf-8",
        )
    _report(result, lines, timed, first, dates, size, migrate2)
    return result


def _report(
    result: BenchResult,
    lines: list[_Line],
    timed: dict[tuple[str, str], list[dict[str, float]]],
    first: dict[tuple[str, str], dict[str, float]],
    dates: int,
    size: Size,
    migrate2: float,
) -> None:
    def med(line: str, dag_id: str, key: str) -> float:
        return median([f[key] for f in timed[line, dag_id]])

    def each(line: str, dag_id: str, key: str) -> str:
        return ", ".join(f"{f[key]:.1f}" for f in timed[line, dag_id])

    n_tis = dates * TASKS
    task_ratios: dict[str, float] = {}
    for line in (x.name for x in lines):
        if (line, IDEMPOTENT) in first:
            result.add(
                f"{line}: warm-up pass, idempotent DAG doing its work, "
                f"{min(WARMUP_DATES, dates)} dates",
                first[line, IDEMPOTENT]["wall"],
                "s",
                note=f"untimed; plain DAG {first[line, PLAIN]['wall']:.1f} s, "
                f"fair DAG {first[line, FAIR]['wall']:.1f} s",
            )
        for dag_id in DAG_IDS:
            result.add(
                f"{line}: backfill wall, {LABELS[dag_id]}",
                med(line, dag_id, "wall"),
                "s",
                note=f"{dates} dates x {TASKS} tasks; passes: {each(line, dag_id, 'wall')} s",
            )
        for dag_id in DAG_IDS:
            result.add(
                f"{line}: mean task duration, {LABELS[dag_id]}",
                med(line, dag_id, "task") * 1000,
                "ms",
                note=f"median over passes of the mean of {n_tis} task instances",
            )
        for base, name, targeted in (
            (PLAIN, "plain", ("wall", "span")),
            (FAIR, "fair", ("span", "task")),
        ):
            for key, what in (
                ("wall", "backfill wall"),
                ("span", "task span"),
                ("task", "mean task duration"),
            ):
                value = med(line, IDEMPOTENT, key) / med(line, base, key)
                if key == "task":
                    extra = (
                        f"{med(line, IDEMPOTENT, 'task') * 1000:.0f} vs "
                        f"{med(line, base, 'task') * 1000:.0f} ms per task instance"
                    )
                elif key == "span":
                    extra = (
                        f"first task start -> last task end: {med(line, IDEMPOTENT, 'span'):.1f}"
                        f" vs {med(line, base, 'span'):.1f} s"
                    )
                else:
                    extra = "backfill command -> all runs terminal"
                result.add(
                    f"{line}: ratio idempotent / {name}, {what}",
                    value,
                    "x",
                    f"<= {RATIO_LIMIT:g}" if key in targeted else "",
                    at_most(value, RATIO_LIMIT) if key in targeted else None,
                    extra,
                )
                if base == FAIR and key == "task":
                    task_ratios[line] = value
        fair_cost = med(line, FAIR, "task") - med(line, PLAIN, "task")
        result.add(
            f"{line}: fair - plain, mean task duration",
            fair_cost * 1000,
            "ms",
            note="what one hook connection and one query add to a task",
        )
        if line == LINE3:
            result.add(
                f"{line}: no-op decision inside the idempotent task, median",
                med(line, IDEMPOTENT, "decision_ms"),
                "ms",
                note="task log: operator's first line -> runner's no-op line",
            )
            result.add(
                f"{line}: DAG-file parse in the task process, idempotent | plain",
                med(line, IDEMPOTENT, "parse_ms"),
                "ms",
                note=f"plain {med(line, PLAIN, 'parse_ms'):.0f} ms, fair "
                f"{med(line, FAIR, 'parse_ms'):.0f} ms (median, from the task logs)",
            )
    names = [x.name for x in lines]
    rounds = size.airflow_rounds
    result.notes.append(
        f"{dates} daily dates per pass, {TASKS} chained tasks per run, {rounds} timed "
        f"pass(es) per DAG and line. Three DAGs of the same shape (bench/dags/): plain "
        "`@task` no-ops; the fair baseline, plain tasks that each open one connection to the "
        "job database through PostgresHook and run one query (what any task that touches "
        "that database pays, and the least the idempotent decision needs); and "
        "`@task.idempotent_run` tasks whose keys were completed just before the pass (each "
        "idempotent pass is verified to record exactly dates x 3 `noop` attempts). Each "
        "round takes fresh dates; the lines alternate which goes first and the DAGs rotate "
        "within a line, so every variant meets the machine over the same minutes; an untimed "
        "warm-up pass of each DAG on each line comes first (none at size tiny); medians. "
        "**Airflow 3.3**: devtools.airflow_stack (SQLite metadata DB, LocalExecutor, "
        "parallelism 4, scheduler heartbeat 2 s, `[workers] min_heartbeat_interval` 1 s: "
        "bench.common.SUPERVISOR_ENV says why, `airflow backfill create`), one stack for "
        "the three DAGs. **Airflow 2.11**: `airflow dags backfill` from .venv-airflow2, which "
        "runs the tasks from the CLI process without a scheduler; Airflow 2's LocalExecutor "
        "refuses SQLite, so its metadata DB is a Postgres database of the same server "
        f"(`airflow db migrate` took {migrate2:.0f} s, untimed), LocalExecutor, parallelism "
        f"{PARALLELISM}; its task processes are forked from the executor (Airflow 2's "
        "default), so imports the CLI process made are not paid again per task. The 3.3 "
        "stack stays up (idle) during the 2.11 passes. The wall figure includes each "
        "backfill command's start-up; the span and per-task figures are the steadier "
        "comparison. On both lines the task processes load the provider from bytecode, as "
        "an installed wheel does (bench.common.bytecode_env: the checkout is installed "
        "editable and CI sets PYTHONDONTWRITEBYTECODE)."
    )
    if LINE3 in names:
        result.notes.append(
            "wall - span per pass, 3.3: "
            + "; ".join(
                f"{LABELS[d].split(' DAG')[0]} "
                + ", ".join(f"{f['wall'] - f['span']:.1f}" for f in timed[LINE3, d])
                for d in DAG_IDS
            )
            + " s."
        )
    if LINE3 in names:
        gap = (med(LINE3, IDEMPOTENT, "task") - med(LINE3, FAIR, "task")) * 1000
        parse_gap = med(LINE3, IDEMPOTENT, "parse_ms") - med(LINE3, FAIR, "parse_ms")
        result.notes.append(
            f"**The 3.3 idempotent task against the fair one** ({gap:+.0f} ms a task): the "
            f"DAG-file parse in the task process differs by {parse_gap:+.0f} ms (the task "
            "runner's `dag_file_parse_ms`: the provider's decorator, operator, runner and "
            "psycopg against the Postgres hook's imports), and the no-op decision takes "
            f"{med(LINE3, IDEMPOTENT, 'decision_ms'):.0f} ms from the operator's first log "
            "line (connection lookup, connect, schema check, lock, read, noop attempt row, "
            "commit) where the fair task's connect and query are not logged. A no-op pushes "
            "no XCom when its work returned no counts (the bench's steps return none)."
        )
    verdicts = []
    for line in names:
        ratio = task_ratios[line]
        extra_ms = (med(line, IDEMPOTENT, "task") - med(line, FAIR, "task")) * 1000
        allowed = med(line, FAIR, "task") * (RATIO_LIMIT - 1) * 1000
        verdicts.append(
            f"{line}: {ratio:.2f}x the fair task ({extra_ms:+.0f} ms a task; the target "
            f"allows {allowed:.0f} ms), "
            + (
                "met"
                if ratio <= RATIO_LIMIT
                else f"missed by {(ratio - RATIO_LIMIT) * 100:.0f} points"
            )
        )
    result.notes.append(
        "**Against the fair baseline** (target: the idempotent no-op task within "
        f"{RATIO_LIMIT:.2f}x of the fair task's mean duration, both lines): "
        + "; ".join(verdicts)
        + ". Both pay the hook's imports (PostgresHook imports psycopg 3 and psycopg2 on "
        "both lines), the connection lookup and a connect. What the idempotent task adds "
        "beyond them: importing the provider (decorator, runner, records, locks, the "
        "operator) and running the decision, which is 4 round trips and a durable commit "
        "(the `noop` attempt row) against the fair task's one query (the `decision` rows "
        "above give its latency in-process), a schema-version check on its new session, "
        "and the result dict pushed as XCom. On 2.11 the operator opens psycopg 3 from the "
        "Airflow connection itself (the hook gives psycopg2 there), which the fair task, "
        "using the hook's psycopg2 connection, does not."
    )
