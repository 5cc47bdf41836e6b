"""Email through the outbound ledger against a plain smtplib loop, side by side.

Set-up: a real SMTP server (``devtools.smtp_server``, aiosmtpd in its own process, counting
what it accepts; a fresh process for each pass, on one port), N email effects of one
business date (the same messages for every pass: ``SmtpSender.message`` builds them).

Measured, each pass in a fresh worker process that reports its own time:

1. ``plain loop (before)``: smtplib on ONE connection, ``sendmail`` of each message in turn
   (what a job without the ledger does);
2. ``ledger``: ``run_idempotently`` of a work that sends the N effects through
   ``OutboundLedger.send_all`` and ``SmtpSender`` (intent committed before each message,
   outcome after: 4 worker threads on smtplib, one SMTP connection each, while the run's
   thread group-commits outcomes and the next intents, at most 4 + 8 ahead);
3. ``plain loop (after)``: as 1; the ratio's baseline is 1 and 3 together, which brackets
   the ledger in time so that drift in load weighs on both sides;
4. the forced rerun of the completed key: the work runs again and the ledger skips all N
   confirmed effects without a message (the server's count proves it).

Every pass must deliver exactly N messages (the ledger's rerun none).
"""

from __future__ import annotations

import smtplib
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import psycopg

from bench.common import BenchResult, Size, at_least, at_most, database, run_child, say
from devtools.postgres import PostgresServer

TITLE = "Email to a local SMTP server: the ledger against a plain smtplib loop"
DAY = "2026-10-01"
JOB = "finance.summary_mail"
THROUGHPUT_SHARE = 0.90
RERUN_LIMIT_S = 1.0
FROM = "jobs@example.com"


def _effects(n: int, tag: str) -> list[Any]:
    from airflow_idempotency.effects.mail import email_effect

    return [
        email_effect(
            f"{tag}:{DAY}:mail_{i}",
            to=f"customer{i}@example.com",
            subject=f"Your invoices of {DAY} ({i})",
            text=f"Dear customer {i},\n\nyour invoices of {DAY} are ready.\n" + "-" * 400,
        )
        for i in range(n)
    ]


def _sender(port: int) -> Any:
    from airflow_idempotency.effects.mail import SmtpSender

    return SmtpSender(host="127.0.0.1", port=port, from_email=FROM, concurrency=4, timeout=30)


def child_plain_loop(port: int, n: int, tag: str) -> dict[str, Any]:
    """smtplib, one connection, one message after the other (messages built in the loop)."""
    sender = _sender(port)
    effects = _effects(n, tag)
    t0 = time.perf_counter()
    with smtplib.SMTP("127.0.0.1", port) as smtp:
        for effect in effects:
            msg = sender.message(effect)
            smtp.sendmail(FROM, effect.request["to"], msg.as_bytes())
    return {"seconds": time.perf_counter() - t0}


def child_ledger(dsn: str, port: int, n: int, tag: str, force: bool) -> dict[str, Any]:
    """One idempotent run sending the N effects through the ledger."""
    from airflow_idempotency import OutboundLedger, run_idempotently
    from airflow_idempotency.runner import RunOptions

    effects = _effects(n, tag)
    out: dict[str, Any] = {}

    def work(run: Any) -> dict[str, int]:
        summary = OutboundLedger(run, "smtp", batch_size=500).send_all(effects, _sender(port))
        out.update(sent=summary.sent, skipped=summary.skipped_existing, unknown=summary.unknown)
        return summary.as_counts("mail")

    t0 = time.perf_counter()
    run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=DAY,
        work=work,
        options=RunOptions(force=force),
    )
    return {"seconds": time.perf_counter() - t0, **out}


def _pass(folder: Path, port: int, target: str, args: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """One pass against a fresh server process; what the child reported, and the server's count."""
    from devtools.smtp_server import SmtpServer

    server = SmtpServer(folder, port, quiet=True)
    (folder / "count").unlink(missing_ok=True)
    server.start()
    try:
        result = run_child(target, {**args, "port": port})
    finally:
        server.stop()
    return result, server.delivered_count()


def run(size: Size, server: PostgresServer) -> BenchResult:
    from devtools.smtp_server import free_port

    n = size.email_messages
    result = BenchResult("emails", TITLE)
    port = free_port()
    with TemporaryDirectory(prefix="bench-mail-") as tmp, database(server, "bench_mail") as dsn:
        folder = Path(tmp)
        say(f"emails: plain loop (before), {n:,} messages ...")
        before, count_before = _pass(folder, port, "bench.emails:child_plain_loop",
                                     {"n": n, "tag": "plain-before"})  # fmt: skip
        say("emails: the ledger ...")
        ledger, count_ledger = _pass(folder, port, "bench.emails:child_ledger",
                                     {"dsn": dsn, "n": n, "tag": "ledger", "force": False})  # fmt: skip
        say("emails: plain loop (after) ...")
        after, count_after = _pass(folder, port, "bench.emails:child_plain_loop",
                                   {"n": n, "tag": "plain-after"})  # fmt: skip
        say("emails: the forced rerun of the completed key ...")
        rerun, count_rerun = _pass(folder, port, "bench.emails:child_ledger",
                                   {"dsn": dsn, "n": n, "tag": "ledger", "force": True})  # fmt: skip
    plain_rate = 2 * n / (before["seconds"] + after["seconds"])
    ledger_rate = n / ledger["seconds"]
    ratio = ledger_rate / plain_rate
    result.add("plain smtplib loop, one connection (before)", n / before["seconds"], "msg/s")
    result.add("plain smtplib loop, one connection (after)", n / after["seconds"], "msg/s")
    result.add("ledger: SmtpSender, intent + outcome per message", ledger_rate, "msg/s")
    result.add(
        "ratio ledger / plain loop",
        ratio,
        "x",
        f">= {THROUGHPUT_SHARE}",
        at_least(ratio, THROUGHPUT_SHARE),
    )
    result.add(
        f"forced rerun, {n:,} confirmed effects",
        rerun["seconds"],
        "s",
        f"<= {RERUN_LIMIT_S}",
        at_most(rerun["seconds"], RERUN_LIMIT_S),
        note=f"skipped {rerun.get('skipped')}, sent {rerun.get('sent')}",
    )
    delivered_ok = (count_before, count_ledger, count_after, count_rerun) == (n, n, n, 0)
    result.add(
        "messages the server delivered: before / ledger / after / rerun",
        None,
        "",
        f"{n} / {n} / {n} / 0",
        delivered_ok,
        note=f"{count_before} / {count_ledger} / {count_after} / {count_rerun}",
    )
    result.notes.append(
        f"{n:,} messages of ~0.6 kB; the server is one aiosmtpd process (asyncio), started "
        "fresh for each pass; the ledger uses 4 SMTP connections (a worker thread each), "
        "batches of 500, its intents and outcomes group-committed by the run's thread meanwhile "
        "(synchronous_commit on)."
    )
    return result
