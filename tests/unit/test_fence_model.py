"""The fence protocol checked exhaustively with spin (issue 30, item 3; docs/fence.md).

tests/model/fence.pml models two attempts of one run key with up to three fenced transactions
each (the run lock and its holder's identity, the fence lock's queue, the check at COMMIT, a
lock session lost at any moment, a reused pid); spin explores every interleaving. The real model
must hold every property; each variant that reintroduces a known defect (issue 30's defects 1
and 2, a holder named by its pid alone) must make spin report a violation. The model names the
SQL it models and records a checksum of it: a change of the fence's SQL fails here until the
model has been reviewed against it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import ROOT

MODEL = ROOT / "tests" / "model" / "fence.pml"
SQL = ROOT / "provider" / "airflow_idempotency" / "sql"


def _fence_migrations() -> tuple[str, ...]:
    """Every migration that defines a function of the fence (fence_*, run_lock_held_by, the lease
    mode's decision and release at commit: run_decide_lease, lease_*): a
    new one that redefines the fence changes the checksum the model records."""
    defines = re.compile(
        r"CREATE (OR REPLACE )?FUNCTION (fence_\w+|run_lock_held_by|run_decide_lease|lease_\w+)\("
    )
    return tuple(
        path.name
        for path in sorted((SQL / "migrations").glob("*.sql"))
        if defines.search(path.read_text(encoding="utf-8"))
    )


FENCE_MIGRATIONS = _fence_migrations()
TIMEOUT = 300  # seconds for each of spin, the C compiler and the verifier (about 1 s each)

NOT_MODELLED = {
    # statements that take part in the fence and decide nothing the model checks
    "lock_is_held_by": "the ledger's re-check before an external call: calls are not commits, "
    "and the model checks commits (tests/integration/test_ledger.py checks the calls)",
    "adopt_lock": "`adopt --apply` only tries the run lock and only writes a key without any "
    "record (adopt_run): no attempt, so nothing of an attempt to fence; a run that holds the "
    "key keeps it, by its lock or, after the lock, its live lease (lease_live; "
    "tests/integration/test_adopt.py, test_lease_visibility.py)",
    "lease_live": "an operator's take-over of an expired lease (reset, an effect's resolution, "
    "adopt --apply, under the key's advisory run lock): it tries the key's fence key EXCLUSIVE "
    "(never waits) and deletes the lease under it, as an advisory start does; it records no "
    "attempt and fences nothing of its own, and the model's attempts are the runner's "
    "(tests/integration/test_lease_adversary2.py races it with the holder's start and "
    "completion)",
}
_DECIDES = re.compile(
    r"\{schema\}\.(fence_\w+|run_lock_held_by|run_decide\w*)\(|pg_try_advisory_xact_lock"
    r"|\{schema\}\.lease_releases\b"
)
_READS_HOLDER = re.compile(r"\{schema\}\.held_run_locks\(")
_WRITES = re.compile(r"^\s*(WITH\b.*)?\b(UPDATE|INSERT|DELETE)\b", re.MULTILINE | re.DOTALL)


def touches_fence(text: str) -> bool:
    """Whether a statement takes part in the fence: it calls a fence function or tries the run
    lock, or it writes under a check of the lock's holder (reading the holders to show them
    decides nothing)."""
    return bool(_DECIDES.search(text) or (_READS_HOLDER.search(text) and _WRITES.search(text)))


def _queries() -> dict[str, str]:
    from airflow_idempotency._sql import named_queries

    return named_queries((SQL / "queries.sql").read_text(encoding="utf-8"))


def _modelled_names() -> set[str]:
    return set(re.findall(r"sql: (\w+)", MODEL.read_text(encoding="utf-8")))


def fence_sql_checksum() -> str:
    """sha256 of the fence's SQL: the migrations that define it and the queries modelled."""
    digest = hashlib.sha256()
    for name in FENCE_MIGRATIONS:
        digest.update((SQL / "migrations" / name).read_bytes())
    queries = _queries()
    for name in sorted(_modelled_names()):
        digest.update(f"-- name: {name}\n{queries.get(name, '')}\n".encode())
    return digest.hexdigest()


def _spin() -> str:
    found = shutil.which("spin")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("spin is missing (.ci/run installs Debian's spin)")
        pytest.skip("spin is missing: apt-get install spin")
    return found


def verify(tmp_path: Path, *flags: str) -> str:
    """spin's verdict on the model built with ``flags`` (every interleaving: a safety search
    for assertion violations and invalid end states, i.e. hangs)."""
    spin = _spin()
    shutil.copy(MODEL, tmp_path / MODEL.name)
    steps = [
        [spin, *flags, "-a", MODEL.name],
        ["cc", "-O2", "-DSAFETY", "-DCOLLAPSE", "-w", "-o", "pan", "pan.c"],
        ["./pan", "-m100000"],
    ]
    out = ""
    for step in steps:
        done = subprocess.run(
            step, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{' '.join(step)} failed:\n{out}"
    assert "errors:" in out, out
    return out


def _errors(out: str) -> int:
    match = re.search(r"errors: (\d+)", out)
    assert match, out
    return int(match.group(1))


def test_the_fence_holds_in_every_interleaving(tmp_path: Path) -> None:
    out = verify(tmp_path)
    assert _errors(out) == 0, out
    assert "Search not completed" not in out and "max search depth too small" not in out, out
    assert re.search(r"\b\d+ states, stored", out), out


@pytest.mark.parametrize(
    ("flags", "violation"),
    [
        # defect 1: the ledger's enter queues behind a successor's takeover that waits for the
        # work's open transaction; with today's bounded takeover, a wait cycle ...
        (["-DDEFECT1"], "assertion violated"),
        # ... and with b2bdd8d's unbounded takeover as well, both wait forever
        (["-DDEFECT1", "-DUNBOUNDED_TAKEOVER", "-DNO_CYCLE_MONITOR"], "invalid end state"),
        # defect 2: nested in the connection's own transaction, no check armed at COMMIT
        (["-DDEFECT2"], "assertion violated held_at_commit"),
        # the holder named by its pid alone: a successor's session reusing the pid passes
        (["-DPID_ONLY"], "assertion violated"),
        # the lease mode's completion committed without the fence's check at COMMIT
        (["-DLEASE", "-DLEASE_COMPLETION_UNFENCED"], "assertion violated"),
        # a renewal that does not compare the token: an expired holder takes its key back
        # from the successor that took it over (migration 18 renews by token only)
        (["-DLEASE", "-DLEASE_RENEW_UNCHECKED"], "assertion violated"),
        # the start takes over a run completed since the decision read it: a late completion
        # of the expired holder lands, and its successor does the work again
        (["-DLEASE", "-DSTART_TAKES_COMPLETED"], "assertion violated"),
    ],
    ids=[
        "defect1-cycle",
        "defect1-hang",
        "defect2-commit-after-loss",
        "pid-reuse",
        "lease-completion-unfenced",
        "lease-renewal-unchecked",
        "lease-late-completion-redone",
    ],
)
def test_a_reintroduced_defect_is_found(tmp_path: Path, flags: list[str], violation: str) -> None:
    out = verify(tmp_path, *flags)
    assert _errors(out) > 0, f"spin found nothing with {flags}:\n{out}"
    assert violation in out, out


def test_the_lease_mode_holds_in_every_interleaving(tmp_path: Path) -> None:
    """The lease mode (migration 0014, -DLEASE): the same properties, with the completion in a
    fenced transaction of its own and the lease released after it; a lease held until a
    successor takes it over, renewed by its holder while expired (migration 0018; the release at the completion's COMMIT, 0019)."""
    out = verify(tmp_path, "-DLEASE")
    assert _errors(out) == 0, out
    assert "Search not completed" not in out and "max search depth too small" not in out, out


def test_the_advisory_mode_holds_without_the_starts_read(tmp_path: Path) -> None:
    """The advisory mode's decision reads the run after the previous lock transaction ended
    (its COMMIT is the completion): the start's read of a completed run is only a guard there."""
    assert _errors(verify(tmp_path, "-DSTART_TAKES_COMPLETED")) == 0


def test_a_start_lands_only_before_a_successors_start(tmp_path: Path) -> None:
    """The model found it (migration 0012 fixed it): without the start's check of its own run
    lock, a start lands after a later lock holder's start."""
    assert _errors(verify(tmp_path, "-DSTART_UNCHECKED")) > 0


def test_the_model_names_existing_statements_and_every_fence_statement() -> None:
    queries = _queries()
    modelled = _modelled_names()
    unknown = sorted(modelled - queries.keys())
    assert not unknown, f"tests/model/fence.pml names statements that queries.sql lacks: {unknown}"
    touching = {name for name, text in queries.items() if touches_fence(text)}
    missing = sorted(touching - modelled - NOT_MODELLED.keys())
    assert not missing, (
        f"statements of queries.sql that touch the run lock or the fence are not in "
        f"tests/model/fence.pml: {missing}. Model each (a step named 'sql: <name>') or list it "
        "in NOT_MODELLED with the reason"
    )
    stale = sorted(NOT_MODELLED.keys() - queries.keys())
    assert not stale, f"NOT_MODELLED names statements that are gone: {stale}"


def test_the_model_matches_the_fence_sql() -> None:
    recorded = re.search(r"fence-sql-sha256: (\w+)", MODEL.read_text(encoding="utf-8"))
    assert recorded, "tests/model/fence.pml records no fence-sql-sha256"
    now = fence_sql_checksum()
    assert recorded.group(1) == now, (
        "the fence's SQL changed (migrations "
        f"{', '.join(FENCE_MIGRATIONS)} or the statements tests/model/fence.pml names): review "
        f"the model against it, then record fence-sql-sha256: {now}"
    )
