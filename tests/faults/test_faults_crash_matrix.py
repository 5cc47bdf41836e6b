"""Crash matrix: finalize_invoices SIGKILLed at every fault point, then rerun with no faults.

Each scenario gets its own job database (150 orders of 2026-10-01, seed 7) and its own
accounting service. A real ``airflow dags test`` worker runs the scheduled run of
2026-10-02 01:00 (2026-10-01 01:00 on Airflow 2.11: support.faults.FIRE) with
``AIRFLOW_IDEMPOTENCY_CRASH_AT`` set and dies at the point; a second
worker reruns the same date with no faults. The rerun must leave exactly the state of an
uninterrupted run of the same seed in another database (the reference), row for row,
without one duplicate and without resending an export the ledger had confirmed.

Scenarios run two at a time in the background as soon as the module starts (one worker
process per crash plus one per rerun); each test waits for its own scenario, so a test's
pytest duration is its waiting time; the real worker times are among its printed figures.

A subset runs in the lease mode too (ids ``-lease``: the job connection's extra
``lock_mode: lease``, ``lease_ttl`` 5 s, support.faults.lock_extra): a crash right after the
lease was taken, after the start, mid-export and mid-rebuild of the totals. The dead worker
leaves its lease behind (no session ends with it); the rerun takes it over once it expired and
must converge to the same reference state. The other points run the same code in both modes
(the work and the ledger do not know how the key is held).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.db import rows
from support.faults import (
    NO_PROBLEMS,
    check_consistency,
    connection_env,
    figures,
    final_state,
    finish,
    invoicing_world,
    lease_rows,
    lock_extra,
    lock_modes_used,
    service_counts,
    spawn_worker,
    wait_for_expired_leases,
)
from support.locks import advisory_locks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.both_airflow_lines,
    pytest.mark.usefixtures("airflow_home"),
]

ORDERS = 150
BATCH = 20  # small batches, so that "mid batch" and "later batch" points exist
PARALLEL = 2  # scenarios at once (this is a 2-core machine)


@dataclass(frozen=True)
class CrashPoint:
    """Where to crash (``point@N``), which task that hits, and what the crash must leave."""

    spec: str
    task: str
    # Expected right after the crash: invoices created, export rows confirmed in the ledger,
    # remote invoices (a range: calls in flight when the process died may still land).
    invoices: int | None = None
    confirmed: int | None = None
    remote: tuple[int, int] | None = None
    jobs_completed: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.spec


POINTS = [
    CrashPoint("runner.after_lock@1", "create_invoices", 0, 0, (0, 0)),
    CrashPoint("runner.after_started@1", "create_invoices", 0, 0, (0, 0)),
    CrashPoint("invoices.before_commit@1", "create_invoices", 0, 0, (0, 0)),
    CrashPoint("invoices.after_commit@1", "create_invoices", ORDERS, 0, (0, 0)),
    CrashPoint("runner.before_completion@1", "create_invoices", ORDERS, 0, (0, 0)),
    CrashPoint("totals.after_delete@1", "rebuild_totals", ORDERS, 0, (0, 0), ("create_invoices",)),
    CrashPoint(
        "ledger.after_claim@1",
        "export_invoices",
        ORDERS,
        0,
        (0, 0),
        ("create_invoices", "rebuild_totals"),
    ),
    # The 7th call of the first batch: six requests are in flight when the process dies.
    CrashPoint(
        "ledger.before_remote_call@7",
        "export_invoices",
        ORDERS,
        0,
        (0, 6),
        ("create_invoices", "rebuild_totals"),
    ),
    # Mid second batch: the service committed 33 invoices, the ledger confirmed only 20.
    CrashPoint(
        "ledger.after_remote_commit@33",
        "export_invoices",
        ORDERS,
        20,
        (33, 40),
        ("create_invoices", "rebuild_totals"),
    ),
    # The whole second batch committed remotely, not one of its outcomes recorded.
    CrashPoint(
        "ledger.before_record_outcomes@2",
        "export_invoices",
        ORDERS,
        20,
        (40, 40),
        ("create_invoices", "rebuild_totals"),
    ),
    # The third batch claimed (pending), nothing of it sent.
    CrashPoint(
        "ledger.after_claim@3",
        "export_invoices",
        ORDERS,
        40,
        (40, 40),
        ("create_invoices", "rebuild_totals"),
    ),
    # Every export confirmed, the completion not recorded.
    CrashPoint(
        "runner.before_completion@3",
        "export_invoices",
        ORDERS,
        ORDERS,
        (ORDERS, ORDERS),
        ("create_invoices", "rebuild_totals"),
    ),
]


LEASE_POINTS = [
    p
    for p in POINTS
    if p.spec
    in (
        "runner.after_lock@1",
        "runner.after_started@1",
        "totals.after_delete@1",
        "ledger.before_record_outcomes@2",
    )
]
"""The points that also run in the lease mode: where the run holds its lease and nothing else
(just taken; its start recorded), and mid-work (a rebuild of the totals, an export batch)."""

SCENARIOS = [pytest.param(p, "advisory", id=str(p)) for p in POINTS] + [
    pytest.param(p, "lease", id=f"{p}-lease") for p in LEASE_POINTS
]


@dataclass
class Outcome:
    """What one scenario did, measured in its worker thread, asserted by its test."""

    crash_code: int = 0
    crash_output: str = ""
    crash_seconds: float = 0.0
    middle: dict[str, Any] = field(default_factory=dict)
    middle_counts: dict[str, int] = field(default_factory=dict)
    middle_locks: int = -1
    rerun_code: int = 0
    rerun_output: str = ""
    rerun_seconds: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)
    final_counts: dict[str, int] = field(default_factory=dict)
    problems: dict[str, Any] = field(default_factory=dict)
    final_locks: int = -1
    attempts: list[tuple[str, str, str | None]] = field(default_factory=list)
    middle_leases: int = -1
    lease_wait: float = 0.0
    final_leases: int = -1
    modes: set[str] = field(default_factory=set)


def attempts(dsn: str) -> list[tuple[str, str, str | None]]:
    return [
        (job.removeprefix("finalize_invoices."), outcome, error)
        for job, outcome, error in rows(
            dsn,
            "SELECT job_name, outcome, error FROM idempotency.job_run_attempts ORDER BY attempt_id",
        )
    ]


def run_scenario(
    pg_server: Any, airflow_home: Path, homes: Path, crash_at: str | None, lock_mode: str
) -> Outcome:
    """Seed a fresh world; crash a worker at ``crash_at`` (if any); rerun with no faults; the
    job connection's runs in ``lock_mode``."""
    out = Outcome()
    with invoicing_world(pg_server, ORDERS) as (dsn, service):
        extra = lock_extra(lock_mode)
        env = connection_env(dsn, service.url, job_extra=extra, batch_size=BATCH)
        label = f"{crash_at or 'reference'}-{lock_mode}".replace("@", "-")
        if crash_at:
            started = time.monotonic()
            crashed = spawn_worker(
                airflow_home,
                homes / f"{label}-crash",
                dsn,
                {**env, "AIRFLOW_IDEMPOTENCY_CRASH_AT": crash_at},
            )
            out.crash_code, out.crash_output, _ = finish(crashed)
            out.crash_seconds = time.monotonic() - started
            out.middle_counts = service_counts(service)  # also lets in-flight calls land
            out.middle = final_state(dsn)
            out.middle_locks = advisory_locks(dsn)
            out.middle_leases = lease_rows(dsn)
            # The rerun after the dead worker's lease expired (lease_ttl 5 s): one started
            # sooner is refused lock_held until then, and waits for Airflow's retry.
            out.lease_wait = wait_for_expired_leases(dsn)
        started = time.monotonic()
        rerun = spawn_worker(airflow_home, homes / f"{label}-run", dsn, env)
        out.rerun_code, out.rerun_output, _ = finish(rerun)
        out.rerun_seconds = time.monotonic() - started
        out.final_counts = service_counts(service)
        out.final = final_state(dsn)
        out.problems = check_consistency(dsn)
        out.final_locks = advisory_locks(dsn)
        out.final_leases = lease_rows(dsn)
        out.attempts = attempts(dsn)
        out.modes = lock_modes_used(dsn)
    return out


class Matrix:
    """The scenarios selected in this session, running ``PARALLEL`` at a time."""

    def __init__(self, submit: Any, selected: list[tuple[str, str]]) -> None:
        reference = ("reference", "advisory")
        self.futures: dict[tuple[str, str], Future[Outcome]] = {reference: submit(None, "advisory")}
        for spec, lock_mode in selected:
            self.futures[spec, lock_mode] = submit(spec, lock_mode)

    def result(self, spec: str, lock_mode: str = "advisory") -> Outcome:
        return self.futures[spec, lock_mode].result(timeout=1200)


@pytest.fixture(scope="module")
def matrix(
    request: pytest.FixtureRequest,
    pg_server: Any,
    airflow_home: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """Start every selected scenario (and the reference run) in the background."""
    selected = [
        (str(item.callspec.params["point"]), str(item.callspec.params["lock_mode"]))
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    ]
    homes = tmp_path_factory.mktemp("crash-matrix")
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="crash") as pool:
        scenarios = Matrix(
            lambda spec, mode: pool.submit(
                run_scenario, pg_server, airflow_home, homes, spec, mode
            ),
            selected,
        )
        yield scenarios
        for future in scenarios.futures.values():
            future.cancel()  # only those not started yet (e.g. after a KeyboardInterrupt)


def tail(text: str) -> str:
    return text[-4000:]


@pytest.mark.parametrize(("point", "lock_mode"), SCENARIOS)
def test_crash_then_rerun_converges_to_the_uninterrupted_state(
    matrix: Matrix, point: CrashPoint, lock_mode: str
) -> None:
    """A worker SIGKILLed at this fault point leaves a state whose no-fault rerun equals an uninterrupted run row for row, with no duplicate and no confirmed export resent."""
    reference = matrix.result("reference")
    assert reference.rerun_code == 0, tail(reference.rerun_output)
    assert reference.problems == NO_PROBLEMS
    assert len(reference.final["remote"]) == ORDERS
    out = matrix.result(point.spec, lock_mode)
    figures(
        f"{lock_mode} mode: "
        f"crash worker {out.crash_seconds:.1f} s (exit {out.crash_code}), "
        f"left {len(out.middle['invoices'])} invoices, "
        f"{sum(s == 'succeeded' for _, s in out.middle['ledger'])} confirmed of "
        f"{len(out.middle['ledger'])} ledger rows, {len(out.middle['remote'])} remote; "
        + (f"{out.lease_wait:.1f} s until its lease expired; " if lock_mode == "lease" else "")
        + f"rerun {out.rerun_seconds:.1f} s sent "
        f"{out.final_counts['requests'] - out.middle_counts['requests']} requests "
        f"({out.final_counts['replays'] - out.middle_counts['replays']} replays)"
    )

    # 1. The crash happened where it was asked to, and the hit task did not complete.
    name, _, nth = point.spec.partition("@")
    assert f"fault point {name}@{nth}: SIGKILL" in out.crash_output, tail(out.crash_output)
    assert out.crash_code != 0
    jobs = out.middle["jobs"]
    assert jobs.get(point.task) != "completed", jobs
    assert {job for job, status in jobs.items() if status == "completed"} == set(
        point.jobs_completed
    ), jobs
    assert out.middle_locks == 0  # the dead worker's locks went with its sessions
    # Its lease (the lease mode) stays until it expires: nothing ends with its sessions.
    assert out.middle_leases == (1 if lock_mode == "lease" else 0)
    middle = out.middle
    confirmed = sum(status == "succeeded" for _, status in middle["ledger"])
    assert len(middle["invoices"]) == point.invoices
    assert confirmed == point.confirmed
    low, high = point.remote or (0, ORDERS)
    assert low <= len(middle["remote"]) <= high, len(middle["remote"])

    # 2. The rerun converged to exactly the reference state.
    assert out.rerun_code == 0, tail(out.rerun_output)
    assert out.final == reference.final
    assert out.problems == NO_PROBLEMS
    assert out.final["uninvoiced_orders"] == 0
    assert set(out.final["jobs"].values()) == {"completed"}
    assert out.final_locks == 0
    assert out.final_leases == 0  # the rerun took the dead worker's over, then released it
    assert out.modes == {lock_mode}  # every attempt that held its key held it so

    # 3. The rerun sent only what the ledger had not confirmed, each key once (no retries
    #    were needed: no faults), and created exactly the invoices the service lacked.
    rerun_requests = out.final_counts["requests"] - out.middle_counts["requests"]
    assert rerun_requests == ORDERS - confirmed
    created = out.final_counts["invoices"] - out.middle_counts["invoices"]
    assert created == ORDERS - len(middle["remote"])
    assert (
        out.final_counts["replays"] - out.middle_counts["replays"]
        == len(middle["remote"]) - confirmed
    )

    # 4. Every attempt is on record: the crashed one (its process died without a word) was
    #    closed by the rerun's takeover as abandoned, the rerun completed the hit task, and
    #    nothing else ran twice.
    hit = [(outcome, error) for job, outcome, error in out.attempts if job == point.task]
    if point.spec.startswith("runner.after_lock"):
        assert hit == [("completed", None)]  # it died before recording an attempt
    else:
        assert [outcome for outcome, _ in hit] == ["lock_lost", "completed"], hit
        assert (hit[0][1] or "").startswith("abandoned"), hit
    for job in point.jobs_completed:
        assert [o for j, o, _ in out.attempts if j == job] == ["completed", "noop"]
