"""A real PgBouncer in front of the test PostgreSQL server, in a chosen pool mode.

Debian's ``pgbouncer`` refuses to run as root, so it runs as ``nobody`` with its ini, auth
file, socket and log in a folder of its own (owned by nobody), and listens on a free port
of 127.0.0.1. Every database name is forwarded to the upstream server (``* = ...``), one
pool per database, ``pool_size`` server connections each (small, so reuse is certain).

    with run_pgbouncer(server, "transaction") as bouncer:
        dsn = bouncer.dsn("idem_test_1234")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools.airflow_stack import free_port
from devtools.postgres import PostgresServer

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
POOL_MODES = ("session", "transaction", "statement")


class PgBouncerError(RuntimeError):
    """PgBouncer is not installed or did not come up."""


def installed() -> bool:
    """Whether Debian's pgbouncer binary is here (`.ci/run` installs it)."""
    return os.access(PGBOUNCER, os.X_OK)


@dataclass
class PgBouncer:
    """A running PgBouncer: where it listens and the folder holding its files."""

    port: int
    folder: Path
    pool_mode: str
    upstream: dict[str, str]
    process: subprocess.Popen[bytes]

    def dsn(self, dbname: str) -> str:
        """A DSN of ``dbname`` through PgBouncer (as the upstream user)."""
        return make_conninfo(
            host="127.0.0.1",
            port=str(self.port),
            user=self.upstream.get("user", "postgres"),
            dbname=dbname,
            connect_timeout="5",
        )

    def log_text(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _upstream(server: PostgresServer) -> dict[str, str]:
    params = {k: str(v) for k, v in conninfo_to_dict(server.admin_dsn).items()}
    params.pop("dbname", None)
    params.pop("connect_timeout", None)
    return params


def _ini(
    port: int,
    folder: Path,
    pool_mode: str,
    pool_size: int,
    upstream: dict[str, str],
    settings: dict[str, str],
) -> str:
    target = " ".join(f"{k}={v}" for k, v in upstream.items())
    values = {
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": str(folder),
        "auth_type": "trust",
        "auth_file": f"{folder}/users.txt",
        "pool_mode": pool_mode,
        "default_pool_size": str(pool_size),
        "min_pool_size": "0",
        "max_client_conn": "500",
        "logfile": f"{folder}/pgbouncer.log",
        "pidfile": f"{folder}/pgbouncer.pid",
        "admin_users": "postgres",
        "server_check_delay": "0",
        **settings,  # a caller's setting replaces the default of the same name
    }
    lines = "".join(f"{name} = {value}\n" for name, value in values.items())
    return f"[databases]\n* = {target}\n\n[pgbouncer]\n{lines}"


@contextlib.contextmanager
def run_pgbouncer(
    server: PostgresServer,
    pool_mode: str,
    pool_size: int = 2,
    settings: dict[str, str] | None = None,
) -> Iterator[PgBouncer]:
    """Start PgBouncer as ``nobody`` in ``pool_mode`` in front of ``server``; stop it after.

    ``settings``: more ``[pgbouncer]`` settings, e.g. ``{"query_wait_timeout": "4"}``; one
    of the defaults above (``max_client_conn`` 500, ...) is replaced by a setting of its name.
    """
    if pool_mode not in POOL_MODES:
        raise ValueError(f"pool_mode must be one of {POOL_MODES}, not {pool_mode!r}")
    if not installed():
        raise PgBouncerError("pgbouncer is not installed: apt-get install pgbouncer")
    folder = Path(tempfile.mkdtemp(prefix=f"idem-pgbouncer-{pool_mode}-"))
    port = free_port()
    upstream = _upstream(server)
    user = upstream.get("user", "postgres")
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    ini = _ini(port, folder, pool_mode, pool_size, upstream, settings or {})
    (folder / "pgbouncer.ini").write_text(ini)
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        subprocess.run(["chown", "-R", "nobody:nogroup", str(folder)], check=True)
        os.chmod(folder, 0o755)
        command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    else:
        command = []
    # Its stderr goes to a file, never a pipe: PgBouncer logs every login there as well as to
    # its logfile, and a pipe nobody reads fills (64 KiB, a few hundred logins) and then blocks
    # its one thread in write(): every client and server connection of the pooler stalls.
    with open(folder / "stderr.txt", "wb") as stderr:
        process = subprocess.Popen(
            [*command, PGBOUNCER, str(folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    bouncer = PgBouncer(port, folder, pool_mode, upstream, process)
    try:
        _wait_until_ready(bouncer)
        yield bouncer
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_until_ready(bouncer: PgBouncer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if bouncer.process.poll() is not None:
            err = (bouncer.folder / "stderr.txt").read_text(errors="replace")
            raise PgBouncerError(
                f"pgbouncer exited with {bouncer.process.returncode}: {err}\n{bouncer.log_text()}"
            )
        try:
            with psycopg.connect(bouncer.dsn("postgres"), autocommit=True) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.Error as exc:
            last = exc
            time.sleep(0.1)
    raise PgBouncerError(f"pgbouncer did not answer in {timeout} s: {last}\n{bouncer.log_text()}")
