"""DAGs used by the core tests that run ``airflow dags test`` in separate OS processes.

Behaviour comes from environment variables read when the file is parsed, so a test can
start two workers of the same DAG with different settings.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Iterator

import pendulum
from airflow.providers.common.compat.sdk import DAG
from airflow.timetables.trigger import CronTriggerTimetable

from airflow_idempotency import (
    Effect,
    IdempotentRunOperator,
    OutboundLedger,
    RunContext,
    idempotency_params,
    post_json,
)


def _hold(file: str | None) -> None:
    """Wait until ``file`` exists (at most IDEM_TEST_HOLD_MAX seconds)."""
    deadline = time.monotonic() + float(os.environ.get("IDEM_TEST_HOLD_MAX", "120"))
    while file and not os.path.exists(file) and time.monotonic() < deadline:
        time.sleep(0.1)  # keep the lock (and whatever else) until the test says so


def slow_work(run: RunContext) -> dict[str, int]:
    """Record that the work ran (committed at once, so tests see it), then sleep or hold."""
    with run.transaction() as cur:
        # Two workers creating the table at the same moment can both pass IF NOT EXISTS and
        # collide in the catalog (UniqueViolation on pg_type): serialize the creation.
        cur.execute("SELECT pg_advisory_xact_lock(hashtext('public.work_log'))")
        cur.execute(
            "CREATE TABLE IF NOT EXISTS public.work_log"
            " (run_key text, pid int, at timestamptz DEFAULT now(), phase text DEFAULT 'start')"
        )
        cur.execute(
            "INSERT INTO public.work_log (run_key, pid) VALUES (%s, %s)", (run.run_key, os.getpid())
        )
    if os.environ.get("IDEM_TEST_FAIL"):
        raise RuntimeError(f"failing on purpose (IDEM_TEST_FAIL): {run.run_key}")
    time.sleep(float(os.environ.get("IDEM_TEST_SLEEP", "0")))
    if os.environ.get("IDEM_TEST_UPDATE_COUNTER"):
        # A row lock held by an open transaction (public.counter is made by the test); with
        # IDEM_TEST_HOLD_IN_TRANSACTION the hold happens before this transaction commits.
        with run.transaction() as cur:
            cur.execute(
                "UPDATE public.counter SET n = n + 1, by_pid = %s WHERE id = 1", (os.getpid(),)
            )
            if os.environ.get("IDEM_TEST_HOLD_IN_TRANSACTION"):
                _hold(os.environ.get("IDEM_TEST_HOLD_FILE"))
    _hold(os.environ.get("IDEM_TEST_HOLD_FILE"))
    if os.environ.get("IDEM_TEST_WRITE_AFTER_HOLD"):
        # A fenced write at the end: it commits only if this run still holds its lock.
        with run.transaction() as cur:
            cur.execute(
                "INSERT INTO public.work_log (run_key, pid, phase) VALUES (%s, %s, 'end')",
                (run.run_key, os.getpid()),
            )
    return {"slept": int(float(os.environ.get("IDEM_TEST_SLEEP", "0")))}


with DAG(
    dag_id="core_slow_job",
    # Airflow 3's @daily on both lines: `dags test core_slow_job D` processes D - 1.
    schedule=CronTriggerTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params=idempotency_params(),
):
    IdempotentRunOperator(
        task_id="work",
        python_callable=slow_work,
        job_name=os.environ.get("IDEM_TEST_JOB_NAME", "core_slow_job"),
        on_locked=os.environ.get("IDEM_TEST_ON_LOCKED", "reschedule"),  # type: ignore[arg-type]
        reschedule_interval=dt.timedelta(seconds=1),
        lock_timeout=dt.timedelta(seconds=float(os.environ.get("IDEM_TEST_LOCK_TIMEOUT", "3600"))),
    )


def export_work(run: RunContext) -> dict[str, int]:
    """Send IDEM_TEST_EFFECTS effects to the accounting service at IDEM_TEST_REMOTE_URL through
    the ledger, 20 a batch; with IDEM_TEST_HOLD_AT_EFFECT=N, producing effect N waits for
    IDEM_TEST_HOLD_FILE, while the claim of the batch before it is still open."""
    count = int(os.environ.get("IDEM_TEST_EFFECTS", "200"))
    hold_at = int(os.environ.get("IDEM_TEST_HOLD_AT_EFFECT", "0"))

    def effects() -> Iterator[Effect]:
        for i in range(1, count + 1):
            if i == hold_at:
                _hold(os.environ.get("IDEM_TEST_HOLD_FILE"))
            yield Effect(f"core_export:{run.run_key}:{i}", {"n": i, "run_key": run.run_key})

    ledger = OutboundLedger(run, "accounting", batch_size=20, concurrency=4)
    summary = ledger.send_all(
        effects(),
        post_json("/api/invoices"),
        base_url=os.environ["IDEM_TEST_REMOTE_URL"],
        timeout=5,
    )
    return summary.as_counts("exports")


with DAG(
    dag_id="core_export_job",
    schedule=CronTriggerTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params=idempotency_params(),
):
    IdempotentRunOperator(
        task_id="export",
        python_callable=export_work,
        on_locked=os.environ.get("IDEM_TEST_ON_LOCKED", "reschedule"),  # type: ignore[arg-type]
        reschedule_interval=dt.timedelta(seconds=1),
    )


# A task mapped over segments: one key per segment (eu|D, us|D), as `run` judges them.
with DAG(
    dag_id="core_segmented_job",
    schedule=CronTriggerTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params=idempotency_params(),
):
    IdempotentRunOperator.partial(task_id="work", python_callable=slow_work).expand(
        key_segment=["eu", "us"]
    )
