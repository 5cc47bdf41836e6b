"""The operator CLI against a real job database, and `run` through real Airflow processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.cli import main
from support.cli import airflow_cli, cli_process_with
from support.locks import run_lock_holders
from support.workers import TEST_DAGS, kill_group, private_airflow_env, start_worker, wait_until

pytestmark = pytest.mark.both_airflow_lines


def complete(dsn: str, job: str, key: str, fail: bool = False) -> None:
    def work(run: RunContext) -> dict[str, int]:
        if fail:
            raise RuntimeError("boom")
        return {"n": 1}

    with contextlib.suppress(RuntimeError):
        run_idempotently(connect=lambda: psycopg.connect(dsn), job_name=job, run_key=key, work=work)


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    # Only what the command prints: the runs made above log to stdout on Airflow 2.
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_show_and_filters(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`runs` lists and filters job runs; `show` gives a run with every attempt."""
    complete(pg_dsn, "job_a", "2026-10-01")
    complete(pg_dsn, "job_a", "2026-10-01")
    complete(pg_dsn, "job_a", "2026-10-02", fail=True)
    complete(pg_dsn, "job_b", "2026-10-03")
    runs = cli_json(capsys, "runs", "--dsn", pg_dsn)
    assert [(r["job_name"], r["run_key"], r["status"]) for r in runs] == [
        ("job_b", "2026-10-03", "completed"),
        ("job_a", "2026-10-02", "failed"),
        ("job_a", "2026-10-01", "completed"),
    ]
    failed = cli_json(capsys, "runs", "--dsn", pg_dsn, "--status", "failed")
    assert [r["run_key"] for r in failed] == ["2026-10-02"]
    window = cli_json(
        capsys,
        "runs",
        "--dsn",
        pg_dsn,
        "--job",
        "job_a",
        "--from",
        "2026-10-01",
        "--to",
        "2026-10-01",
    )
    assert [r["run_key"] for r in window] == ["2026-10-01"]
    shown = cli_json(capsys, "show", "job_a", "2026-10-01", "--dsn", pg_dsn)
    assert [a["outcome"] for a in shown["attempts"]] == ["completed", "noop"]
    assert main(["runs", "--dsn", pg_dsn]) == 0  # the human table renders
    assert "job_a" in capsys.readouterr().out


def test_reset_failed_run_records_reason(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`reset` marks a failed run with the reason and records a reset attempt; a completed one is refused."""
    complete(pg_dsn, "job", "2026-10-02", fail=True)
    assert (
        main(
            [
                "reset",
                "job",
                "2026-10-02",
                "--reason",
                "upstream file re-delivered",
                "--dsn",
                pg_dsn,
            ]
        )
        == 0
    )
    assert "reset job 2026-10-02 to failed" in capsys.readouterr().out
    shown = cli_json(capsys, "show", "job", "2026-10-02", "--dsn", pg_dsn)
    assert shown["run"]["details"]["reset_reason"] == "upstream file re-delivered"
    assert shown["attempts"][-1]["outcome"] == "reset"
    complete(pg_dsn, "job", "2026-10-03")
    assert main(["reset", "job", "2026-10-03", "--reason", "x", "--dsn", pg_dsn]) == 1


def test_ledger_and_locks_views(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`ledger` shows pending effects; `locks` shows who holds a run key right now."""
    complete(pg_dsn, "job", "2026-10-01")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name, run_key, request_fingerprint)"
            " VALUES ('accounting', 'job:2026-10-01:1', 'job', '2026-10-01', 'abc')"
        )
    ledger = cli_json(capsys, "ledger", "--dsn", pg_dsn)
    assert ledger["summary"][0]["status"] == "pending" and ledger["summary"][0]["effects"] == 1
    assert ledger["not_confirmed"][0]["idempotency_key"] == "job:2026-10-01:1"

    import threading

    inside, release = threading.Event(), threading.Event()

    def hold(run: RunContext) -> None:
        inside.set()
        release.wait(10)

    t = threading.Thread(
        target=lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name="job", run_key="2026-10-09", work=hold
        )
    )
    t.start()
    try:
        assert inside.wait(10)
        locks = cli_json(capsys, "locks", "--dsn", pg_dsn)
        assert [(lk["job_name"], lk["run_key"], lk["status"]) for lk in locks] == [
            ("job", "2026-10-09", "started")
        ]
        assert locks[0]["worker_pid"] == os.getpid()
        assert main(["reset", "job", "2026-10-09", "--reason", "stuck?", "--dsn", pg_dsn]) == 75
    finally:
        release.set()
        t.join()


@pytest.mark.parametrize("bad", ["2026-13-01", "yesterday", "2026-10-1"])
def test_run_refuses_malformed_dates_with_usage(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` with a malformed date exits 2 and prints the usage."""
    assert main(["run", "core_slow_job", "--date", bad, "--dsn", "host=/nonexistent"]) == 2
    assert "YYYY-MM-DD" in capsys.readouterr().err


def test_run_requires_a_date(capsys: pytest.CaptureFixture[str]) -> None:
    """`run` without --date exits 2 with the usage."""
    assert main(["run", "core_slow_job"]) == 2
    assert "--date" in capsys.readouterr().err


def cli_process(airflow_home: Path, dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return airflow_cli(airflow_home, dsn, TEST_DAGS, *argv)


def test_run_exit_codes_through_airflow(airflow_home: Path, pg_dsn: str, tmp_path: Path) -> None:
    """`run`: 0 when it completes, 0 (no-op) when completed already, 1 on failure, 75 when locked elsewhere."""
    first = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-01")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "completed" in first.stdout
    again = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-01")
    assert again.returncode == 0 and "no-op: already completed" in again.stdout
    future = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2099-01-01")
    assert future.returncode == 2 and "has not ended yet" in future.stderr  # refused input
    assert "nothing ran" in future.stderr

    release = tmp_path / "release"
    holder = start_worker(
        airflow_home, "core_slow_job", "2026-10-03", pg_dsn, {"IDEM_TEST_HOLD_FILE": str(release)}
    )
    try:
        wait_until(lambda: run_lock_holders(pg_dsn), timeout=90, what="the holder to take the lock")
        locked = cli_process(
            airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-02", "--json"
        )
        # Read through the Airflow connection (no --dsn): Airflow is imported and logs, and
        # stdout must still hold the JSON only.
        listed = cli_process(airflow_home, pg_dsn, "runs", "--json")
    finally:
        release.touch()
        holder.communicate(timeout=120)
        kill_group(holder)
    assert locked.returncode == 75, locked.stdout + locked.stderr
    assert json.loads(locked.stdout)["verdict"] == "locked elsewhere"
    assert listed.returncode == 0, listed.stdout + listed.stderr
    keys = {(r["run_key"], r["status"]) for r in json.loads(listed.stdout)}
    assert {("2026-10-01", "completed"), ("2026-10-02", "started")} <= keys  # holder runs


def test_run_judges_a_task_mapped_over_segments_by_every_segment(
    airflow_home: Path, pg_dsn: str
) -> None:
    """`run` of a DAG whose task is mapped over segments: completed (exit 0) when every
    segment's key completed, each listed; then a no-op; then exit 1 when a segment fails."""
    done = cli_process(airflow_home, pg_dsn, "run", "core_segmented_job", "--date", "2026-10-01",
                       "--json")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "completed"
    assert sorted((a["run_key"], a["outcome"]) for a in report["attempts"]) == [
        ("eu|2026-10-01", "completed"), ("us|2026-10-01", "completed"),
    ]  # fmt: skip
    again = cli_process(airflow_home, pg_dsn, "run", "core_segmented_job", "--date", "2026-10-01")
    assert again.returncode == 0 and "no-op: already completed" in again.stdout, again.stderr
    failing = cli_process_with(
        {**private_airflow_env(airflow_home, pg_dsn, TEST_DAGS), "IDEM_TEST_FAIL": "1"},
        "run", "core_segmented_job", "--date", "2026-10-02",
    )  # fmt: skip
    assert failing.returncode == 1 and "failed" in failing.stdout, failing.stderr


# -- the CLI package: what each part promises -----------------------------------------------

WITHOUT_AIRFLOW = """
import json, sys
sys.modules["airflow"] = None  # any `import airflow...` now raises ImportError
from airflow_idempotency.cli import main
dsn = sys.argv[1]
codes = {}
for argv in json.loads(sys.argv[2]):
    codes[" ".join(argv)] = main([*argv, "--dsn", dsn])
print(json.dumps(codes))
"""


def test_record_commands_work_where_airflow_cannot_be_imported(pg_dsn: str) -> None:
    """runs, show, locks, ledger, reset, migrate, gaps and prune with --dsn run in a process
    where importing Airflow fails: only the DAG commands need it."""
    complete(pg_dsn, "job", "2026-10-01")
    complete(pg_dsn, "job", "2026-10-02", fail=True)
    commands = [
        ["migrate"],
        ["runs", "--json"],
        ["runs", "--stale"],
        ["show", "job", "2026-10-01"],
        ["locks"],
        ["ledger", "--all"],
        ["gaps", "job", "--from", "2026-10-01", "--to", "2026-10-03"],
        ["prune", "--attempts-older-than", "400d", "--dry-run"],
        ["reset", "job", "2026-10-02", "--reason", "re-delivered"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_AIRFLOW, pg_dsn, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == {
        "migrate": 0,
        "runs --json": 0,
        "runs --stale": 0,
        "show job 2026-10-01": 0,
        "locks": 0,
        "ledger --all": 0,
        "gaps job --from 2026-10-01 --to 2026-10-03": 1,  # 10-02 failed, 10-03 missing
        "prune --attempts-older-than 400d --dry-run": 0,
        "reset job 2026-10-02 --reason re-delivered": 0,
    }, done.stderr
    assert "ImportError" not in done.stderr, done.stderr


def test_importing_the_cli_imports_no_airflow() -> None:
    """`import airflow_idempotency.cli` (every command module) loads no Airflow module."""
    code = (
        "import sys, airflow_idempotency.cli;"
        "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("code", "outcomes", "dry_run", "verdict"),
    [
        (0, ["completed"], False, ("completed", 0)),
        (0, ["dry_run"], True, ("dry run", 0)),
        (0, ["noop"], False, ("no-op: already completed", 0)),
        (0, ["noop", "completed"], False, ("completed", 0)),  # one task redid its key
        (1, ["lock_held"], False, ("locked elsewhere", 75)),
        (1, ["completed", "lock_held"], False, ("locked elsewhere", 75)),
        (1, ["failed"], False, ("failed", 1)),
        (0, ["completed", "lock_lost"], False, ("failed", 1)),
        (1, ["completed"], False, ("failed", 1)),  # Airflow failed after the task
        (0, [], False, ("failed", 1)),  # nothing recorded: the DAG never reached the task
    ],
)
def test_run_judges_airflow_exit_code_and_the_recorded_outcomes(
    code: int, outcomes: list[str], dry_run: bool, verdict: tuple[str, int]
) -> None:
    """`run`'s verdict: locked elsewhere wins, then any failure, then all no-ops, else done."""
    from airflow_idempotency.cli.run import judge

    judged = judge(code, outcomes, dry_run=dry_run)
    assert (judged.text, judged.exit_code) == verdict


def snapshot(dsn: str, schema: str = "idempotency") -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the bookkeeping schema."""
    with psycopg.connect(dsn) as conn:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s"
                " ORDER BY 1",
                (schema,),
            )
        ]
        return {
            t: conn.execute(f'SELECT * FROM {schema}."{t}" ORDER BY 1').fetchall() for t in tables
        }


def test_refused_input_writes_nothing(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused commands (a reset of a completed or never-run key or with a bad schema name, a
    reversed gaps range, an unknown job, an unreadable age) leave every table as it was."""
    complete(pg_dsn, "job", "2026-10-01")
    complete(pg_dsn, "job", "2026-10-02", fail=True)
    before = snapshot(pg_dsn)
    assert before["job_run_attempts"] and before["job_runs"]
    refused = {
        ("reset", "job", "2026-10-01", "--reason", "x"): 1,  # completed: force=true instead
        ("reset", "job", "2026-09-30", "--reason", "x"): 1,  # never run
        ("reset", "job", "2026-10-02", "--reason", "x", "--schema", "bad-name;"): 2,
        ("gaps", "job", "--from", "2026-10-03", "--to", "2026-10-01"): 2,
        ("gaps", "typo", "--from", "2026-10-01", "--to", "2026-10-02"): 2,
        ("prune", "--attempts-older-than", "1y"): 2,
        ("prune", "--attempts-older-than", "400d", "--batch-size", "0"): 2,
    }
    for argv, expected in refused.items():
        code = main([*argv, "--dsn", pg_dsn])
        assert code == expected, (argv, capsys.readouterr().err)
        assert "error:" in capsys.readouterr().err, argv
    assert snapshot(pg_dsn) == before


def private_tmp_env(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with its temporary files (`run`'s log) in a folder of the test's own."""
    logs = tmp_path / "tmp"
    logs.mkdir(exist_ok=True)
    return {**env, "TMPDIR": str(logs)}


def cli_logged(
    airflow_home: Path, dsn: str, tmp_path: Path, *argv: str, dags: Path | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    base = (
        private_airflow_env(airflow_home, dsn, dags)
        if dags
        else private_airflow_env(airflow_home, dsn)
    )
    return cli_process_with({**private_tmp_env(tmp_path, base), **extra}, *argv)


def run_logs(tmp_path: Path, date: str) -> list[Path]:
    """The logs `run` left for core_slow_job's ``date``."""
    return sorted((tmp_path / "tmp").glob(f"core_slow_job-{date}-*.log"))


def test_run_names_the_lock_holder_and_keeps_or_removes_its_log(
    airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """Exit 75 prints the holder (its worker's host, pid and attempt), the line stored in the
    `lock_held` row, and keeps the log; a success removes its log; a failure (exit 1) keeps it."""
    release = tmp_path / "release"
    holder = start_worker(
        airflow_home, "core_slow_job", "2026-10-03", pg_dsn, {"IDEM_TEST_HOLD_FILE": str(release)}
    )

    def holder_attempt() -> Any:
        with psycopg.connect(pg_dsn) as conn:
            table = conn.execute("SELECT to_regclass('idempotency.job_run_attempts')").fetchone()
            if table is None or table[0] is None:
                return None
            return conn.execute(
                "SELECT attempt_id, hostname, pid FROM idempotency.job_run_attempts"
                " WHERE run_key = '2026-10-02' AND outcome = 'running'"
            ).fetchone()

    try:
        attempt_id, hostname, pid = wait_until(
            holder_attempt, timeout=90, what="the holder's attempt"
        )
        locked = cli_logged(
            airflow_home, pg_dsn, tmp_path, "run", "core_slow_job", "--date", "2026-10-02"
        )
    finally:
        release.touch()
        holder.communicate(timeout=120)
        kill_group(holder)
    assert locked.returncode == 75, locked.stdout + locked.stderr
    lines = locked.stdout.splitlines()
    assert lines[0] == "core_slow_job 2026-10-02: locked elsewhere"
    with psycopg.connect(pg_dsn) as conn:
        ((error, details),) = conn.execute(
            "SELECT error, details FROM idempotency.job_run_attempts WHERE outcome = 'lock_held'"
        ).fetchall()
    assert lines[1] == error  # printed as recorded
    assert f"worker {hostname} pid {pid} (attempt {attempt_id}, dag core_slow_job" in error
    assert details["holder"]["attempt"]["attempt_id"] == attempt_id
    (kept,) = run_logs(tmp_path, "2026-10-02")
    assert f"log: {kept}" in locked.stdout and kept.stat().st_size > 0

    done = cli_logged(
        airflow_home, pg_dsn, tmp_path, "run", "core_slow_job", "--date", "2026-10-04"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "core_slow_job 2026-10-04: completed" in done.stdout and "log:" not in done.stdout
    assert run_logs(tmp_path, "2026-10-04") == []  # removed: the attempts say it all

    failed = cli_logged(
        airflow_home,
        pg_dsn,
        tmp_path,
        "run",
        "core_slow_job",
        "--date",
        "2026-10-05",
        IDEM_TEST_FAIL="1",
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "core_slow_job 2026-10-05: failed" in failed.stdout
    (kept,) = run_logs(tmp_path, "2026-10-05")
    assert f"log: {kept}" in failed.stdout
    assert "failing on purpose (IDEM_TEST_FAIL)" in kept.read_text()


def test_run_refuses_a_dag_without_the_operator_or_an_unended_date_writing_nothing(
    airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """`run` of a DAG with no idempotent task, or of a date that has not ended, exits 2 before
    Airflow runs anything: no bookkeeping schema is created, no log is left."""
    from devtools.airflow_env import DAGS_FOLDER

    plain = cli_logged(
        airflow_home,
        pg_dsn,
        tmp_path,
        "run",
        "idempotency_watch",
        "--date",
        "2026-10-01",
        dags=DAGS_FOLDER,
    )
    assert plain.returncode == 2, plain.stdout + plain.stderr
    assert "DAG 'idempotency_watch' has no IdempotentRunOperator" in plain.stderr
    future = cli_logged(
        airflow_home, pg_dsn, tmp_path, "run", "core_slow_job", "--date", "2099-01-01"
    )
    assert future.returncode == 2 and "has not ended yet" in future.stderr
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT to_regnamespace('idempotency')").fetchone() == (None,)
    assert list((tmp_path / "tmp").iterdir()) == []
