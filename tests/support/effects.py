"""What the tests of every kind of effect share.

One idempotent run around some work, the same run in a worker process killed where the test
says, the ledger's rows, a metrics sink that keeps what it is given, a local chat webhook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.records import Trigger
from airflow_idempotency.run_context import RunEnvironment
from airflow_idempotency.runner import RunOptions, RunResult
from airflow_idempotency.schema import ensure_schema


def run_once(
    dsn: str,
    work: Callable[[RunContext], Any],
    *,
    job: str = "job",
    run_key: str = "2026-10-01",
    force: bool = False,
    dry_run: bool = False,
    metrics: Any = None,
    trigger: Trigger | None = None,
) -> RunResult:
    """One execution of (job, run_key) through the real runner and Postgres (a script's run
    unless ``trigger`` names the Airflow run that started it)."""
    environment = RunEnvironment() if metrics is None else RunEnvironment(metrics=metrics)
    triggered: dict[str, Any] = {"trigger": trigger} if trigger is not None else {}
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=job,
        run_key=run_key,
        work=work,
        options=RunOptions(force=force, dry_run=dry_run),
        environment=environment,
        **triggered,
    )


EFFECTS_WORKER = Path(__file__).with_name("effects_worker.py")
"""The worker process of the effect crash tests (its docstring says its arguments)."""


def crashed_worker(crash_at: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``effects_worker.py ARGV`` run to its end within 120 s, armed to be SIGKILLed at the
    crash point ``crash_at`` (AIRFLOW_IDEMPOTENCY_CRASH_AT)."""
    return subprocess.run(
        [sys.executable, str(EFFECTS_WORKER), *argv],
        env={**os.environ, "AIRFLOW_IDEMPOTENCY_CRASH_AT": crash_at},
        capture_output=True,
        text=True,
        timeout=120,
    )


class RecordedMetrics:
    """A Metrics sink that keeps every counter increment: (name, count, tags)."""

    def __init__(self) -> None:
        self.counts: list[tuple[str, int, dict[str, str]]] = []

    def incr(self, stat: str, count: int = 1, *, tags: Any = None) -> None:
        self.counts.append((stat, count, dict(tags or {})))

    def timing(self, stat: str, dt: Any, *, tags: Any = None) -> None:
        return None


def ledger(dsn: str, remote_system: str | None = None) -> dict[str, tuple[Any, ...]]:
    """idempotency key -> (status, effect_kind, deduplicating, call_count, last_error)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, status, effect_kind, deduplicating, call_count, last_error"
            " FROM idempotency.outbound_ledger"
            " WHERE %(remote)s::text IS NULL OR remote_system = %(remote)s ORDER BY ledger_id",
            {"remote": remote_system},
        ).fetchall()
    return {row[0]: tuple(row[1:]) for row in rows}


def statuses(dsn: str, remote_system: str | None = None) -> dict[str, str]:
    """idempotency key -> status."""
    return {key: row[0] for key, row in ledger(dsn, remote_system).items()}


def seed_ledger(
    dsn: str, job: str, entries: list[tuple[str, str, str, str, bool, str | None]]
) -> None:
    """Ledger rows of (job, 2026-10-01) as the ledger writes them, in a migrated schema: each
    entry (remote_system, idempotency_key, status, effect_kind, deduplicating, last_error)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn, "idempotency")
        conn.cursor().executemany(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,"
            " run_key, request_fingerprint, status, effect_kind, deduplicating, last_error)"
            " VALUES (%s, %s, %s, '2026-10-01', 'f', %s, %s, %s, %s)",
            [(remote, key, job, *rest) for remote, key, *rest in entries],
        )


class LocalEndpoint:
    """A local HTTP endpoint (127.0.0.1, a free port, its own thread) that answers each POST
    to ``url`` with the status :meth:`answer` gives for its headers and body."""

    def __init__(self, path: str) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(endpoint.answer(self.headers, body))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, headers: Message, body: bytes) -> int:
        raise NotImplementedError


class Webhook(LocalEndpoint):
    """A local HTTP endpoint that records every POST body (a chat webhook)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        super().__init__("/hook")

    def answer(self, headers: Message, body: bytes) -> int:
        self.bodies.append(json.loads(body))
        return 200

    def events(self, run_id_part: str = "") -> Counter[tuple[str, str]]:
        return Counter(
            (b["task_id"], b["event"]) for b in self.bodies if run_id_part in b["run_id"]
        )
