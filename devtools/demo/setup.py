"""The demo's set-up: its job database, accounting service, SMTP server and export folder.

And the ``env.sh`` a shell sources to look around afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from devtools import airflow_env
from devtools.airflow_env import DAGS_FOLDER, ROOT, connection_env
from devtools.demo.output import Narration, rel
from devtools.demo.plan import Plan

DB_PREFIX = "idem_demo_"


@dataclass(kw_only=True)
class DemoSetup(Narration):
    """The demo's arguments, plan and work folder, and what its set-up starts and creates."""

    args: argparse.Namespace
    plan: Plan
    workdir: Path
    dsn: str = ""
    db_name: str = ""
    server_note: str = ""
    server_source: str = ""
    service: Any = None
    smtp: Any = None  # the local SMTP server the finance summary emails go to
    conn_env: dict[str, str] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def setup_database(self, stack: contextlib.ExitStack) -> None:
        from devtools.postgres import find_server

        server = find_server()
        stack.callback(self._stop_server, server)
        self.server_source = server.source
        self.server_note = {
            "dsn": "the server from IDEMPOTENCY_PG_DSN",
            "local": "the local server on 127.0.0.1:5432",
            "embedded": f"an embedded server (data in {rel(ROOT / '.pgdata')}/)",
        }[server.source]
        self.drop_previous_databases(server)
        self.db_name = f"{DB_PREFIX}{dt.datetime.now():%Y%m%d_%H%M%S}_{os.getpid()}"
        (self.workdir / "database").write_text(self.db_name + "\n")
        server.create_database(name=self.db_name)
        self.dsn = server.dsn(self.db_name)
        if not self.args.keep:
            stack.callback(server.drop_database, self.db_name)
        # Held until the end: a concurrent demo's clean-up never drops a database in use.
        stack.enter_context(psycopg.connect(self.dsn))

    def drop_previous_databases(self, server: Any) -> None:
        recorded_file = self.workdir / "database"
        recorded = recorded_file.read_text().strip() if recorded_file.exists() else None
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            names = [
                n
                for (n,) in conn.execute(
                    "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (DB_PREFIX,)
                )
            ]
            dropped = []
            for name in names:
                # This work folder's previous database, even if a leftover session holds it;
                # any other demo database only when nobody uses it (another demo may run).
                force = sql.SQL(" WITH (FORCE)") if name == recorded else sql.SQL("")
                stmt = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)) + force
                try:
                    conn.execute(stmt)
                    dropped.append(name)
                except psycopg.errors.ObjectInUse:
                    pass
        if dropped:
            self.say(f"[dim]dropped {len(dropped)} previous demo database(s)[/dim]")

    @staticmethod
    def _stop_server(server: Any) -> None:
        server.close()

    def start_service(self, stack: contextlib.ExitStack) -> None:
        from devtools.accounting import run_accounting_service

        log = self.logs / "accounting-service.log"
        stack.callback(lambda: log.write_text(self.service.stderr_text() if self.service else ""))
        self.service = stack.enter_context(run_accounting_service(self.dsn))
        # batch_size: the ledger claims and confirms 50 invoices per statement (default 500),
        # so that the crash of step 5 leaves confirmed, pending and unclaimed invoices.
        self.conn_env = connection_env(self.dsn, self.service.url, timeout=10, batch_size=50)
        self.start_mail_and_files(stack)
        self.write_env_file()

    @property
    def exports(self) -> Path:
        """Where the example writes each date's export file (the invoice_exports connection)."""
        return self.workdir / "exports"

    def start_mail_and_files(self, stack: contextlib.ExitStack) -> None:
        """A local SMTP server for the finance summary emails (it counts what it delivers) and
        the export files' folder: the finance_smtp and invoice_exports connections."""
        from devtools.smtp_server import SmtpServer, smtp_connection_env

        self.smtp = SmtpServer(self.workdir / "mail")
        self.smtp.start()
        stack.callback(self.smtp.kill)
        self.exports.mkdir(parents=True, exist_ok=True)
        self.conn_env.update(
            smtp_connection_env(self.smtp, "finance_smtp", "invoicing@example.com")
        )
        folder = {"conn_type": "fs", "extra": {"path": str(self.exports)}}
        self.conn_env["AIRFLOW_CONN_INVOICE_EXPORTS"] = json.dumps(folder)

    def summary_mails(self, day: dt.date) -> int:
        """How many finance summary emails of ``day`` the SMTP server delivered."""
        key = f"finalize_invoices:{day.isoformat()}:finance_summary"
        return int(self.smtp.deliveries_by_key()[key])

    def export_file(self, day: dt.date) -> tuple[int, int, bytes] | None:
        """The export file of ``day``: (mtime in ns, inode, content), or None if absent."""
        path = self.exports / "invoices" / f"{day.isoformat()}.csv"
        if not path.exists():
            return None
        info = path.stat()
        return info.st_mtime_ns, info.st_ino, path.read_bytes()

    def write_env_file(self) -> None:
        """``.demo/env.sh``: what a shell needs to look at the demo's Airflow and database."""
        home = self.workdir / "airflow"
        values = {
            **airflow_env.configure(home, {}),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(DAGS_FOLDER)]),
            "AIRFLOW_IDEMPOTENCY_DSN": self.dsn,
            **self.conn_env,
        }
        lines = [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
        (self.workdir / "env.sh").write_text("\n".join(lines) + "\n")
