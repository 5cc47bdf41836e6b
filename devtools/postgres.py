"""Find a PostgreSQL server for the demo, the tests and the benchmarks; stop and start one.

Order of preference, each announced on stderr so nobody wonders which one is used:

1. ``IDEMPOTENCY_PG_DSN`` (a libpq DSN or URI) when it is set;
2. a server already answering on 127.0.0.1:5432 as user ``postgres``;
3. an embedded server (the ``pgserver`` wheel carries the Postgres binaries) started by
   this process, with its data in the git-ignored ``.pgdata/`` folder of the checkout.

``IDEMPOTENCY_PG=embedded`` skips the first two, ``IDEMPOTENCY_PG=local`` forbids the third.

A cluster of a caller's own from the system's PostgreSQL binaries, with server settings of
its choosing (``max_connections``: the scale benchmark), is :func:`dedicated_cluster`.

A server of a caller's own (:func:`private_embedded`) can be stopped, started again and
restarted (:meth:`PostgresServer.stop`, :meth:`~PostgresServer.start`,
:meth:`~PostgresServer.restart`): the fault scenarios, the partition tests and chaos do.
Everything that touches the ``pgserver`` library is in :class:`_Embedded`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
STOP_MODES = ("smart", "fast", "immediate")


class _Embedded:
    """The one adapter of the ``pgserver`` library: its handle, and pg_ctl on its data.

    pgserver starts a server and stops it when its last user exits; it has no public way to
    stop it for a moment and start the very same server again (same data, same socket, so
    the same DSN), which the fault scenarios need. This class does that with pgserver's
    own ``pg_ctl`` wrapper and start routine, and nothing outside it touches pgserver.
    """

    def __init__(self, handle: Any, private: bool) -> None:
        self._handle = handle
        self.private = private
        self._options: str | None = None  # postgres options of our own start, if any

    @property
    def data_dir(self) -> Path:
        return Path(self._handle.pgdata)

    def admin_dsn(self) -> str:
        """The DSN of database ``postgres`` as the running server's postmaster.pid tells it."""
        info = self._handle.get_postmaster_info()
        dsn = make_conninfo(self._handle.get_uri(), dbname="postgres")
        return make_conninfo(dsn, port=str(info.port)) if info.port else dsn

    def socket_dir(self) -> str:
        return str(self._handle.get_postmaster_info().socket_dir)

    def pg_ctl(self, args: list[str]) -> None:
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]  # made at import

        pg_ctl(args, pgdata=self._handle.pgdata, user=self._handle.system_user, timeout=60)

    def stop(self, mode: str) -> None:
        self.pg_ctl(["-w", "-m", mode, "stop"])

    def start(self, options: str | None = None) -> None:
        """Start the stopped server: with pgserver's options (its socket only), or with the
        postgres ``options`` given here or at an earlier start (kept for the next ones)."""
        self._options = options or self._options
        if self._options:
            log = self.data_dir / "log"
            self.pg_ctl(["-w", "-o", self._options, "-l", str(log), "start"])
        # Finds the server running (or starts it, as pgserver does) and re-reads its
        # postmaster.pid, so that admin_dsn() names the new process's socket and port.
        with self._handle._lock:
            self._handle.ensure_postgres_running()

    def release(self) -> None:
        """pgserver's clean-up: stops the server if this process is its last user."""
        self._handle.cleanup()


@dataclass
class PostgresServer:
    """An admin DSN (database ``postgres``), where it came from, and the embedded server
    behind it when this process started one."""

    admin_dsn: str
    source: str  # "dsn", "local" or "embedded"
    _embedded: _Embedded | None = None

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

    # ---------------------------------------------------------------- a private server

    @property
    def data_dir(self) -> Path:
        """The data folder of this private server."""
        return self._private().data_dir

    def stop(self, mode: str = "fast") -> None:
        """Stop this private server: ``fast`` (sessions terminated, a clean shutdown),
        ``immediate`` (like a crash: WAL recovery on the next start) or ``smart``."""
        if mode not in STOP_MODES:
            raise ValueError(f"stop mode {mode!r}: use one of {', '.join(STOP_MODES)}")
        self._private().stop(mode)

    def start(self) -> None:
        """Start this private server again, with the options of its last start: the same
        DSN works again."""
        embedded = self._private()
        embedded.start()
        self.admin_dsn = embedded.admin_dsn()

    def restart(self, mode: str = "fast", down_seconds: float = 0.0) -> float:
        """Stop (``mode``), stay down ``down_seconds``, start again; return the seconds down."""
        began = time.monotonic()
        self.stop(mode)
        time.sleep(down_seconds)
        self.start()
        return time.monotonic() - began

    def listen(self, host: str, port: int) -> None:
        """Restart this private server listening on TCP ``host``:``port`` as well as on its
        socket, trusting the /24 of ``host`` (initdb trusts loopback addresses only).
        ``admin_dsn`` keeps using the socket (its file name carries the port)."""
        embedded = self._private()
        socket_dir = embedded.socket_dir()
        embedded.stop("fast")
        hba = embedded.data_dir / "pg_hba.conf"
        hba.write_text(hba.read_text() + f"host all all {host}/24 trust\n")
        embedded.start(f"-h {host} -p {port} -k {socket_dir}")
        self.admin_dsn = embedded.admin_dsn()

    def _private(self) -> _Embedded:
        if self._embedded is None or not self._embedded.private:
            raise RuntimeError(
                f"this {self.source} server is shared: only a private embedded server "
                "(devtools.postgres.private_embedded) can be stopped and started; "
                "use close() to let go of a shared one"
            )
        return self._embedded

    # ---------------------------------------------------------------- letting go

    def close(self) -> None:
        """Let go of the server: an embedded one this process started is stopped when no
        other process uses it; a server found elsewhere is left alone."""
        if self._embedded is not None:
            self._embedded.release()
            self._embedded = None


def _answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _say(message: str) -> None:
    print(f"[postgres] {message}", file=sys.stderr, flush=True)


def start_embedded(data_dir: Path = EMBEDDED_DATA_DIR, *, private: bool = False) -> PostgresServer:
    """Start (or join) the embedded server whose data lives in ``data_dir``.

    ``private``: the caller owns the server alone (:func:`private_embedded`), so it may
    stop and start it.
    """
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
    embedded = _Embedded(get_server(data_dir, cleanup_mode="stop"), private)
    return PostgresServer(embedded.admin_dsn(), "embedded", embedded)


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
        server = start_embedded(data, private=True)
        try:
            yield server
        finally:
            server.close()
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


SYSTEM_BINARIES = Path("/usr/lib/postgresql")
"""Where Debian's packages put each PostgreSQL version's initdb and pg_ctl (``<major>/bin``)."""


def system_binaries() -> Path | None:
    """The ``bin`` folder of the newest PostgreSQL installed under :data:`SYSTEM_BINARIES`."""
    found = [
        p.parent for p in SYSTEM_BINARIES.glob("*/bin/initdb") if p.parent.parent.name.isdigit()
    ]
    return max(found, key=lambda p: int(p.parent.name)) if found else None


def _as_nobody() -> list[str]:
    """The command prefix that drops root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@contextlib.contextmanager
def dedicated_cluster(name: str, settings: dict[str, str]) -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of the caller's own, made by the system's ``initdb`` and started
    with ``settings`` (``{"max_connections": "100"}``) on 127.0.0.1 at a free port; stopped
    and removed afterwards.

    Its folder is under /tmp, owned by ``nobody`` when this process is root (the server
    refuses root, as PgBouncer does: devtools/pgbouncer.py). Trust authentication for user
    ``postgres``, a superuser, as on the shared server.
    """
    binaries = system_binaries()
    if binaries is None:
        raise RuntimeError(
            f"no PostgreSQL binaries under {SYSTEM_BINARIES} (apt-get install postgresql)"
        )
    folder = Path(tempfile.mkdtemp(prefix=f"idem-{name}-"))
    data = folder / "data"
    prefix = _as_nobody()
    if prefix:
        shutil.chown(folder, "nobody", "nogroup")
        os.chmod(folder, 0o755)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} " + " ".join(
        f"-c {key}={value}" for key, value in settings.items()
    )
    pg_ctl = [*prefix, str(binaries / "pg_ctl"), "-D", str(data), "-w", "-t", "60"]
    try:
        subprocess.run(
            [*prefix, str(binaries / "initdb"), "-D", str(data), "-U", "postgres",
             "--auth=trust", "--no-locale", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        _say(f"starting a dedicated PostgreSQL ({binaries.parent.name}) in {data}, port {port}")
        subprocess.run(
            [*pg_ctl, "-l", str(folder / "server.log"), "-o", options, "start"],
            check=True, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        try:
            yield PostgresServer(
                make_conninfo(
                    host="127.0.0.1", port=str(port), user="postgres", dbname="postgres",
                    connect_timeout="5",
                ),
                "dedicated",
            )  # fmt: skip
        finally:
            subprocess.run(
                [*pg_ctl, "-m", "fast", "stop"], capture_output=True, timeout=90, check=False
            )
    except subprocess.CalledProcessError as exc:
        log = folder / "server.log"
        raise RuntimeError(
            f"dedicated PostgreSQL {name}: {exc.cmd[len(prefix)]} failed: {exc.stderr}"
            + (log.read_text(errors="replace")[-2000:] if log.exists() else "")
        ) from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)
