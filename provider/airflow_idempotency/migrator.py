"""Apply the shipped migrations: every file identified, every wait bounded.

**Identified.** ``schema_version`` records each applied file by number, name and checksum
(SHA-256 of its text). Before anything runs, the record is compared with this release's files
(:func:`plan`): a file applied under another name, or edited after it was applied, is refused
(:class:`MigrationMismatchError`); a database migrated further than this release is refused
(:class:`SchemaTooNewError`, retryable: in a rolling upgrade the retry meets an upgraded
worker). Rows written by releases that recorded the number and name only get the checksum of
this release's file of that name, once, with nothing run again.

**Bounded.** A migration runs in one transaction whose lock waits give up after
``lock_timeout`` (:class:`MigrationBounds`): an ``ALTER TABLE`` queued behind a long reader (a
nightly ``pg_dump``, a report) would otherwise wait for it, and every statement of every worker
on that table would queue behind the ``ALTER``. A try that timed out rolls back (releasing the
queue), waits a little and tries again, until ``give_up_after``; then
:class:`MigrationBlockedError` names the sessions holding the locks and what to do. The
migrating session also bounds a dead peer: a worker cut off mid-migration loses its session
(and the ``ACCESS EXCLUSIVE`` locks it took) within ``idle_in_transaction`` seconds, or the TCP
keepalive bound while a statement runs, instead of the kernel's two hours.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import dict_row

from airflow_idempotency._sql import Migration, query
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    MigrationBlockedError,
    MigrationMismatchError,
    SchemaTooNewError,
)
from airflow_idempotency.locks import migration_lock_key, server_keepalive_settings

log = logging.getLogger(__name__)

_FILE = "migrator.sql"


@dataclass(frozen=True)
class MigrationBounds:
    """How long a migration may wait, in seconds.

    ``lock_timeout``: each lock wait of one try (PostgreSQL's ``lock_timeout``; also how long
    other sessions' statements can queue behind a waiting ``ALTER``). ``give_up_after``: all
    tries together, before :class:`MigrationBlockedError`. ``idle_in_transaction``: how long the
    server keeps the migration transaction of a client that stopped talking (its locks too).
    """

    lock_timeout: float = 2.0
    give_up_after: float = 60.0
    idle_in_transaction: float = 10.0


class Applied(NamedTuple):
    """One row of ``schema_version``: a file the database applied (checksum ``None``: recorded
    by a release that kept numbers and names only)."""

    version: int
    name: str
    checksum: str | None


class Plan(NamedTuple):
    """What a migration has to do: the files to run, and the applied rows to give checksums."""

    pending: tuple[Migration, ...]
    adopt: tuple[Migration, ...]


def plan(applied: Sequence[Applied], shipped: Sequence[Migration], where: str) -> Plan:
    """Compare the database's record with this release's files (``shipped``, numbered 1..n).

    Raises :class:`MigrationMismatchError` when an applied number is missing from the record or
    names another file or checksum, and :class:`SchemaTooNewError` when the database applied
    files this release does not have (checked after the files both have: a build that disagrees
    is refused as such). ``where`` names the schema and database in the messages.
    """
    by_version = {m.version: m for m in shipped}
    newest = max((row.version for row in applied), default=0)
    recorded = {row.version for row in applied}
    # Numbers past this release's files are a newer release's business (SchemaTooNewError).
    missing = [v for v in range(1, min(newest, len(shipped)) + 1) if v not in recorded]
    if missing:
        raise MigrationMismatchError(
            f"{where} records migration {newest} but not {missing}: the record was edited by "
            "hand or by another tool. Restore schema_version (a backup), or recreate the schema."
        )
    adopt = []
    for row in applied:
        mine = by_version.get(row.version)
        if mine is None:
            continue
        if row.name != mine.name or row.checksum not in (None, mine.checksum):
            raise _mismatch(where, row, mine)
        if row.checksum is None:
            adopt.append(mine)
    expected = len(shipped)
    if newest > expected:
        raise SchemaTooNewError(
            f"{where} is at version {newest} ({applied[-1].name}), newer than this release of "
            f"airflow-provider-idempotency (version {expected}): a newer release migrated it, "
            "and this worker runs nothing on it. Upgrade the provider on this worker (see "
            "docs/deploying.md, upgrading); a retry on an upgraded worker succeeds.",
            version=newest,
            expected=expected,
        )
    return Plan(tuple(m for m in shipped if m.version > newest), tuple(adopt))


def _mismatch(where: str, row: Applied, mine: Migration) -> MigrationMismatchError:
    if row.name != mine.name:
        what = f"applied migration {row.version} as {row.name}, this release ships {mine.name}"
    else:
        what = (
            f"applied {row.name} with checksum {row.checksum[:12] if row.checksum else ''}..., "
            f"this release's file has {mine.checksum[:12]}...: the file was edited after the "
            "database applied it"
        )
    return MigrationMismatchError(
        f"{where} {what}. A migration never changes once applied: run a released build of "
        "airflow-provider-idempotency (a development build: restore the file and put the change "
        "into a new migration, or recreate this database's schema)."
    )


def applied_migrations(conn: psycopg.Connection, schema: str) -> list[Applied]:
    """The database's record (an empty list when the schema or its table is missing).

    A missing table is learnt from the failed statement, which a connection without autocommit
    runs in a transaction (or savepoint) of its own, so the error leaves nothing aborted.
    """
    probe = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    try:
        with probe:
            found = conn.execute(query("applied_migrations", schema, _FILE)).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        return []
    return [Applied(int(v), str(name), checksum) for v, name, checksum in found]


def migrate(
    conn: psycopg.Connection,
    schema: str,
    where: str,
    bounds: MigrationBounds,
    shipped: Sequence[Migration],
) -> Plan:
    """Bring ``schema`` to the version of ``shipped`` (this release's files) under the
    migration lock, each try bounded by ``bounds``; return what was done. ``conn`` must not be
    inside a transaction; ``where`` names the schema and database in messages."""
    deadline = time.monotonic() + bounds.give_up_after
    pause = min(0.1, bounds.lock_timeout)
    tries = 0
    while True:
        tries += 1
        try:
            return _try(conn, schema, where, bounds, shipped)
        except psycopg.errors.LockNotAvailable as exc:
            blockers = migration_blockers(conn, schema)
            if time.monotonic() + pause >= deadline:
                raise _blocked(where, bounds, tries, blockers) from exc
            log.warning(
                "migrating %s waited %s s for a lock (try %d), held by %s: retrying",
                where,
                bounds.lock_timeout,
                tries,
                _describe(blockers) or "a session now gone",
            )
        time.sleep(pause * random.uniform(0.5, 1.0))
        pause = min(pause * 2, 5.0, max(deadline - time.monotonic(), 0.0))


def _try(
    conn: psycopg.Connection,
    schema: str,
    where: str,
    bounds: MigrationBounds,
    shipped: Sequence[Migration],
) -> Plan:
    params = {
        "schema": schema,
        "migration_key": migration_lock_key(schema),
        "lock_timeout": f"{round(bounds.lock_timeout * 1000)}ms",
        "idle_timeout": f"{round(bounds.idle_in_transaction * 1000)}ms",
        **server_keepalive_settings(conn),
    }
    with conn.transaction():
        conn.execute(query("begin_migration", schema, _FILE), params)
        exists = conn.execute(query("schema_exists", schema, _FILE), params).fetchone()
        if not (exists and exists[0]):
            conn.execute(query("create_schema", schema, _FILE))
        conn.execute(query("create_schema_version", schema, _FILE))
        todo = plan(applied_migrations(conn, schema), shipped, where)
        if todo.adopt:
            conn.execute(query("add_checksum_column", schema, _FILE))
        for migration in todo.adopt:
            conn.execute(
                query("adopt_migration", schema, _FILE),
                {"version": migration.version, "checksum": migration.checksum},
            )
        for migration in todo.pending:
            conn.execute(migration.sql.encode())  # a file of plain DDL, shipped with the package
            crash_point("schema.after_migration")
            conn.execute(
                query("record_migration", schema, _FILE),
                {
                    "version": migration.version,
                    "name": migration.name,
                    "checksum": migration.checksum,
                },
            )
    return todo


def migration_blockers(conn: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    """The sessions holding locks a migration of ``schema`` waits for (at most five)."""
    params = {"schema": schema, "migration_key": migration_lock_key(schema)}
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query("migration_blockers", schema, _FILE), params).fetchall()
    except psycopg.Error as exc:  # the statement may not read pg_locks: the error still goes
        log.warning("could not name the sessions blocking the migration: %s", exc)
        return []


def _describe(blockers: list[dict[str, Any]]) -> str:
    parts = []
    for b in blockers:
        since = (
            f", transaction started {b['xact_start']:%Y-%m-%d %H:%M:%S %Z}"
            if b["xact_start"]
            else ""
        )
        query_start = (
            f", last query started {b['query_start']:%H:%M:%S}" if b["query_start"] else ""
        )
        parts.append(
            f"pid {b['pid']} (role {b['usename']!r}, application_name "
            f"{b['application_name']!r}, {b['state'] or 'no state'}{since}{query_start})"
        )
    return "; ".join(parts)


def _blocked(
    where: str, bounds: MigrationBounds, tries: int, blockers: list[dict[str, Any]]
) -> MigrationBlockedError:
    held = _describe(blockers) or "a session that ended before it could be named"
    pids = ", ".join(str(b["pid"]) for b in blockers) or "PID"
    return MigrationBlockedError(
        f"migrating {where} gave up after {bounds.give_up_after:g} s ({tries} tries, each "
        f"waiting at most {bounds.lock_timeout:g} s for a lock, then rolled back so that other "
        f"sessions' statements did not queue behind it): locks held by {held}. Nothing was "
        "changed. Let that session finish or end it (SELECT pg_terminate_backend(pid) for pid "
        f"in {pids}), then retry: `airflow-idempotency migrate` (--wait SECONDS waits longer), "
        "or the task's retry. See docs/deploying.md, upgrading.",
        blockers=blockers,
    )
