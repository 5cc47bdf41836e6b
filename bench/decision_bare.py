"""The statements of a decision sent bare, for bench/decision_child.py.

What is left of a call's client CPU once they are taken away is the provider's own (its
Python around psycopg).

Each function builds a call for one mode ("" the advisory mode, "lease_" the lease mode) that
sends, through the same pool as the provider's call and in the same order, the statements the
provider sends for that kind of call, their parameters built beforehand (outside the timing)
with the provider's own helpers, and returns this thread's CPU time in ms spent from taking a
connection to giving the last one back. A checkout whose statements differ from the ones
written here (an older one) gets ``None``: its row is left out rather than measured wrong.
Imported by decision_child.py from its own folder (it runs as a script there).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

JOB = "bench.decision"
SCHEMA = "idempotency"
BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"
Connect = Callable[[], Any]


def _queries(*names: str) -> dict[str, str] | None:
    """The named queries of this checkout, or ``None`` when one is missing or its decision does
    not return one JSON text (the form these bare calls parse)."""
    from airflow_idempotency import _sql

    try:
        found = {name: _sql.query(name, SCHEMA) for name in names}
    except (KeyError, TypeError):
        return None
    decisions = [text for name, text in found.items() if name.startswith("decide")]
    if any("row_to_json" not in text for text in decisions):
        return None
    return found


def _session(mode: str) -> dict[str, str]:
    """The decision's session settings as the provider sends them (the holder named apart)."""
    from airflow_idempotency.locks import DEAD_PEER_DEFAULTS, lock_wait_ms

    if mode:  # lease_run.decide_lease's: its holder, ttl and lock wait, no keepalive settings
        # (imported here: a checkout older than the lease mode has no leases module)
        from airflow_idempotency.leases import LEASE_TTL_DEFAULT

        return {
            "holder": "bench bare",
            "ttl": str(LEASE_TTL_DEFAULT),
            "lock_wait_ms": lock_wait_ms(),
        }
    session = {"lock_wait_ms": lock_wait_ms(), "application_name": "bench bare"}
    # the server-side ones the provider sends (locks.server_keepalive_settings), not libpq's
    # own switch "keepalives"
    session.update({n: str(v) for n, v in DEAD_PEER_DEFAULTS.items() if n != "keepalives"})
    return session


@contextlib.contextmanager
def _taken(connect: Connect) -> Iterator[psycopg.Connection]:
    """A connection from the pool set as the provider sets its own (autocommit, and no
    server-side prepared statements: psycopg would prepare a statement run
    ``prepare_threshold`` times on a connection, Parse messages and a round trip the provider
    never sends, adv33a), given back as it came."""
    with connect() as conn:
        threshold = conn.prepare_threshold
        conn.autocommit, conn.prepare_threshold = True, None
        yield conn
        conn.autocommit, conn.prepare_threshold = False, threshold


def _decide(conn: psycopg.Connection, text: str, params: dict[str, Any]) -> dict[str, Any]:
    """The decision's one message through a client-side cursor, its JSON row parsed."""
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(text, params)
    cursor.nextset()
    found = cursor.fetchone()
    assert found is not None
    return dict(json.loads(found[0]))


def bare_noop(mode: str) -> Callable[[Connect, str], float] | None:
    """A no-op's statements for a completed key: a connection from the pool, the decision's one
    message, its JSON row parsed, the COMMIT (the advisory mode's second round trip) and the
    connection given back as it came."""
    from airflow_idempotency.records import RunIdentity, RunOptions, RunRecords

    texts = _queries("decide_lease" if mode else "decide")
    if texts is None:
        return None
    (text,) = texts.values()
    session = _session(mode)

    def call(connect: Connect, key: str) -> float:
        params = RunRecords(SCHEMA, RunIdentity(JOB, key)).decision_params(RunOptions(), session)
        c0 = time.thread_time_ns()
        with _taken(connect) as conn:
            row = _decide(conn, text, params)
            if not mode:
                conn.commit()
        spent = (time.thread_time_ns() - c0) / 1e6
        if row["decision"] != "noop":
            raise AssertionError(f"{key}: the bare statements decided {row['decision']!r}")
        return spent

    return call


_NEW = ("fence_take_over", "start_attempt", "complete_attempt")
_LEASE_NEW = (
    "fence_take_over",
    "start_attempt",
    "fence_enter",
    "bound_lock_waits",
    "complete_attempt_lease",
    "fence_arm",
    "lease_release_at_commit",
)


def bare_new(mode: str) -> Callable[[Connect, str, dict[str, str]], float] | None:
    """A new key's statements (a work that does nothing), for a key never seen: the decision's
    message; on a second connection the start's BEGIN, then its take-over, its record and
    COMMIT pipelined; the completion (advisory: on the decision's connection, pipelined with
    its COMMIT; lease: on a third connection, its fenced transaction pipelined in one round
    trip). The attempt's parameters are built beforehand; the lock's pid or lease token and the
    attempt's id, known only from the answers, are filled in as the call goes."""
    from airflow_idempotency.locks import RunLock
    from airflow_idempotency.records import RunIdentity, RunOptions, RunRecords

    texts = _queries("decide_lease" if mode else "decide", *(_LEASE_NEW if mode else _NEW))
    if texts is None:
        return None
    session = _session(mode)
    wait = session["lock_wait_ms"]

    def call(connect: Connect, key: str, keepalive: dict[str, str]) -> float:
        run = RunIdentity(JOB, key)
        records = RunRecords(SCHEMA, run)
        # the advisory decision's session carries the connection's keepalive settings; the
        # lease decision's none (lease_run.decide_lease)
        decision = records.decision_params(
            RunOptions(), {**session, **keepalive} if not mode else session
        )
        holder = RunLock(run.lock_key, 0, "lease:0" if mode else None)
        record = records._attempt_params(holder, RunOptions())
        take_over = {**record, **holder.params, "lock_wait_ms": wait, **keepalive}
        end = {**run.key_params, **holder.params, "details": Jsonb({}), "lock_wait_ms": wait}
        end.update(keepalive)
        c0 = time.thread_time_ns()
        (_lease if mode else _advisory)(connect, texts, decision, (take_over, record), end)
        return (time.thread_time_ns() - c0) / 1e6

    return call


Start = tuple[dict[str, Any], dict[str, Any]]  # the take-over's parameters, the record's


def _start(conn: psycopg.Connection, texts: dict[str, str], start: Start) -> int:
    """The start's transaction: its BEGIN alone, then the take-over, the record and COMMIT."""
    conn.execute(BEGIN)
    with conn.pipeline():
        conn.execute(texts["fence_take_over"], start[0])
        cursor = conn.execute(texts["start_attempt"], start[1])
        conn.execute("COMMIT")
    row = cursor.fetchone()
    assert row is not None and row[3] is None, "the bare start found the key completed"
    return int(row[0])


def _advisory(
    connect: Connect, texts: dict[str, str], decision: dict[str, Any], start: Start,
    end: dict[str, Any],
) -> None:  # fmt: skip
    with _taken(connect) as lock_conn:
        row = _decide(lock_conn, texts["decide"], decision)
        assert row["decision"] == "run", row["decision"]
        pid, holder = row["backend_pid"], row["holder"]
        start[0].update(lock_backend_pid=pid, lock_holder=holder)
        start[1]["lock_backend_pid"] = pid
        end.update(lock_backend_pid=pid, lock_holder=holder)
        with _taken(connect) as conn:
            end["attempt_id"] = _start(conn, texts, start)
        with lock_conn.pipeline():
            done = lock_conn.execute(texts["complete_attempt"], end)
            lock_conn.execute("COMMIT")
        assert done.fetchone() is not None, "the bare completion was refused"


def _lease(
    connect: Connect, texts: dict[str, str], decision: dict[str, Any], start: Start,
    end: dict[str, Any],
) -> None:  # fmt: skip
    with _taken(connect) as conn:
        row = _decide(conn, texts["decide_lease"], decision)
    assert row["decision"] == "run", row["decision"]
    holder = f"lease:{row['token']}"
    start[0]["lock_holder"] = end["lock_holder"] = holder
    start[1]["trigger_details"] = Jsonb({"lease": holder})
    end["token"] = row["token"]
    with _taken(connect) as conn:
        end["attempt_id"] = _start(conn, texts, start)
    with _taken(connect) as conn, conn.pipeline():
        conn.execute(BEGIN)
        cursors = [conn.execute(texts[name], end) for name in _LEASE_NEW[2:]]
        conn.execute("COMMIT")
    assert cursors[2].fetchone() is not None, "the bare completion was refused"
