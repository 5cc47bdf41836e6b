"""Postgres advisory locks: the run lock of each (job name, run key), and every other key.

Lock-key families (all 64-bit keys, taken with the ``bigint`` forms of the advisory-lock
functions; Postgres shows such a key in ``pg_locks`` as ``classid`` = high 32 bits,
``objid`` = low 32 bits, ``objsubid`` = 1):

- **run locks**, :func:`run_lock_key`: ``sha256(job_name + 0x1f + run_key)``, first 8
  bytes, big-endian, signed. Held for a whole run by a transaction on a connection
  dedicated to it (:func:`hold_run_lock`). The derivation is part of the contract
  (documented in docs/locks.md, stored in ``job_runs.lock_key``): two versions of the
  provider running side by side must compute the same key for the same run, so it never
  changes;
- **the migration lock**, :func:`migration_lock_key`: ``sha256(b"airflow_idempotency.
  schema_migration" + 0x00 + schema)``, taken with ``pg_advisory_xact_lock`` while the
  bookkeeping schema is created or migrated (schema.py);
- **named locks**, :func:`named_lock_key`: ``sha256(b"airflow_idempotency.named" + 0x00 +
  name)``, for anything else that must be serialised, e.g. the example DAGs' schema DDL;
- **fence keys**: a run lock's key split into two ``int4`` halves, i.e. the ``(int4, int4)``
  form of the advisory-lock functions (``objsubid`` = 2, a space apart from every key above).
  Taken SHARED by each fenced transaction of the attempt that holds the run lock and EXCLUSIVE
  by a successor's start, so that a takeover waits until the previous attempt's transactions
  have ended (migration 0006, :mod:`airflow_idempotency.run_context`).

The families hash different prefixes, so a key of one family colliding with another's is
as unlikely as any two SHA-256 values sharing 64 bits; even then two holders would only
wait for each other, never run at once.

Which sessions hold a key is answered in one place, the SQL function ``held_run_locks()``
of the bookkeeping schema (migration 0004): every statement that asks goes through it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import select
import socket
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg

from airflow_idempotency import _environ
from airflow_idempotency._sql import query
from airflow_idempotency.exceptions import (
    ConfigurationError,
    ConnectionWaitError,
    IdempotencyError,
    PoolExhaustedError,
    SharedSessionError,
)

log = logging.getLogger(__name__)

ON_LOCKED_ENV = "AIRFLOW_IDEMPOTENCY_ON_LOCKED"
"""Overrides the operator's ``on_locked`` policy in one process (the CLI's ``run`` sets
``fail``, so that a locked key exits 75 at once instead of rescheduling)."""

DEAD_PEER_DEFAULTS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 4,
    "tcp_user_timeout": 30_000,  # milliseconds
}
"""libpq's TCP keepalive and user-timeout settings for the job database's connections.

A worker cut off from Postgres by the network would otherwise keep its run lock until the
server notices the dead peer, over two hours with Linux's defaults. With these, both ends
give up on a silent peer after about ``keepalives_idle + keepalives_interval *
keepalives_count`` = 30 s (an idle link) or ``tcp_user_timeout`` = 30 s (data sent and not
acknowledged). The hook sets them unless the Airflow connection's extra does; the lock
transaction sets the same values on the server's side of its session (SET LOCAL).
"""

LOCK_WAIT_ENV = "AIRFLOW_IDEMPOTENCY_LOCK_WAIT"
"""Seconds any lock wait of the provider's own statements may last (default
:data:`LOCK_WAIT_DEFAULT`): a takeover waiting for the previous attempt's transactions, a
fenced transaction's enter, the run's records and the ledger's writes. The wait then ends
with an error naming what it waited for."""

LOCK_WAIT_DEFAULT = 60.0
"""Longer than the dead-peer bound (about 30 s): a takeover outlasts a worker that was cut off."""


def lock_wait_ms() -> str:
    """The bound of every lock wait of the provider's statements, in ms (``lock_timeout``'s
    unit), from :data:`LOCK_WAIT_ENV` or :data:`LOCK_WAIT_DEFAULT`."""
    return _lock_wait_ms(_environ.get(LOCK_WAIT_ENV) or "")


@functools.lru_cache(maxsize=16)
def _lock_wait_ms(setting: str) -> str:
    """:func:`lock_wait_ms` of the variable's text: parsed once per text (every run asks)."""
    given = setting.strip()
    try:
        seconds = float(given) if given else LOCK_WAIT_DEFAULT
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 86_400:
        raise ConfigurationError(
            f"{LOCK_WAIT_ENV}={given!r}: give the longest lock wait of the provider's "
            "statements in seconds, more than 0 and at most 86400 (default "
            f"{LOCK_WAIT_DEFAULT:g})"
        )
    return str(max(1, round(seconds * 1000)))


_MIGRATION_PREFIX = b"airflow_idempotency.schema_migration\x00"
_NAMED_PREFIX = b"airflow_idempotency.named\x00"


def _key(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big", signed=True)


def run_lock_key(job_name: str, run_key: str) -> int:
    """The advisory lock key of (job_name, run_key)."""
    return _key(job_name.encode() + b"\x1f" + run_key.encode())


def migration_lock_key(schema: str) -> int:
    """The key that serialises creating and migrating the bookkeeping ``schema``."""
    return _key(_MIGRATION_PREFIX + schema.encode())


def named_lock_key(name: str) -> int:
    """A key for anything else that must be serialised across workers, by a stable name."""
    return _key(_NAMED_PREFIX + name.encode())


@dataclass(frozen=True)
class RunLock:
    """A held run lock: its key, the backend (session) that holds it, and the lock
    transaction itself (``holder``: its virtual transaction id, migration 0008). A pid alone
    is reused by the operating system; the pair names one lock transaction.

    In the lease mode (:mod:`airflow_idempotency.leases`) ``holder`` is ``'lease:<token>'``,
    ``backend_pid`` 0 (no session holds it), and ``lost`` is set by the heartbeat once the
    lease is lost."""

    lock_key: int
    backend_pid: int
    holder: str | None = None
    lost: threading.Event | None = field(default=None, compare=False, repr=False)

    @property
    def is_lease(self) -> bool:
        """Whether this is a lease (the lease mode), not an advisory lock."""
        return self.holder is not None and self.holder.startswith("lease:")

    @property
    def known_lost(self) -> bool:
        """Whether the lease's heartbeat found it lost (always ``False`` for an advisory lock:
        the database answers that)."""
        return self.lost is not None and self.lost.is_set()

    def describe(self) -> str:
        """What holds it, for a message: the lock session, or the lease."""
        if self.is_lease:
            return f"its lease ({self.holder}) expired or was taken over"
        return f"its lock session, backend pid {self.backend_pid}, ended"

    @property
    def params(self) -> dict[str, int | str | None]:
        """Query parameters naming this lock and its holder, for the fencing checks."""
        return {
            "lock_key": self.lock_key,
            "lock_backend_pid": self.backend_pid,
            "lock_holder": self.holder,
        }


# What PgBouncer answers a transaction block in pool_mode=statement, and what it says when a
# client waited query_wait_timeout for a server connection (it then closes the connection).
_STATEMENT_POOLING = "transaction blocks not allowed in statement pooling mode"
_POOL_WAIT = "query_wait_timeout"
# What PgBouncer answers a new client past max_client_conn (it then closes the connection).
_CLIENT_LIMIT = "no more connections allowed (max_client_conn)"
_SIZING = "see docs/deploying.md, pool sizing"
_LEASE_SIZING = (
    "In lock_mode lease no connection is held for the run: a run needs a server connection "
    "only while one of its statements or short transactions runs, and runs beyond the pool's "
    "size wait their turn in the pooler's queue, up to query_wait_timeout (keep it at most "
    "half the lease_ttl)."
)
# What PostgreSQL answers a connection for want of a slot (SQLSTATE 53300 when psycopg knows
# it; the text when the refusal arrives as a plain connection failure, as at connect): past
# max_connections; past a role's or a database's CONNECTION LIMIT; and, for a role that is not
# a superuser, the slots kept for superusers (superuser_reserved_connections: what such a role
# meets at max_connections; the wording changed in PostgreSQL 16).
_TOO_MANY = (
    "too many clients already",
    "too many connections for role",
    "too many connections for database",
    "remaining connection slots are reserved",
)


@contextlib.contextmanager
def hold_run_lock(
    conn: psycopg.Connection, lock_key: int, *, schema: str, application_name: str
) -> Iterator[RunLock | None]:
    """Hold the run lock in a transaction kept open on ``conn``; yield it, or ``None``.

    ``pg_try_advisory_xact_lock`` never waits: ``None`` means another session holds the
    key. The lock belongs to the transaction, not to the session, so it holds behind any
    connection pooler: a pooler in transaction mode keeps a client on one server
    connection while its transaction is open, and releases nothing to other clients.
    Nothing else about the session is changed beyond this transaction (``SET LOCAL``):
    ``pg_stat_activity`` shows ``application_name`` (Postgres keeps 63 bytes) while it lasts.

    Statements the block runs on ``conn`` are part of the lock transaction. Leaving the
    block normally commits them and releases the lock at the same instant; an exception
    rolls them back (and releases the lock). The block may also end the transaction itself
    (``COMMIT``), e.g. to learn whether its last write committed. The transaction reads no
    table, so it holds no lock but the advisory one, and it takes no snapshot between
    statements: it does not hold back vacuum however long the run is (BENCHMARKS.md).

    The transaction is READ COMMITTED whatever the database's or role's default
    (``default_transaction_isolation``): under REPEATABLE READ its first statement would fix a
    snapshot for the whole run (holding back vacuum), and the completion would read job_runs as
    it was before this run's own start.

    ``conn`` must be in autocommit mode, idle, and dedicated to the lock while the block
    runs. Raises :class:`SharedSessionError` when the session already held the key before
    trying it (a session-level lock left on a pooled server connection by another client),
    a :class:`ConfigurationError` when the connection cannot hold a transaction (a pooler in
    statement mode) and a :class:`PoolExhaustedError` when the pooler had no server
    connection for it (:func:`pooler_refusal`).
    """
    with lock_transaction(conn):
        yield _begin_and_try(conn, lock_key, schema=schema, application_name=application_name)


@contextlib.contextmanager
def lock_transaction(conn: psycopg.Connection) -> Iterator[None]:
    """The span of a lock transaction on ``conn`` (an idle connection in autocommit mode,
    dedicated to it): the block begins it with its first statement; leaving the block
    normally commits it (unless the block ended it), an exception rolls it back."""
    if not conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("a lock transaction needs an idle connection in autocommit mode")
    try:
        yield
    except BaseException:
        _end(conn, "ROLLBACK")
        raise
    _end(conn, "COMMIT")


def _begin_and_try(
    conn: psycopg.Connection, lock_key: int, *, schema: str, application_name: str
) -> RunLock | None:
    """Begin the lock transaction and try the key in it: the lock, or ``None`` when another
    session holds it (the transaction stays open either way). Rolled back, and the error
    raised, when the statements fail or the session already held the key."""
    params = {
        "lock_key": lock_key,
        "application_name": application_name,
        "lock_wait_ms": lock_wait_ms(),
        **server_keepalive_settings(conn),
    }
    try:
        # BEGIN on its own round trip: pipelined with the lock statement, a pooler's refusal
        # of the transaction (statement mode) would reach psycopg only as a closed connection.
        conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        row = conn.execute(query("acquire_run_lock", schema), params).fetchone()
    except psycopg.Error as exc:
        _end(conn, "ROLLBACK")
        refusal = pooler_refusal(exc)
        if refusal is None:
            raise
        raise refusal from exc
    assert row is not None
    already_held, acquired, backend_pid, holder = row[:4]
    if already_held:
        _end(conn, "ROLLBACK")
        raise shared_session_error(backend_pid, lock_key)
    return RunLock(lock_key, backend_pid, holder) if acquired else None


def shared_session_error(backend_pid: int, lock_key: int) -> SharedSessionError:
    """The error when the session already held run lock ``lock_key`` before this run tried
    it (a session-level lock of another client of a pooled server connection)."""
    return SharedSessionError(
        f"server session {backend_pid} already held run lock {lock_key} before this run "
        "tried it: the connection to the job database is shared with another client that "
        "took the lock at session level (e.g. an older version of this provider behind a "
        "pooler in transaction mode). Taking it again would exclude no one. Point that "
        "client at a direct connection or pool_mode = session, or upgrade it."
    )


def no_slot(exc: BaseException) -> bool:
    """Whether ``exc`` is a new connection refused for want of a slot: PostgreSQL past
    max_connections (or a role's or database's limit), PgBouncer past max_client_conn, or a
    psycopg_pool whose every connection stayed in use (:func:`pool_refused`). The connection
    was never opened (or never lent), so nothing of it was sent: a later try is safe."""
    if isinstance(exc, psycopg.errors.TooManyConnections) or pool_refused(exc):
        return True
    text = str(exc)
    return isinstance(exc, psycopg.OperationalError) and (
        _CLIENT_LIMIT in text or any(t in text for t in _TOO_MANY)
    )


_UNREACHABLE = (
    "Connection refused",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    # libpq's own (target_session_attrs=read-write or primary): a standby reached as a
    # switchover or failover promotes another, or this one
    "session is read-only",
    "server is in hot standby mode",
)


def unreachable_for_now(exc: BaseException) -> bool:
    """Whether ``exc`` is a new connection the database could not take for the moment: nothing
    listening (a server restarting, a writer failing over), a server starting up, shutting
    down or in recovery, a standby reached by a DSN asking for a writer
    (``target_session_attrs``: a switchover under way), or no answer within
    ``connect_timeout``. The connection was never opened, so nothing of it was sent: a later
    try is safe.

    The words are matched in English: a server whose ``lc_messages`` is another language is
    not recognised (libpq hands psycopg no SQLSTATE for a connection that failed), and its
    refusal is raised at once (docs/deploying.md)."""
    if isinstance(exc, (psycopg.errors.ConnectionTimeout, psycopg.errors.CannotConnectNow)):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    return any(t in str(exc) for t in _UNREACHABLE)


def pool_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a psycopg_pool's ``connection()`` lending nothing: no connection free
    within the pool's timeout (PoolTimeout) or its queue full (TooManyRequests). Read without
    importing psycopg_pool (a task process need not load it): its errors exist once it is."""
    pool = sys.modules.get("psycopg_pool")
    return pool is not None and isinstance(exc, (pool.PoolTimeout, pool.TooManyRequests))


def _pool_exhausted(text: str) -> PoolExhaustedError:
    """A psycopg_pool of the job's ``connect`` that lent no connection (:func:`pool_refused`)."""
    return PoolExhaustedError(
        f"the connection pool of the job's connect lent no connection ({text}): every "
        "connection of it stayed in use. A running idempotent task borrows up to 3 at once "
        "(its lock or decision, its work, the outbound ledger's) plus a lease heartbeat's in "
        f"lock_mode lease: size the pool's max_size for every task running at once ({_SIZING}), "
        "or raise its timeout. Nothing was committed by the refused connection; a retry "
        "converges."
    )


def pooler_refusal(exc: psycopg.Error) -> IdempotencyError | None:
    """The error to raise when ``exc`` is a connection pooler refusing the provider's work,
    else ``None``: a pooler in statement mode refusing a transaction (a configuration that
    cannot work), PgBouncer's ``query_wait_timeout`` (its pool is exhausted: every server
    connection was busy for that long), or PostgreSQL itself refusing a connection past
    ``max_connections`` (SQLSTATE 53300: the same sizing rule)."""
    text = str(exc).strip()
    if _STATEMENT_POOLING in text:
        return ConfigurationError(
            "the job database connection goes through a pooler in statement mode (PgBouncer "
            f"said: {text}). The run lock and the run records need transactions: "
            "connect directly, or use pool_mode = transaction or session for this database."
        )
    if text == _POOL_WAIT:
        return PoolExhaustedError(
            "the connection pooler gave this connection no server connection within its "
            "query_wait_timeout (PgBouncer said: query_wait_timeout): the pool of this "
            "database and user is exhausted. Each running idempotent task keeps one server "
            "connection for its run lock for the whole run, and needs another one, briefly, "
            "for each statement of its work: default_pool_size must be larger than the number "
            "of idempotent tasks that run at once against this database (N tasks need at "
            f"least N + 1; {_SIZING}). {_LEASE_SIZING} Nothing was committed by the "
            "waiting statement; a retry converges once the pool has room."
        )
    if _CLIENT_LIMIT in text:
        return PoolExhaustedError(
            f"the connection pooler refused a new client connection (PgBouncer said: {text}): "
            "its max_client_conn is reached. Every running idempotent task opens up to 3 "
            "client connections at once (its lock or decision, its work, the outbound "
            "ledger's) plus a lease heartbeat's in lock_mode lease: max_client_conn must "
            f"cover 4 per task running at once plus every other client ({_SIZING}). Nothing "
            "was committed by the refused connection; a retry converges."
        )
    if pool_refused(exc):
        return _pool_exhausted(text)
    if isinstance(exc, psycopg.errors.ConnectionTimeout):
        return ConnectionWaitError(
            f"no connection to the job database within its connect_timeout ({text}): the "
            "server or pooler did not answer in time: a pooler whose listen_backlog or "
            "max_client_conn is full, a server at its limit, or the network. Size the pooler "
            f"for every task running at once ({_SIZING}), or raise connect_timeout in the "
            "connection's extra. Nothing was committed by the waiting connection; a retry "
            "converges."
        )
    if isinstance(exc, psycopg.errors.TooManyConnections) or any(t in text for t in _TOO_MANY):
        return PoolExhaustedError(
            f"the job database refused a new connection (PostgreSQL said: {text}): it has no "
            "connection slot left (max_connections, or a role's or database's CONNECTION "
            "LIMIT). Each running idempotent task holds two connections for its whole run "
            "(its lock transaction's and its work's) and a third while the outbound ledger "
            "exports: max_connections must cover 3 per task running at once plus every other "
            f"client ({_SIZING}), or put PgBouncer in front (with lock_mode lease, which holds "
            "no connection for the run). Nothing "
            "was committed by the refused connection; a retry converges once slots are free."
        )
    return None


def server_keepalive_settings(conn: psycopg.Connection) -> dict[str, str]:
    """The server-side TCP settings of the provider's transactions (the lock transaction, each
    fenced transaction, each start): the client's own libpq values (from the Airflow
    connection), else :data:`DEAD_PEER_DEFAULTS`; seconds, and ms for ``tcp_user_timeout``."""
    # The connection's own options as libpq holds them (``ConnectionInfo.get_parameters``
    # computes libpq's defaults and the home directory on every call: 113 us, measured; this
    # reads the same options in 46 us), once per connection: a pooled connection's options
    # never change, and a new key reads them twice.
    known = _keepalive_settings.get(conn)
    if known is not None:
        return dict(known)
    given = {option.keyword.decode(): option.val for option in conn.pgconn.info}
    settings = {
        name: (given.get(name) or b"").decode() or str(DEAD_PEER_DEFAULTS[name])
        for name in _DEAD_PEER
    }
    with contextlib.suppress(TypeError):  # a connection class that takes no weak reference
        _keepalive_settings[conn] = settings
    return dict(settings)


_keepalive_settings: weakref.WeakKeyDictionary[psycopg.Connection, dict[str, str]] = (
    weakref.WeakKeyDictionary()
)


_DEAD_PEER = ("keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout")


def _end(conn: psycopg.Connection, statement: str) -> None:
    """End the lock transaction, unless the block ended it or the session is gone.

    A failed ROLLBACK is logged (the session is gone, and Postgres released the lock with
    it); a failed COMMIT raises, since the block's writes did not commit.
    """
    if conn.closed or conn.broken:
        return
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    try:
        conn.execute(statement)
    except psycopg.Error as exc:
        if statement == "COMMIT":
            raise
        log.warning("could not roll back the lock transaction (%s): its session is gone", exc)


def lock_is_held(conn: psycopg.Connection, schema: str, lock: RunLock) -> bool:
    """Whether ``lock`` is still held by the session that took it (checked from any session)."""
    row = conn.execute(query("lock_is_held_by", schema), lock.params).fetchone()
    return bool(row and row[0])


def session_ended(conn: psycopg.Connection) -> bool:
    """Whether the server has ended ``conn``'s session, seen without a round trip (~3 us).

    ``conn`` is idle (the lock connection while the work runs), so the server sends it
    nothing unless the session ends: a terminated backend (``pg_terminate_backend``, a
    restart, ``idle_in_transaction_session_timeout``) sends its FATAL error and closes the
    socket. So the socket is polled, and what waits in it is peeked at, never read: the end
    of the stream or an ``ErrorResponse`` (``E``) means the session ended; a notice or a
    parameter report (never sent to an idle session in practice) does not. Over TLS the bytes
    cannot be read, and anything that arrived counts as the end. A peer that vanished without
    a word (a cut link) is not seen here: the database's own check and the dead-peer bound
    (:data:`DEAD_PEER_DEFAULTS`) see that.

    Safe from any thread while the connection's owner does not use it.
    """
    if conn.closed or conn.broken:
        return True
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    if not poller.poll(0):
        return False
    if conn.pgconn.ssl_in_use:
        return True
    try:
        with socket.socket(fileno=os.dup(fd)) as peek:
            first = peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:  # reset: the session is gone
        return True
    return first in (b"", b"E")
