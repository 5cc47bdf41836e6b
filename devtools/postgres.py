"""Find a PostgreSQL server for the demo, the tests and the benchmarks.

Order of preference, each announced on stderr so nobody wonders which one is used:

1. ``IDEMPOTENCY_PG_DSN`` (a libpq DSN or URI) when it is set;
2. a server already answering on 127.0.0.1:5432 as user ``postgres``;
3. an embedded server (the ``pgserver`` wheel carries the Postgres binaries) started by
   this process, with its data in the git-ignored ``.pgdata/`` folder of the checkout.

``IDEMPOTENCY_PG=embedded`` skips the first two, ``IDEMPOTENCY_PG=local`` forbids the third.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DATA_DIR = ROOT / ".pgdata" / "data"
PRIVATE_DATA_ROOT = ROOT / ".pgdata" / "private"  # servers of one test each (private_embedded)
LOCAL_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=2"


@dataclass
class PostgresServer:
    """An admin DSN (database ``postgres``) and where it came from."""

    admin_dsn: str
    source: str  # "dsn", "local" or "embedded"
    _handle: Any = None

    def dsn(self, dbname: str) -> str:
        """The DSN of database ``dbname`` on this server."""
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def create_database(
        self, prefix: str = "idem", template: str | None = None, *, name: str | None = None
    ) -> str:
        """Create a database and return its name: ``name``, or ``prefix`` and a unique suffix.

        ``template``: a copy of that database, made with the FILE_COPY strategy (one
        checkpoint and a file copy: much faster than WAL_LOG for a large template).
        """
        name = name or f"{prefix}_{uuid.uuid4().hex[:12]}"
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt += sql.SQL(" TEMPLATE {} STRATEGY FILE_COPY").format(sql.Identifier(template))
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(stmt)
        return name

    def drop_database(self, name: str) -> None:
        """Drop ``name``, disconnecting whoever still uses it."""
        stmt = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(stmt)

    def stop(self) -> None:
        """Stop the embedded server if this process started it."""
        if self._handle is not None:
            self._handle.cleanup()
            self._handle = None


def _answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _say(message: str) -> None:
    print(f"[postgres] {message}", file=sys.stderr, flush=True)


def start_embedded(data_dir: Path = EMBEDDED_DATA_DIR) -> PostgresServer:
    """Start (or join) the embedded server whose data lives in ``data_dir``."""
    try:
        from pgserver.postgres_server import get_server
    except ImportError as exc:  # pragma: no cover - the dev lock installs it
        raise SystemExit(
            "No PostgreSQL found and the embedded server is not installed: "
            "run `python3 dev.py setup`, or set IDEMPOTENCY_PG_DSN to a server you have."
        ) from exc
    # pgserver narrates at INFO, also from an atexit hook that runs after pytest has closed
    # the streams Airflow's logging writes to ("--- Logging error ---" at the end of a run).
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _say(f"starting embedded PostgreSQL in {data_dir} ...")
    handle = get_server(data_dir, cleanup_mode="stop")
    admin_dsn = make_conninfo(handle.get_uri(), dbname="postgres")
    return PostgresServer(admin_dsn, "embedded", handle)


def find_server() -> PostgresServer:
    """Return the server to use, following the order in the module docstring."""
    mode = os.environ.get("IDEMPOTENCY_PG", "auto")
    dsn = os.environ.get("IDEMPOTENCY_PG_DSN")
    if dsn and mode != "embedded":
        if not _answers(dsn):
            raise SystemExit(
                "IDEMPOTENCY_PG_DSN is set but the server does not answer: check host, port, "
                "user and password, or unset it to use a local or embedded server."
            )
        _say("using the server from IDEMPOTENCY_PG_DSN")
        return PostgresServer(make_conninfo(dsn, dbname="postgres"), "dsn")
    if mode != "embedded" and _answers(LOCAL_DSN):
        _say("using the server answering on 127.0.0.1:5432")
        return PostgresServer(LOCAL_DSN, "local")
    if mode == "local":
        raise SystemExit("IDEMPOTENCY_PG=local but nothing answers on 127.0.0.1:5432.")
    return start_embedded()


@contextlib.contextmanager
def private_embedded(name: str) -> Iterator[PostgresServer]:
    """Start an embedded server of the caller's own; stop it and remove its data afterwards.

    Its data lives under the checkout's git-ignored ``.pgdata/`` (``name`` and a unique
    suffix), never under pytest's ``tmp_path``: pgserver runs the server as another OS user
    and opens the parent folders for it, and another pytest session resets its shared base
    folder (``pytest-of-<user>``) to mode 0700, after which the server can no longer reach
    its data ("could not access directory ...: Permission denied").
    """
    data = PRIVATE_DATA_ROOT / f"{name}-{uuid.uuid4().hex[:8]}" / "data"
    try:
        server = start_embedded(data)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(data.parent, ignore_errors=True)


@contextlib.contextmanager
def temporary_database(
    server: PostgresServer, prefix: str = "idem", template: str | None = None
) -> Iterator[str]:
    """Create a fresh database (a copy of ``template`` if given), yield its DSN, drop it."""
    name = server.create_database(prefix, template)
    try:
        yield server.dsn(name)
    finally:
        server.drop_database(name)
