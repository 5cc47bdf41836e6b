"""A run key's output file through the contract, on a real filesystem (and Airflow's
ObjectStoragePath): moved into place only at its commit, untouched by a rerun, replaced
atomically by a forced one, refused when its content changes, and whole after crashes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_idempotency import RunContext
from airflow_idempotency.crashpoints import WAIT_ENV
from airflow_idempotency.effects.outputs import OutputFile
from airflow_idempotency.exceptions import InvalidInputError, OutputConflictError
from airflow_idempotency.runner import RunOutcome
from support.effects import EFFECTS_WORKER, crashed_worker, ledger, run_once

NAME = "exports/2026-10-01.csv"


def write(
    dsn: str,
    root: Any,
    content: str,
    *,
    force: bool = False,
    path: Any = NAME,
    job: str = "job",
    fail_after: bool = False,
) -> Any:
    """One run of (job, 2026-10-01) writing ``content`` to the output: what commit() said,
    "noop" when the runner found the key completed, or the error raised. ``fail_after``: the
    work fails after the file's commit (the key stays not completed)."""
    out: dict[str, Any] = {}

    def work(run: RunContext) -> dict[str, Any]:
        try:
            with OutputFile(run, path, root=root) as f:
                f.write_text(content)
        except Exception as exc:
            out["error"] = exc
            raise
        out["outcome"] = f.outcome
        if fail_after:
            raise RuntimeError("a later step of the work failed")
        return {"output": f.outcome}

    try:
        result = run_once(dsn, work, job=job, force=force)
    except Exception:
        assert "error" in out or fail_after
        return out.get("error") or out["outcome"]
    return "noop" if result.outcome is RunOutcome.NOOP else out["outcome"]


def stat(path: Path) -> tuple[int, int, bytes]:
    info = path.stat()
    return info.st_mtime_ns, info.st_ino, path.read_bytes()


def test_written_once_then_untouched_by_reruns(pg_dsn: str, tmp_path: Path) -> None:
    """The first run writes the file; a no-op rerun of the completed key, and a rerun of a key whose work failed after the commit, leave content, mtime and inode untouched; no temporary file is left."""
    assert write(pg_dsn, tmp_path, "a,b\n1,2\n", job="job", fail_after=True) == "written"
    final = tmp_path / NAME
    before = stat(final)
    time.sleep(0.02)
    assert write(pg_dsn, tmp_path, "a,b\n1,2\n") == "unchanged"  # the key had failed
    assert stat(final) == before
    assert write(pg_dsn, tmp_path, "a,b\n1,2\n") == "noop"  # now completed: the work is skipped
    assert stat(final) == before
    assert sorted(p.name for p in final.parent.iterdir()) == ["2026-10-01.csv"]
    rows = ledger(pg_dsn)
    assert [(r[0], r[1]) for r in rows.values()] == [("succeeded", "file")]
    assert list(rows) == [NAME]


def test_changed_content_is_refused_unless_forced(pg_dsn: str, tmp_path: Path) -> None:
    """Other content for a committed file of a key that did not complete is refused with an error naming it, and the file stays; a forced run replaces it atomically (a new inode, never a partial file)."""
    write(pg_dsn, tmp_path, "v1\n", fail_after=True)
    final = tmp_path / NAME
    before = stat(final)
    error = write(pg_dsn, tmp_path, "v2\n")
    assert isinstance(error, OutputConflictError)
    assert f"output file {NAME!r} of job 'job' run key '2026-10-01'" in str(error)
    assert "force=true" in str(error)
    assert stat(final) == before
    assert write(pg_dsn, tmp_path, "v2\n", force=True) == "written"
    _mtime, inode, content = stat(final)
    assert content == b"v2\n" and inode != before[1]
    assert write(pg_dsn, tmp_path, "v2\n", force=True) == "written"  # forced: replaced again
    assert stat(final)[1] != inode
    other_job = write(pg_dsn, tmp_path, "v3\n", job="another_job")  # one file, one content
    assert isinstance(other_job, OutputConflictError)


def test_forced_replacement_is_atomic_for_readers(pg_dsn: str, tmp_path: Path) -> None:
    """While a forced run is paused between writing and committing its content, readers of the final name see the whole old file; then the whole new one."""
    write(pg_dsn, tmp_path, "old\n" * 1000)
    gate = tmp_path / "go"
    env = {**os.environ, WAIT_ENV: f"files.after_write={gate}"}
    seen: list[bytes] = []
    proc = subprocess.Popen(
        [sys.executable, str(EFFECTS_WORKER), "file", pg_dsn,
         str(tmp_path), NAME, "new\n" * 5000],
        env={**env, "EFFECTS_FORCE": "1"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def reader() -> None:
        while proc.poll() is None:
            seen.append((tmp_path / NAME).read_bytes())

    thread = threading.Thread(target=reader)
    thread.start()
    deadline = time.monotonic() + 60
    while not list((tmp_path / "exports").glob(".*.partial")) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert (tmp_path / NAME).read_bytes() == b"old\n" * 1000
    gate.touch()
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    thread.join()
    assert set(seen) <= {b"old\n" * 1000, b"new\n" * 5000}
    assert (tmp_path / NAME).read_bytes() == b"new\n" * 5000


@pytest.mark.parametrize("point", ["files.after_write", "files.after_rename"])
def test_crash_between_write_and_commit_then_rerun(pg_dsn: str, tmp_path: Path, point: str) -> None:
    """A worker SIGKILLed after writing (before the commit) leaves the final file absent; killed after the rename (before the ledger recorded it) leaves it whole; either way the rerun commits its content, even a different one, and removes the temporary file."""
    proc = crashed_worker(point, "file", pg_dsn, str(tmp_path), NAME, "first attempt\n")
    assert proc.returncode == -9, proc.stderr[-2000:]
    final = tmp_path / NAME
    if point == "files.after_write":
        assert not final.exists()
        assert len(list(final.parent.glob(".*.partial"))) == 1
    else:
        assert final.read_text() == "first attempt\n"
        assert [r[0] for r in ledger(pg_dsn).values()] == ["pending"]
    assert write(pg_dsn, tmp_path, "second attempt\n") == "written"
    assert final.read_text() == "second attempt\n"
    assert sorted(p.name for p in final.parent.iterdir()) == ["2026-10-01.csv"]
    assert [r[0] for r in ledger(pg_dsn).values()] == ["succeeded"]


@pytest.mark.parametrize(
    "path", ["../elsewhere.csv", "/etc/passwd", "exports/../../x.csv", "link/out.csv"]
)
def test_a_path_outside_the_root_is_refused(pg_dsn: str, tmp_path: Path, path: str) -> None:
    """A path that leaves the allowed root (.., absolute, through a symlink) is refused with an error naming the effect, before anything is written."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    error = write(pg_dsn, root, "x", path=path)
    assert isinstance(error, InvalidInputError)
    assert f"output file {path!r} of job 'job'" in str(error)
    assert "outside the allowed root" in str(error)
    assert ledger(pg_dsn) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_an_error_in_the_work_leaves_the_file_alone(pg_dsn: str, tmp_path: Path) -> None:
    """Work that fails inside the block commits nothing: the final file keeps its content and no temporary file is left."""
    write(pg_dsn, tmp_path, "v1\n")

    def work(run: RunContext) -> None:
        with OutputFile(run, NAME, root=tmp_path) as f:
            f.write_text("half")
            raise RuntimeError("upstream data missing")

    with pytest.raises(RuntimeError):
        run_once(pg_dsn, work, force=True)
    assert (tmp_path / NAME).read_text() == "v1\n"
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["2026-10-01.csv"]


def test_dry_run_writes_nothing(pg_dsn: str, tmp_path: Path) -> None:
    """A dry run reports what it would write and leaves no file and no ledger row."""

    def work(run: RunContext) -> dict[str, Any]:
        with OutputFile(run, NAME, root=tmp_path) as f:
            f.write_text("x")
        return {"output": f.outcome}

    result = run_once(pg_dsn, work, dry_run=True)
    assert result.counts == {"output": "would write"}
    assert not (tmp_path / NAME).exists() and ledger(pg_dsn) == {}


def test_object_storage_path(pg_dsn: str, tmp_path: Path) -> None:
    """Airflow's ObjectStoragePath (file://) gets the same contract: written, untouched by a rerun, refused when changed, and refused outside its root."""
    from airflow_idempotency.compat import ObjectStoragePath

    root = ObjectStoragePath(f"file://{tmp_path}/store")
    assert write(pg_dsn, root, "v1", fail_after=True) == "written"
    final = tmp_path / "store" / NAME
    before = stat(final)
    assert write(pg_dsn, root, "v1", fail_after=True) == "unchanged"
    assert stat(final) == before
    assert isinstance(write(pg_dsn, root, "v2"), OutputConflictError)
    outside = ObjectStoragePath(f"file://{tmp_path}/other.csv")
    error = write(pg_dsn, root, "x", path=outside, job="elsewhere")
    assert isinstance(error, InvalidInputError) and "outside the allowed root" in str(error)
    assert stat(final) == before
    assert write(pg_dsn, root, "v2", force=True) == "written"
    assert final.read_text() == "v2" and stat(final)[1] != before[1]


def test_a_lost_attempt_does_not_restore_the_file(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A committed file changed by hand is restored by the next attempt only under the fence: an attempt that lost its lock after its claim moves nothing into place and ends with LockLostError."""
    from airflow_idempotency.crashpoints import FAULT_DIR_ENV
    from airflow_idempotency.exceptions import LockLostError
    from support.locks import terminate_lock_session

    assert write(pg_dsn, tmp_path, "committed\n", fail_after=True) == "written"
    (tmp_path / NAME).write_text("changed by hand\n")
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv(FAULT_DIR_ENV, str(faults))
    armed = faults / "ledger.after_claim.stall"
    armed.write_text("2")

    def lose_the_lock_during_the_stall() -> None:
        deadline = time.monotonic() + 30
        while armed.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        terminate_lock_session(pg_dsn, "job", "2026-10-01")

    thread = threading.Thread(target=lose_the_lock_during_the_stall)
    thread.start()
    outcome = write(pg_dsn, tmp_path, "committed\n")
    thread.join()
    assert isinstance(outcome, LockLostError), outcome
    assert (tmp_path / NAME).read_text() == "changed by hand\n"
