"""The view's connections to the job database: a bounded pool per process.

And what a page says when it cannot read.

Line-neutral (Airflow 3's api-server and 2.11's webserver alike). Every page checks out one
connection of its process's pool (:class:`ReaderPools`): at most ``[idempotency]
ui_pool_size`` connections per process (the same database holds the run locks, so the view
must not take connections from the tasks), none kept idle longer than
``ui_pool_max_idle`` seconds, a page waiting at most ``ui_pool_timeout`` seconds for one.
The Airflow connection is read for every page, as before the pool: an edited connection
gets a new pool (the old one is closed), and each new connection of a pool asks the hook
for its parameters (an IAM token is fresh).

No DDL ever: a missing or older schema is refused with :class:`ViewUnavailable`, shown as a
503 that says why and what to do. A database error is logged with an id and shown as a
short message with that id (:func:`database_failure`): its text can name tables, roles,
hosts or data, and is for the operator's log, not for every signed-in user.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from airflow_idempotency.compat import AIRFLOW_NOT_FOUND
from airflow_idempotency.exceptions import SchemaNotReadyError
from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.run_context import iso_datestyle
from airflow_idempotency.schema import require_readable
from airflow_idempotency.ui.reads import RecordsReader, Visibility
from airflow_idempotency.ui.settings import CONFIG_SECTION, Settings

log = logging.getLogger(__name__)


class ViewUnavailable(Exception):
    """The job database cannot be read now: shown as a 503 page that says why and what to do."""

    def __init__(self, title: str, detail: str) -> None:
        super().__init__(f"{title}: {detail}")
        self.title = title
        self.detail = detail


def database_failure(exc: BaseException, settings: Settings, where: str) -> ViewUnavailable:
    """``exc`` (a driver error, a pool timeout) logged with a new id, as the short message
    the page shows instead of the driver's text."""
    error_id = secrets.token_hex(4)
    log.error(
        "Run keys view: the job database failed (error id %s, connection %r, %s): %s: %s",
        error_id,
        settings.conn_id,
        where,
        type(exc).__name__,
        str(exc).strip(),
        exc_info=exc,
    )
    if isinstance(exc, PoolTimeout | psycopg.OperationalError) and not isinstance(
        exc, psycopg.errors.QueryCanceled
    ):
        title = "Cannot reach the job database"
        what = f"no connection to the job database (Airflow connection {settings.conn_id!r})"
    else:
        title = "The job database refused a read"
        what = f"the job database (Airflow connection {settings.conn_id!r}) refused a read"
    return ViewUnavailable(
        title,
        f"{what}: error id {error_id}. The log of Airflow's api-server (2.11: webserver) "
        "has the details under that id.",
    )


def _missing_connection(settings: Settings) -> ViewUnavailable:
    return ViewUnavailable(
        "No job database",
        f"the Airflow connection {settings.conn_id!r} is not defined. Create it, or name "
        f"another one in [{CONFIG_SECTION}] ui_conn_id "
        f"(AIRFLOW__{CONFIG_SECTION.upper()}__UI_CONN_ID).",
    )


def _hook(settings: Settings) -> tuple[IdempotencyHook, str]:
    """The hook of the view's Airflow connection, and that connection's identity (its URI,
    which changes when the connection is edited); ViewUnavailable if it is not defined."""
    hook = IdempotencyHook(postgres_conn_id=settings.conn_id)
    try:
        return hook, hook.connection.get_uri()
    except AIRFLOW_NOT_FOUND as exc:
        raise _missing_connection(settings) from exc


def _connection_kwargs(hook: IdempotencyHook) -> dict[str, Any]:
    kwargs = hook.connection_kwargs()
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "airflow-idempotency ui")
    # Autocommit (each page opens its own read-only transaction), no prepared statements
    # (a transaction-mode pooler in front of the database).
    return {**kwargs, "autocommit": True, "prepare_threshold": None}


def _iso_dates(conn: psycopg.Connection) -> None:
    iso_datestyle(conn)


class ReaderPools:
    """The bounded pool of each Airflow connection the view reads, for this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, tuple[str, ConnectionPool]] = {}

    def pool(self, settings: Settings) -> ConnectionPool:
        """The open pool of ``settings.conn_id`` as it is defined now."""
        hook, identity = _hook(settings)
        with self._lock:
            current = self._pools.get(settings.conn_id)
            if current is not None and current[0] == identity:
                return current[1]
            pool: ConnectionPool = ConnectionPool(
                kwargs=lambda: _connection_kwargs(hook),
                min_size=0,
                max_size=settings.pool_size,
                timeout=settings.pool_timeout,
                max_idle=settings.pool_max_idle,
                check=ConnectionPool.check_connection,
                configure=_iso_dates,  # its times read whatever the database's DateStyle
                name=f"idempotency-ui-{settings.conn_id}",
                open=True,
            )
            self._pools[settings.conn_id] = (identity, pool)
        if current is not None:  # the connection was edited: its old sessions go
            current[1].close(timeout=0)
        return pool

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for _identity, pool in pools:
            pool.close(timeout=0)


POOLS = ReaderPools()
"""This process's pools (an api-server or webserver worker serves every request from it)."""


def _require_readable(conn: psycopg.Connection, settings: Settings) -> None:
    try:
        require_readable(conn, settings.schema)
    except SchemaNotReadyError as exc:
        hint = (
            "No idempotent task has run against this database yet, or the connection "
            f"{settings.conn_id!r} ([{CONFIG_SECTION}] ui_conn_id) or the schema "
            f"([{CONFIG_SECTION}] ui_schema) point elsewhere."
            if exc.version == 0
            else "The next idempotent task of this provider version migrates it, or run "
            "`airflow-idempotency migrate`. This view never changes the schema."
        )
        raise ViewUnavailable("The job database is not ready", f"{exc}. {hint}") from exc


@contextmanager
def open_reader(
    settings: Settings, visibility: Visibility, pools: ReaderPools = POOLS
) -> Iterator[RecordsReader]:
    """A reader seeing ``visibility``, on a connection of the pool for the page; the schema
    is checked first. A database error inside is logged and raised as ViewUnavailable
    (:func:`database_failure`)."""
    pool = pools.pool(settings)
    try:
        with pool.connection() as conn:
            _require_readable(conn, settings)
            yield RecordsReader(conn, settings.schema, visibility)
    except (psycopg.Error, PoolTimeout) as exc:
        raise database_failure(exc, settings, "reading a page") from exc


__all__ = ["POOLS", "ReaderPools", "ViewUnavailable", "database_failure", "open_reader"]
