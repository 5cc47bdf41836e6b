"""Partitioned runs (Airflow 3.2+, AIP-76) on a real Airflow 3.3 stack: scheduler,
dag-processor, api-server, PostgreSQL for Airflow's metadata and for the job records.

Every path a partition reaches a task by: scheduled runs of a CronPartitionTimetable,
a partition key from REST and from Airflow's own trigger form (Chromium), ``airflow
backfill create`` over partitions with each reprocess behaviour, Clear, asset events
feeding a PartitionedAssetTimetable (an hourly producer, a daily consumer), keys typed at
run time, a mapped task per segment with two overlapping runs, the partitioned invoice
example, the migration of a cron DAG to partitions, and bad input. One stack for the module.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools import airflow_env
from devtools.airflow_stack import AirflowStack, RunResult, StackError
from devtools.postgres import PostgresServer, temporary_database
from support import ROOT, TESTS
from support.browser import new_page

pytestmark = pytest.mark.slow


# The migration test's DAG file, before and after: one line changes.
MIGRATION_DAG = """
import pendulum
from airflow.sdk import DAG, CronPartitionTimetable
from airflow_idempotency import IdempotentRunOperator
from airflow_idempotency import RunContext


def work(run: RunContext) -> dict[str, int]:
    with run.transaction() as cur:
        cur.execute(
            "CREATE TABLE IF NOT EXISTS public.part_work (job text, run_key text,"
            " at timestamptz DEFAULT now())"
        )
        cur.execute("INSERT INTO public.part_work VALUES (%s, %s)", (run.job_name, run.run_key))
    return {{"worked": 1}}


with DAG(
    dag_id="mig_daily",
    schedule={schedule},
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    end_date=pendulum.datetime(2026, 10, 31, tz="UTC"),
    catchup=False,
    default_args={{"retries": 0}},
):
    IdempotentRunOperator(task_id="work", python_callable=work)
"""
# [START migration_cron]
CRON = '"0 1 * * *"'
# [END migration_cron]
# [START migration_partitioned]
PARTITIONED = 'CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1)'
# [END migration_partitioned]


class PartitionStack(AirflowStack):
    """The stack, with the job database and the calls the tests share."""

    job_dsn: str

    def trigger_partition(
        self,
        dag_id: str,
        partition_key: str | None,
        conf: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> RunResult:
        """A manual run with ``partition_key`` and no logical date, through REST."""
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if partition_key is not None:
            body["partition_key"] = partition_key
        run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)
        if not wait:
            found = self.dag_run(dag_id, run["dag_run_id"])
            assert found is not None
            return found
        return self.wait_for_runs(dag_id, [run["dag_run_id"]], timeout=180)[0]

    def jobs(self, sql: str, params: Any = ()) -> list[Any]:
        """Rows of a statement on the job database ([] for one that returns none)."""
        with psycopg.connect(self.job_dsn) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def outcomes(self, job: str) -> dict[str, list[str]]:
        """Each key of ``job``: its attempts' outcomes, oldest first."""
        found: dict[str, list[str]] = {}
        for key, outcome in self.jobs(
            "SELECT run_key, outcome FROM idempotency.job_run_attempts WHERE job_name = %s"
            " ORDER BY attempt_id",
            (job,),
        ):
            found.setdefault(key, []).append(outcome)
        return found

    def work_done(self, job: str) -> dict[str, int]:
        """How often the work itself ran, per key (the test DAGs' part_work table)."""
        rows = self.jobs(
            "SELECT run_key, count(*) FROM public.part_work WHERE job = %s GROUP BY 1", (job,)
        )
        return dict(rows)

    def partition_of(self, dag_id: str, run_id: str) -> tuple[str | None, Any]:
        row = self._query_one(
            "SELECT partition_key, partition_date FROM dag_run WHERE dag_id = ? AND run_id = ?",
            (dag_id, run_id),
        )
        return row["partition_key"], row["partition_date"]

    def asset_events(self, asset_name: str) -> list[tuple[str | None, str | None]]:
        """(partition_key, source run id) of every event of an asset, oldest first."""
        rows = self.query(
            "SELECT e.partition_key, e.source_run_id FROM asset_event e"
            " JOIN asset a ON a.id = e.asset_id WHERE a.name = ? ORDER BY e.id",
            (asset_name,),
        )
        return [(r[0], r[1]) for r in rows]

    def runs_of(self, dag_id: str, partition_key: str) -> list[RunResult]:
        return [
            r
            for r in self.dag_runs(dag_id)
            if self.partition_of(dag_id, r.run_id)[0] == partition_key
        ]

    def wait_until(self, predicate: Any, timeout: float, what: str) -> Any:
        return self._wait(predicate, timeout, what, log="scheduler", interval=0.5)

    def settled(self, dag_id: str) -> bool:
        """No asset event for ``dag_id`` waits for its run, and none of its runs is busy."""
        pending = self._query_one(
            "SELECT count(*) FROM asset_partition_dag_run"
            " WHERE target_dag_id = ? AND created_dag_run_id IS NULL",
            (dag_id,),
        )[0]
        busy = [r for r in self.dag_runs(dag_id) if r.state not in ("success", "failed")]
        return pending == 0 and not busy


@pytest.fixture(scope="module")
def stack(
    pg_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PartitionStack]:
    base = tmp_path_factory.mktemp("partitions")
    dags = base / "dags"
    dags.mkdir()
    shutil.copy(TESTS / "dags_partitions" / "partition_dags.py", dags)
    shutil.copy(ROOT / "dags" / "partitioned_invoices.py", dags)
    shutil.copytree(ROOT / "dags" / "invoicing", dags / "invoicing")
    (dags / "mig_daily.py").write_text(MIGRATION_DAG.format(schedule=CRON))
    with (
        temporary_database(pg_server, "idem_part_jobs") as job_dsn,
        temporary_database(pg_server, "idem_part_airflow") as metadata_dsn,
    ):
        extra_env = {
            **airflow_env.connection_env(job_dsn),
            # Scheduled runs and the partitioned asset runs are both made by the scheduler's
            # schedule loop; DAGs that must not run by themselves have an end_date.
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "True",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        stack = PartitionStack(base / "home", dags, extra_env, metadata_dsn=metadata_dsn)
        stack.job_dsn = job_dsn
        try:
            stack.start(240)
            yield stack
        finally:
            stack.stop()


def test_scheduled_partitioned_runs_are_keyed_by_their_partition(stack: PartitionStack) -> None:
    """The scheduler's own runs of a CronPartitionTimetable(run_offset=-1) DAG (caught up
    from three days ago) carry partition keys and no logical date; each works the day its
    partition names, once."""
    stack.unpause("part_scheduled")
    runs = stack.wait_until(
        lambda: (
            found
            if len(found := [r for r in stack.dag_runs("part_scheduled") if r.state == "success"])
            >= 3
            else None
        ),
        240,
        "three scheduled runs of part_scheduled",
    )
    stack.pause("part_scheduled")
    for run in runs:
        assert run.run_type == "scheduled" and run.logical_date is None
        partition_key, partition_date = stack.partition_of("part_scheduled", run.run_id)
        day = str(partition_date)[:10]
        assert partition_key == f"{day}T01:00:00"
        assert stack.jobs(
            "SELECT status, triggered_by FROM idempotency.job_runs WHERE run_id = %s",
            (run.run_id,),
        ) == [("completed", "scheduled")]
        assert stack.work_done("part_scheduled.work")[day] == 1


def test_a_rest_trigger_works_its_partition_once_and_a_noop_emits_no_event(
    stack: PartitionStack,
) -> None:
    """A run triggered through REST with partition_key 2026-10-05T01:00:00 processes
    2026-10-05 and emits its asset event with that partition key; the same partition
    triggered again is a no-op that emits no asset event (no downstream double work)."""
    stack.unpause("part_daily")
    first = stack.trigger_partition("part_daily", "2026-10-05T01:00:00")
    assert first.state == "success"
    assert stack.jobs(
        "SELECT run_key, details->>'partition_key', triggered_by FROM idempotency.job_run_attempts"
        " WHERE run_id = %s",
        (first.run_id,),
    ) == [("2026-10-05", "2026-10-05T01:00:00", "manual")]
    events = stack.asset_events("part_daily_done")
    assert events == [("2026-10-05T01:00:00", first.run_id)]
    again = stack.trigger_partition("part_daily", "2026-10-05T01:00:00")
    assert again.state == "success"
    assert stack.outcomes("part_daily.work")["2026-10-05"] == ["completed", "noop"]
    assert stack.work_done("part_daily.work")["2026-10-05"] == 1
    assert stack.asset_events("part_daily_done") == events
    assert "no asset event for 1 outlet(s)" in stack.task_log("part_daily", again.run_id, "work")


def test_backfill_over_partitions_with_each_reprocess_behaviour(stack: PartitionStack) -> None:
    """backfill create over four partitions works each once (one fails); again with
    reprocess none it creates nothing; failed reruns the failed one only, which now
    completes; completed reruns all four, each a no-op."""
    job = "part_daily.work"
    stack.jobs("CREATE TABLE IF NOT EXISTS public.part_fail (run_key text PRIMARY KEY)")
    stack.jobs("INSERT INTO public.part_fail VALUES ('2026-10-03')")
    bounds = ("2026-10-01T01:00:00+00:00", "2026-10-04T01:00:00+00:00")
    days = ["2026-10-01", "2026-10-02", "2026-10-03", "2026-10-04"]
    first = stack.backfill("part_daily", *bounds, timeout=300)
    assert sorted((stack.partition_of("part_daily", r.run_id)[0], r.state) for r in first) == [
        (f"{d}T01:00:00", "failed" if d == "2026-10-03" else "success") for d in days
    ]
    assert all(r.run_type == "backfill" and r.logical_date is None for r in first)
    assert stack.jobs(
        "SELECT error FROM idempotency.job_run_attempts WHERE run_key = '2026-10-03'"
    ) == [("RuntimeError: part_fail lists 2026-10-03",)]

    again = stack.backfill("part_daily", *bounds, timeout=120)
    assert again == []  # every partition has a run: Airflow creates none
    assert stack.backfill_entries(stack.last_backfill_id or 0)[0].exception_reason

    stack.jobs("DELETE FROM public.part_fail")
    failed = stack.backfill("part_daily", *bounds, reprocess_behavior="failed", timeout=300)
    assert [(stack.partition_of("part_daily", r.run_id)[0], r.state) for r in failed] == [
        ("2026-10-03T01:00:00", "success")
    ]
    completed = stack.backfill("part_daily", *bounds, reprocess_behavior="completed", timeout=300)
    assert [r.state for r in completed] == ["success"] * 4
    outcomes = stack.outcomes(job)
    for day in days:
        assert outcomes[day][-1] == "noop", (day, outcomes[day])
    assert outcomes["2026-10-03"][:2] == ["failed", "completed"]
    assert {d: stack.work_done(job)[d] for d in days} == dict.fromkeys(days, 1)


def test_clear_of_a_partitioned_run_reruns_its_key(stack: PartitionStack) -> None:
    """Clearing a completed partitioned run reruns its task with the same run key: a no-op."""
    (run,) = [
        r for r in stack.runs_of("part_daily", "2026-10-02T01:00:00") if r.run_type == "backfill"
    ][:1]
    before = stack.outcomes("part_daily.work")["2026-10-02"]
    stack.api(
        "POST",
        "/api/v2/dags/part_daily/clearTaskInstances",
        {"dag_run_id": run.run_id, "dry_run": False, "only_failed": False, "reset_dag_runs": True},
    )
    stack.wait_until(
        lambda: len(stack.outcomes("part_daily.work")["2026-10-02"]) > len(before) or None,
        180,
        "the cleared task to run again",
    )
    rerun = stack.wait_for_runs("part_daily", [run.run_id], timeout=180)[0]
    assert rerun.state == "success"
    assert stack.outcomes("part_daily.work")["2026-10-02"] == [*before, "noop"]


def test_an_hourly_producer_feeds_a_daily_consumer_that_works_each_day_once(
    stack: PartitionStack,
) -> None:
    """Nine hourly partitions of two days (a backfill of the producer) make Airflow run the
    StartOfDayMapper consumer for each day at least once; each day's work runs once. A
    producer hour run again is a no-op with no event; an event re-emitted for a completed
    day makes Airflow run the consumer again, and that run is a no-op."""
    stack.unpause("part_daily_consumer")
    stack.unpause("part_hourly")
    for first, last in (
        ("2026-10-01T00:00:00", "2026-10-01T05:00:00"),
        ("2026-10-02T00:00:00", "2026-10-02T02:00:00"),
    ):
        runs = stack.backfill("part_hourly", f"{first}+00:00", f"{last}+00:00", timeout=300)
        assert [r.state for r in runs] == ["success"] * len(runs)
    assert len(stack.asset_events("part_hourly_events")) == 9
    consumer = "part_daily_consumer.work"

    def consumed() -> dict[str, int] | None:
        done = stack.work_done(consumer)
        both = set(done) == {"2026-10-01", "2026-10-02"}
        return done if both and stack.settled("part_daily_consumer") else None

    assert stack.wait_until(consumed, 240, "the consumer to work both days") == {
        "2026-10-01": 1,
        "2026-10-02": 1,
    }
    consumer_runs = stack.dag_runs("part_daily_consumer")
    assert all(r.run_type == "asset_triggered" and r.state == "success" for r in consumer_runs)
    assert {stack.partition_of("part_daily_consumer", r.run_id)[0] for r in consumer_runs} == {
        "2026-10-01",
        "2026-10-02",
    }

    # The producer's hour again: a no-op, no event, so no consumer run.
    again = stack.trigger_partition("part_hourly", "2026-10-01T03:00:00")
    assert again.state == "success"
    assert stack.outcomes("part_hourly.work")["2026-10-01T03Z"] == ["completed", "noop"]
    assert len(stack.asset_events("part_hourly_events")) == 9

    # An event for a completed day, sent by hand: Airflow runs the consumer, a no-op.
    (asset_id,) = [
        a["id"]
        for a in stack.api("GET", "/api/v2/assets")["assets"]
        if a["name"] == "part_hourly_events"
    ]
    stack.api(
        "POST",
        "/api/v2/assets/events",
        {"asset_id": asset_id, "partition_key": "2026-10-01T07:00:00"},
    )
    stack.wait_until(
        lambda: (
            (
                len(stack.outcomes(consumer)["2026-10-01"]) > 1
                and stack.settled("part_daily_consumer")
            )
            or None
        ),
        180,
        "the consumer's run for the re-emitted event",
    )
    assert stack.outcomes(consumer)["2026-10-01"][-1] == "noop"
    assert stack.work_done(consumer) == {"2026-10-01": 1, "2026-10-02": 1}


def test_keys_typed_at_run_time_keep_their_segments(stack: PartitionStack) -> None:
    """PartitionedAtRuntime keys: eu|2026-10-01 and us|2026-10-01 are two keys recorded
    apart; a label-only key is its own key."""
    stack.unpause("part_runtime")
    for key in ("eu|2026-10-01", "us|2026-10-01", "all_regions"):
        assert stack.trigger_partition("part_runtime", key).state == "success"
    assert stack.work_done("part_runtime.work") == {
        "eu|2026-10-01": 1,
        "us|2026-10-01": 1,
        "all_regions": 1,
    }


@pytest.mark.parametrize(
    ("partition_key", "conf", "message"),
    [
        (" eu|2026-10-01", {}, "leading/trailing blanks"),
        ("eu||2026-10-01", {}, "is empty"),
        ("x" * 220, {}, "220 characters long; at most 200"),
        ("eu|2026-13-01", {}, "written like a time but is none"),
        ("eu|2026-10-01|2026-10-02", {}, "2 time segments"),
        ("eu|2026-10-01", {"run_key": "eu|2026-10-02"}, "contradicts the run's partition_key"),
    ],
)
def test_bad_partition_keys_fail_at_once_and_write_nothing(
    stack: PartitionStack, partition_key: str, conf: dict[str, Any], message: str
) -> None:
    """A malformed or too long partition-derived key, or a conf run_key contradicting the
    partition: the task fails without a retry, the log names the rule, nothing is written."""
    stack.unpause("part_runtime")
    before = stack.jobs("SELECT count(*) FROM idempotency.job_run_attempts")[0][0]
    run = stack.trigger_partition("part_runtime", partition_key, conf)
    assert run.state == "failed"
    (ti,) = stack.task_instances("part_runtime", run.run_id)
    assert (ti.state, ti.try_number) == ("failed", 1)
    assert message in stack.task_log("part_runtime", run.run_id, "work")
    assert stack.jobs("SELECT count(*) FROM idempotency.job_run_attempts")[0][0] == before


def test_airflow_refuses_empty_keys_itself_and_an_override_is_explicit(
    stack: PartitionStack,
) -> None:
    """An empty or blank partition key never reaches a task (Airflow's REST API refuses it);
    a contradicting conf run_key with run_key_overrides_partition processes the conf's key."""
    for blank in ("", "   "):
        with pytest.raises(StackError, match=r"-> (400|422)"):
            stack.trigger_partition("part_runtime", blank, wait=False)
    run = stack.trigger_partition(
        "part_runtime",
        "eu|2026-10-03",
        {"run_key": "eu|2026-10-04", "run_key_overrides_partition": True},
    )
    assert run.state == "success"
    assert stack.jobs(
        "SELECT run_key FROM idempotency.job_run_attempts WHERE run_id = %s", (run.run_id,)
    ) == [("eu|2026-10-04",)]
    assert "overriding the run's partition_key 'eu|2026-10-03'" in stack.task_log(
        "part_runtime", run.run_id, "work"
    )


def test_a_mapped_task_per_segment_with_two_overlapping_runs(stack: PartitionStack) -> None:
    """Two runs of the mapped DAG for one partition at once: each region's key is locked
    and worked once; the other run's instance of it is a no-op."""
    stack.unpause("part_mapped")
    runs = [
        stack.trigger_partition("part_mapped", "2026-10-07T01:00:00", wait=False) for _ in range(2)
    ]
    done = stack.wait_for_runs("part_mapped", [r.run_id for r in runs], timeout=240)
    assert [r.state for r in done] == ["success", "success"]
    keys = ["apac|2026-10-07", "eu|2026-10-07", "us|2026-10-07"]
    assert stack.work_done("part_mapped.work") == dict.fromkeys(keys, 1)
    outcomes = stack.outcomes("part_mapped.work")
    for key in keys:
        assert sorted(o for o in outcomes[key] if o != "lock_held") == ["completed", "noop"], (
            outcomes
        )


def test_the_partitioned_invoice_example(stack: PartitionStack) -> None:
    """invoice_regions invoices each region of a day once (mapped, composite keys) and its
    regional events make regional_reconciliation reconcile each region's day once; a forced
    producer rerun re-emits the events, and the consumer's runs for them are no-ops."""
    import sys

    sys.path.insert(0, str(ROOT / "dags"))
    from invoicing.seed import seed_orders

    with psycopg.connect(stack.job_dsn, autocommit=True) as conn:
        seed_orders(conn, dt.date(2026, 10, 1), dt.date(2026, 10, 1), 60, 7)
    # Unpaused, invoice_regions also makes its scheduled run for yesterday's partition:
    # everything below looks at the partition of 2026-10-01 only.
    stack.unpause("regional_reconciliation")
    stack.unpause("invoice_regions")
    keys = ["eu|2026-10-01", "us|2026-10-01"]
    run = stack.trigger_partition("invoice_regions", "2026-10-01T01:00:00")
    assert run.state == "success"

    def events() -> list[tuple[str | None, str | None]]:
        return [e for e in stack.asset_events("regional_invoices") if "2026-10-01" in str(e[0])]

    assert sorted(events()) == [
        ("eu|2026-10-01T01:00:00", run.run_id),
        ("us|2026-10-01T01:00:00", run.run_id),
    ]

    def reconciled(attempts: int) -> Any:
        rows = stack.jobs(
            "SELECT region, runs FROM region_reconciliation"
            " WHERE business_date = '2026-10-01' ORDER BY 1"
        )
        made = stack.outcomes("regional_reconciliation")
        done = sum(len(made.get(k, [])) for k in keys) >= attempts
        return rows if done and stack.settled("regional_reconciliation") else None

    assert stack.wait_until(lambda: reconciled(2), 240, "both regions reconciled") == [
        ("eu", 1),
        ("us", 1),
    ]
    invoices = stack.jobs("SELECT count(*) FROM invoices WHERE business_date = '2026-10-01'")
    assert invoices == [(60,)]

    forced = stack.trigger_partition("invoice_regions", "2026-10-01T01:00:00", {"force": True})
    assert forced.state == "success"
    assert len(events()) == 4
    rows = stack.wait_until(lambda: reconciled(4), 240, "the consumer's runs for the events")
    assert rows == [("eu", 1), ("us", 1)]  # the consumer's second runs were no-ops
    made = stack.outcomes("regional_reconciliation")
    assert {k: made[k] for k in keys} == {k: ["completed", "noop"] for k in keys}
    assert stack.jobs("SELECT count(*) FROM invoices WHERE business_date = '2026-10-01'") == [(60,)]


def test_a_cron_dag_moved_to_partitions_keeps_its_completed_keys(stack: PartitionStack) -> None:
    """Dates completed on schedule="0 1 * * *" (a backfill), then the same DAG file on
    CronPartitionTimetable("0 1 * * *", run_offset=-1) backfilled over the same business
    dates: every task is a no-op, nothing runs again."""
    stack.unpause("mig_daily")
    cron_runs = stack.backfill(
        "mig_daily", "2026-10-02T01:00:00+00:00", "2026-10-04T01:00:00+00:00", timeout=300
    )
    assert [r.state for r in cron_runs] == ["success"] * 3
    days = ["2026-10-01", "2026-10-02", "2026-10-03"]
    assert stack.work_done("mig_daily.work") == dict.fromkeys(days, 1)

    (stack.dags_folder / "mig_daily.py").write_text(MIGRATION_DAG.format(schedule=PARTITIONED))
    stack.wait_until(
        lambda: stack._query_one(
            "SELECT 1 FROM serialized_dag WHERE dag_id = 'mig_daily'"
            " AND CAST(data AS TEXT) LIKE ?",  # a parameter: psycopg reads % in the text
            ("%CronPartitionTimetable%",),
        ),
        120,
        "mig_daily to be parsed again with its partitioned timetable",
    )
    part_runs = stack.backfill(
        "mig_daily", "2026-10-01T01:00:00+00:00", "2026-10-03T01:00:00+00:00", timeout=300
    )
    assert [r.state for r in part_runs] == ["success"] * 3
    assert sorted(str(stack.partition_of("mig_daily", r.run_id)[0]) for r in part_runs) == [
        f"{d}T01:00:00" for d in days
    ]
    assert stack.outcomes("mig_daily.work") == {d: ["completed", "noop"] for d in days}
    assert stack.work_done("mig_daily.work") == dict.fromkeys(days, 1)


# ---------------------------------------------------------------- the browser


def test_in_the_browser_the_trigger_forms_partition_key(
    browser: Any, stack: PartitionStack, tmp_path: Path
) -> None:
    """Airflow's own trigger form has a Partition Key field for a partitioned DAG; the run
    triggered with 2026-10-09T01:00:00 typed there processes 2026-10-09."""
    stack.unpause("part_daily")
    page = new_page(browser)
    page.goto(f"{stack.base_url}/dags/part_daily")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    field = dialog.get_by_label("Partition Key")
    if not field.is_visible():  # in the form's collapsed "Advanced Options"
        dialog.get_by_text("Advanced Options").first.click()
    field.fill("2026-10-09T01:00:00")
    page.screenshot(path=tmp_path / "trigger-partition-key.png")
    dialog.get_by_role("button", name="Trigger").click()
    page.wait_for_url("**/dags/part_daily/runs/manual__*")
    run_id = urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1].split("/")[0])
    run = stack.wait_for_runs("part_daily", [run_id], timeout=180)[0]
    assert run.state == "success", stack.describe_runs("part_daily", [run_id])
    assert stack.partition_of("part_daily", run_id)[0] == "2026-10-09T01:00:00"
    assert stack.jobs(
        "SELECT run_key, status FROM idempotency.job_runs WHERE run_id = %s", (run_id,)
    ) == [("2026-10-09", "completed")]
    page.context.close()
