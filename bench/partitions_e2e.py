"""Airflow 3.3 end to end on partitioned runs: a backfill over completed partitions.

Against the fair baseline (issue 21's measure: 90 partitions at size full).

The harness of bench/airflow_e2e.py (one devtools.airflow_stack, ``airflow backfill
create``, the same figures) on two DAGs of three chained tasks on daily
``CronPartitionTimetable`` partitions (``bench/dags_partitions/``):
``bench_fair_partitioned`` (plain tasks that open one connection through PostgresHook and
run one query) and ``bench_idempotent_partitioned`` (``@task.idempotent_run`` no-ops whose
keys, one per partition, are completed in-process before the pass, so every task is a no-op
decision: checked, the pass records exactly partitions x 3 ``noop`` attempts).

Each timed round takes a fresh window of partitions; the DAGs alternate which goes first.
The target: the idempotent no-op task within 1.10x of the fair task's mean duration, on a
quiet machine (load average < 2 at start and end, printed in BENCHMARKS.md's header).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.airflow_e2e import (
    _PARSE_MS,
    TASKS,
    _check_noops,
    _decision_ms,
    _now,
    _ts,
)
from bench.common import (
    SETTLE_SECONDS,
    SUPERVISOR_ENV,
    BenchResult,
    Size,
    at_most,
    bytecode_env,
    database,
    load_average,
    median,
    say,
    settled_load_average,
)
from devtools import airflow_env
from devtools.airflow_stack import AirflowStack, airflow_stack
from devtools.postgres import PostgresServer

TITLE = "Airflow 3.3 partitioned runs: backfill over completed partitions vs the fair baseline"
DAGS_FOLDER = Path(__file__).resolve().parent / "dags_partitions"
FAIR, IDEMPOTENT = "bench_fair_partitioned", "bench_idempotent_partitioned"
LABELS = {
    FAIR: "fair baseline DAG (hook connection + 1 query)",
    IDEMPOTENT: "idempotent DAG, all no-op",
}
RATIO_LIMIT = 1.10
FIRST_DATE = dt.date(2026, 1, 5)  # windows go forward from here; all must have ended


def partitions(size: Size) -> int:
    """Partitions per pass: 90 at size full (3 x the daily end-to-end window)."""
    return size.airflow_dates * 3


class _Windows:
    def __init__(self) -> None:
        self.next = FIRST_DATE

    def take(self, days: int) -> dt.date:
        first, self.next = self.next, self.next + dt.timedelta(days=days)
        if self.next >= dt.datetime.now(dt.timezone.utc).date():
            raise RuntimeError(f"window {first} + {days} days reaches today: move FIRST_DATE")
        return first


def _complete_keys(dsn: str, first: dt.date, days: int) -> None:
    """The idempotent DAG's keys of a window, completed without Airflow: the partition of
    day D (``D T00:00:00``) has run key D."""
    import psycopg

    from airflow_idempotency.runner import run_idempotently

    for day in range(days):
        key = (first + dt.timedelta(days=day)).isoformat()
        for task in range(1, TASKS + 1):
            run_idempotently(
                connect=lambda: psycopg.connect(dsn),
                job_name=f"{IDEMPOTENT}.step_{task}",
                run_key=key,
                work=lambda _run: None,
            )


def _pass(stack: AirflowStack, dag_id: str, first: dt.date, days: int) -> dict[str, float]:
    """One backfill over the window's partitions (both bounds inclusive); its figures."""
    last = first + dt.timedelta(days=days - 1)
    runs = stack.backfill(
        dag_id,
        f"{first.isoformat()}T00:00:00+00:00",
        f"{last.isoformat()}T00:00:00+00:00",
        timeout=120 + 8 * days,
    )
    runs = [r for r in runs if r.backfill_id == stack.last_backfill_id]
    if len(runs) != days or {r.state for r in runs} != {"success"}:
        raise RuntimeError(
            f"{dag_id}: {len(runs)} runs, states {sorted({str(r.state) for r in runs})}"
        )
    rows = stack.query(
        "SELECT ti.start_date, ti.end_date, ti.state FROM task_instance ti "
        "JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id "
        "WHERE r.backfill_id = ?",
        (stack.last_backfill_id,),
    )
    if len(rows) != days * TASKS or {r["state"] for r in rows} != {"success"}:
        raise RuntimeError(f"{dag_id}: unexpected task instances {[tuple(r) for r in rows][:5]}")
    parse_ms, decision_ms = [], []
    for run in runs:
        for task_id in (f"step_{i}" for i in range(1, TASKS + 1)):
            log = stack.task_log(dag_id, run.run_id, task_id)
            if found := _PARSE_MS.search(log):
                parse_ms.append(float(found.group(1)))
            if (decided := _decision_ms(log)) is not None:
                decision_ms.append(decided)
    starts = [_ts(r["start_date"]) for r in rows]
    ends = [_ts(r["end_date"]) for r in rows]
    durations = [(e - s).total_seconds() for s, e in zip(starts, ends, strict=True)]
    return {
        "wall": stack.timings["last_backfill"],
        "span": (max(ends) - min(starts)).total_seconds(),
        "task": sum(durations) / len(durations),
        "parse_ms": median(parse_ms) if parse_ms else float("nan"),
        "decision_ms": median(decision_ms) if decision_ms else float("nan"),
    }


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("partitions_e2e", TITLE)
    days = partitions(size)
    home = Path(tempfile.mkdtemp(prefix="bench-partitions-"))
    timed: dict[str, list[dict[str, float]]] = {FAIR: [], IDEMPOTENT: []}
    windows = _Windows()
    result.notes.append(f"load average at start: {load_average()}")
    try:
        with contextlib.ExitStack() as es:
            dsn = es.enter_context(database(server, "bench_partitions"))
            env = {
                **airflow_env.connection_env(dsn),
                **bytecode_env(home),
                **SUPERVISOR_ENV,
            }
            stack = es.enter_context(airflow_stack(home / "home", DAGS_FOLDER, extra_env=env))
            say(f"partitions: stack up in {stack.timings.get('start', 0):.0f} s")
            for dag_id in (FAIR, IDEMPOTENT):
                stack.unpause(dag_id)
            if size.airflow_warmup:  # untimed: parsing, caches; the idempotent DAG works
                warm = windows.take(2)
                for dag_id in (FAIR, IDEMPOTENT):
                    _pass(stack, dag_id, warm, 2)
            for round_no in range(size.airflow_rounds):
                window = windows.take(days)
                order = (FAIR, IDEMPOTENT) if round_no % 2 == 0 else (IDEMPOTENT, FAIR)
                for dag_id in order:
                    since = _now(dsn)
                    if dag_id == IDEMPOTENT:
                        _complete_keys(dsn, window, days)
                    figures = _pass(stack, dag_id, window, days)
                    if dag_id == IDEMPOTENT:
                        _check_noops(dsn, since, days)
                    timed[dag_id].append(figures)
                    say(
                        f"partitions: {dag_id} wall {figures['wall']:.1f} s, span "
                        f"{figures['span']:.1f} s, task {figures['task']:.3f} s"
                    )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    settle = SETTLE_SECONDS if size.name == "full" else 0
    result.notes.append(f"load average at end: {settled_load_average(timeout=settle)}")
    _report(result, timed, days, size)
    return result


def _report(
    result: BenchResult, timed: dict[str, list[dict[str, float]]], days: int, size: Size
) -> None:
    def med(dag_id: str, key: str) -> float:
        return median([f[key] for f in timed[dag_id]])

    for dag_id in (FAIR, IDEMPOTENT):
        result.add(
            f"backfill wall, {LABELS[dag_id]}",
            med(dag_id, "wall"),
            "s",
            note=f"{days} partitions x {TASKS} tasks; passes: "
            + ", ".join(f"{f['wall']:.1f}" for f in timed[dag_id])
            + " s",
        )
        result.add(
            f"mean task duration, {LABELS[dag_id]}",
            med(dag_id, "task") * 1000,
            "ms",
            note=f"median over passes of the mean of {days * TASKS} task instances",
        )
    ratio: Any = med(IDEMPOTENT, "task") / med(FAIR, "task")
    result.add(
        "ratio idempotent / fair, mean task duration",
        ratio,
        "x",
        f"<= {RATIO_LIMIT:g}",
        at_most(ratio, RATIO_LIMIT),
        f"{med(IDEMPOTENT, 'task') * 1000:.0f} vs {med(FAIR, 'task') * 1000:.0f} ms",
    )
    span = med(IDEMPOTENT, "span") / med(FAIR, "span")
    result.add(
        "ratio idempotent / fair, task span",
        span,
        "x",
        f"<= {RATIO_LIMIT:g}",
        at_most(span, RATIO_LIMIT),
        "first task start -> last task end",
    )
    result.add(
        "no-op decision inside the idempotent task, median",
        med(IDEMPOTENT, "decision_ms"),
        "ms",
        note="task log: operator's first line -> runner's no-op line (run key from the partition)",
    )
    result.add(
        "DAG-file parse in the task process, idempotent",
        med(IDEMPOTENT, "parse_ms"),
        "ms",
        note=f"fair {med(FAIR, 'parse_ms'):.0f} ms (median, from the task logs)",
    )
    result.notes.append(
        f"{days} daily partitions per pass (CronPartitionTimetable, no logical dates), "
        f"{TASKS} chained tasks per run, {size.airflow_rounds} timed pass(es) per DAG on "
        "fresh partitions, the DAGs alternating which goes first; the idempotent keys of "
        "each window completed in-process before its pass (every idempotent pass is checked "
        "to record partitions x 3 `noop` attempts). devtools.airflow_stack (SQLite metadata, "
        "LocalExecutor, parallelism 4, `[workers] min_heartbeat_interval` 1 s; the provider "
        "loaded from bytecode), as "
        "bench/airflow_e2e.py."
    )
