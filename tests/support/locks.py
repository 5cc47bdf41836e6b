"""End the session that holds a run's advisory lock, as a lost connection or an operator would."""

from __future__ import annotations

import psycopg

from airflow_idempotency.locks import run_lock_key

# pg_terminate_backend only signals the backend unless given a timeout; with one it waits
# until the backend has exited, and so released its session locks (PostgreSQL 14+).
_WAIT_MS = 10_000


def terminate_lock_session(dsn: str, job: str, run_key: str) -> int:
    """Terminate the session holding (job, run_key)'s lock and wait until it is gone; return
    its pid. Without the wait, a fencing check racing the dying backend still sees the lock."""
    # Postgres shows a bigint advisory key as classid (high 32 bits) and objid (low 32 bits).
    unsigned = run_lock_key(job, run_key) & 0xFFFFFFFFFFFFFFFF
    hi, lo = unsigned >> 32, unsigned & 0xFFFFFFFF
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
            " AND classid::bigint = %s AND objid::bigint = %s"
            # pg_locks shows the whole cluster: other databases' sessions are not ours to end
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (hi, lo),
        ).fetchall()
        assert len(found) == 1, f"expected one holder of {job!r} {run_key!r}, found {found}"
        (pid,) = found[0]
        ended = conn.execute("SELECT pg_terminate_backend(%s, %s)", (pid, _WAIT_MS)).fetchone()
        assert ended == (True,), f"backend {pid} still alive after {_WAIT_MS} ms"
    return int(pid)
