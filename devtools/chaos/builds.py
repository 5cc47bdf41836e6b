"""The builds chaos runs: the provider of this checkout, and deliberately broken copies of it.

A broken build is a patched COPY of ``provider/airflow_idempotency`` (in chaos's work folder,
first on the stack's PYTHONPATH): each proves that the checker catches a real regression.
Nothing in the provider knows about them. Each build carries the exposure that makes its
bug show at once (an opening of actions, the faults it needs, sleep points that widen the
window) and the invariants expected to catch it.

Retargeting: a patch is ``(file, old text, new text)`` and fails loudly when ``old`` is no
longer in the file. When the provider changes where a guarantee is enforced, change the
patches of its build here, nowhere else (``fence-off`` names today's fence checks).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from devtools.airflow_env import ROOT

PROVIDER = ROOT / "provider" / "airflow_idempotency"
CORRECT = "correct"


@dataclass(frozen=True)
class Patch:
    """Replace ``old`` (which must be there, once or more: the first is replaced) by ``new``."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Build:
    """A provider build and how chaos exposes it."""

    name: str
    what: str
    patches: tuple[Patch, ...] = ()
    # Invariants of which at least one must catch a broken build.
    caught_by: tuple[str, ...] = ()
    # Exposure: the first actions of the phase (then the seeded draws go on), action and
    # fault weights replacing chaos's defaults, the fault rate, AIRFLOW_IDEMPOTENCY_SLEEP_AT.
    opening: tuple[str, ...] = ()
    actions: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    fault_rate: float | None = None
    sleep_at: str = ""
    dates: int | None = None
    seed: int = 1  # of its phase's draws (a correct build runs with chaos's --seed)

    @property
    def broken(self) -> bool:
        return bool(self.patches)


LOCK_OFF = Build(
    "lock-off",
    "the run lock never excludes anyone: every run takes a lock key of its own",
    patches=(
        Patch("locks.py", "import hashlib\n", "import hashlib\nimport os\n"),
        Patch(
            "locks.py",
            'return _key(job_name.encode() + b"\\x1f" + run_key.encode())',
            'return _key(job_name.encode() + b"\\x1f" + run_key.encode() + os.urandom(8))',
        ),
    ),
    caught_by=(
        "no commit after a later attempt of the key started",
        "no two attempts' work transactions of one key overlap",
        "at most one completed execution per key unless forced (witness)",
    ),
    # Two runs of one key at once, each pausing 8 s after its start: the second starts
    # (and takes the key over) while the first still has its work to commit.
    opening=("pasted_twice", "manual_key"),
    actions={"pasted_twice": 4, "manual_key": 2, "scheduled": 2},
    fault_rate=0.0,
    sleep_at="runner.after_started=8",
    dates=2,
    seed=1101,
)

COMPLETED_CHECK_OFF = Build(
    "completed-check-off",
    "a completed key is run again: the runner no longer no-ops on a completed key",
    patches=(
        # The advisory mode decides in SQL (run_decide: migration 0022's, after 0021's) ...
        Patch(
            "sql/migrations/0022_decide_refuses_live_lease.sql",
            "IF r.status IS DISTINCT FROM 'completed' OR p_force THEN",
            "IF true THEN  -- broken build: completed-check-off",
        ),
        # ... and so does the lease mode (migration 0019's run_decide_lease).
        Patch(
            "sql/migrations/0019_lease_decide.sql",
            "IF r.status IS NOT DISTINCT FROM 'completed' AND NOT p_force THEN",
            "IF false THEN  -- broken build: completed-check-off",
        ),
        # ... and the start reads the run again after its take-over's wait (sql: start_attempt:
        # a completion that landed after the decision's read).
        Patch(
            "sql/queries.sql",
            "r.status = 'completed' AND NOT %(force)s AS noop",
            "false AS noop  -- broken build: completed-check-off",
        ),
    ),
    caught_by=(
        "at most one completed execution per key unless forced (witness)",
        "completed key never recomputed without force (attempt records)",
    ),
    # The same date twice in a row: the second run does the work again.
    opening=("manual_key", "manual_key", "scheduled"),
    actions={"manual_key": 3, "scheduled": 3},
    fault_rate=0.0,
    dates=1,
    seed=2202,
)

FENCE_OFF = Build(
    "fence-off",
    "an attempt whose lock was lost still commits: its fenced transactions (the work's and"
    " the ledger's claims) neither check the lock when they begin nor at COMMIT, and a"
    " takeover waits for none of them",
    patches=(
        # Today's fence (migrations 0006 and 0008, sql/queries.sql): the live lock check and the
        # shared fence lock as a fenced transaction's first statement ...
        Patch(
            "sql/queries.sql",
            "SELECT {schema}.fence_enter(%(lock_key)s, %(lock_backend_pid)s, %(lock_holder)s,\n"
            "                            %(attempt_id)s, %(lock_wait_ms)s),\n",
            "SELECT -- broken build: fence-off\n",
        ),
        # ... the commit-time check armed as its last statement ...
        Patch(
            "sql/queries.sql",
            "SELECT {schema}.fence_arm(%(lock_key)s, %(lock_backend_pid)s, %(lock_holder)s, "
            "%(attempt_id)s);",
            "SELECT 1;  -- broken build: fence-off",
        ),
        # ... and the successor's wait for every fenced transaction of the key to end.
        Patch(
            "sql/queries.sql",
            "SELECT {schema}.fence_take_over(%(lock_key)s, %(lock_wait_ms)s, "
            "%(lock_backend_pid)s,\n                                %(lock_holder)s),\n",
            "SELECT -- broken build: fence-off\n",
        ),
        # The lease mode asks the same SQL (run_lock_held_by's 'lease:<token>' branch), and
        # its worker also refuses a fenced transaction before its BEGIN once the heartbeat
        # found the lease lost: that goes too.
        Patch(
            "locks.py",
            "return self.lost is not None and self.lost.is_set()",
            "return False  # broken build: fence-off",
        ),
    ),
    caught_by=("no commit after the lock was lost",),
    # Every run pauses 6 s after its start, holding its lock with its work still to do;
    # every step ends one lock session of a run whose work is witnessed.
    opening=("manual_key", "force", "manual_key"),
    actions={"manual_key": 2, "force": 3, "scheduled": 1},
    faults={"terminate_lock": 1},
    fault_rate=1.0,
    sleep_at="runner.after_started=6",
    dates=2,
    seed=3303,
)

SKIP_CONFIRMED = Build(
    "skip-confirmed",
    "the ledger resends confirmed keys: its claim returns them too",
    patches=(
        Patch(
            "sql/queries.sql",
            "WHERE k.status IS DISTINCT FROM 'succeeded'\n   OR k.stored_fingerprint <> "
            "k.request_fingerprint;",
            "WHERE true;",
        ),
        Patch(
            "ledger/claim.py",
            'elif status == "succeeded":\n            summary.skipped_existing += 1',
            "elif False:\n            summary.skipped_existing += 1",
        ),
    ),
    caught_by=("a confirmed effect never reaches the remote again",),
    # An export, then a forced rerun of it: a correct ledger skips every confirmed key.
    opening=("manual_key", "force"),
    actions={"force": 3, "manual_key": 1},
    fault_rate=0.0,
    dates=1,
    seed=4404,
)

BUILDS = {b.name: b for b in (LOCK_OFF, COMPLETED_CHECK_OFF, FENCE_OFF, SKIP_CONFIRMED)}
BUILDS[CORRECT] = Build(CORRECT, "the provider of this checkout")
BROKEN = tuple(name for name, build in BUILDS.items() if build.broken)
LOCK_MODES = ("advisory", "lease")
"""The lock modes a phase runs in (the job database's Airflow connection's extra
``lock_mode``; docs/locks.md)."""


def split_phase(text: str, default_mode: str) -> tuple[Build, str]:
    """A phase of ``--builds``, ``NAME`` or ``NAME:MODE`` (``correct:lease``): its build and
    its lock mode (``default_mode`` when none is named). Raises ValueError naming the choices."""
    name, _, mode = text.strip().partition(":")
    mode = mode or default_mode
    if name not in BUILDS or mode not in LOCK_MODES:
        raise ValueError(
            f"{text.strip()!r}: give NAME or NAME:MODE, NAME one of {', '.join(BUILDS)}, "
            f"MODE one of {', '.join(LOCK_MODES)}"
        )
    return BUILDS[name], mode


def patched_copy(build: Build, folder: Path) -> Path:
    """A copy of the provider with ``build``'s patches, in ``folder`` (the PYTHONPATH entry:
    ``folder/airflow_idempotency``). Raises if a patch no longer applies."""
    shutil.rmtree(folder, ignore_errors=True)
    package = folder / "airflow_idempotency"
    shutil.copytree(PROVIDER, package, ignore=shutil.ignore_patterns("__pycache__"))
    for patch in build.patches:
        path = package / patch.file
        text = path.read_text(encoding="utf-8")
        if patch.old not in text:
            raise SystemExit(
                f"broken build {build.name}: {patch.file} has no {patch.old!r} to patch; "
                "retarget its patches in devtools/chaos/builds.py"
            )
        path.write_text(text.replace(patch.old, patch.new, 1), encoding="utf-8")
    return folder
