"""A worker process for the effect crash tests, killed by a crash point.

One idempotent run that sends emails or writes a file, killed by a crash point
(AIRFLOW_IDEMPOTENCY_CRASH_AT) where the test says.

    python tests/support/effects_worker.py mail DSN SMTP_PORT COUNT [BATCH_SIZE CONCURRENCY]
    python tests/support/effects_worker.py file DSN ROOT NAME CONTENT
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from airflow_idempotency import Effect, RunContext, run_idempotently
from airflow_idempotency.runner import RunOptions


def emails(count: int) -> list[Effect]:
    from airflow_idempotency.effects.mail import email_effect

    return [
        email_effect(
            f"job:2026-10-01:mail_{i}",
            to=f"user{i}@example.com",
            subject=f"message {i}",
            text=f"body {i}",
        )
        for i in range(count)
    ]


def main(argv: list[str]) -> None:
    kind, dsn = argv[0], argv[1]

    def mail(run: RunContext) -> dict[str, int]:
        from airflow_idempotency import OutboundLedger, Retries
        from airflow_idempotency.effects.mail import SmtpSender

        batch_size, concurrency = (int(argv[4]), int(argv[5])) if len(argv) > 4 else (10, 2)
        sender = SmtpSender(
            host="127.0.0.1", port=int(argv[2]), from_email="jobs@example.com",
            concurrency=concurrency,
        )  # fmt: skip
        retries = Retries(backoff_initial=0.01, backoff_max=0.05)
        ledger = OutboundLedger(run, "smtp", batch_size=batch_size, retries=retries)
        return ledger.send_all(emails(int(argv[3])), sender).as_counts("mail")

    def file(run: RunContext) -> dict[str, str]:
        from airflow_idempotency.effects.outputs import OutputFile

        with OutputFile(run, argv[3], root=argv[2]) as out:
            out.write_text(argv[4])
        return {"file": argv[3]}

    works: dict[str, Callable[[RunContext], Mapping[str, Any]]] = {"mail": mail, "file": file}
    work = works[kind]
    run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name="job",
        run_key="2026-10-01",
        work=work,
        options=RunOptions(force=os.environ.get("EFFECTS_FORCE") == "1"),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
