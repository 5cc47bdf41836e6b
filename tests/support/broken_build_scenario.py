"""One scenario that exposes a broken build, without Airflow.

Run by tests/faults/test_chaos_builds.py.

    python tests/support/broken_build_scenario.py DSN SCENARIO [LOCK_MODE]

runs the example's work through ``run_idempotently`` of whatever ``airflow_idempotency`` is
first on the PYTHONPATH (this checkout's provider, or a broken copy), in the lock mode
``LOCK_MODE`` (``advisory`` by default, or ``lease``), then prints one JSON line: the
provider's file, what each run returned, and the history invariants violated.
Scenarios: ``fence`` (a run's lock session ended, in the lease mode its lease taken over, as
chaos does, while it waits to do its work), ``lock``
(a second run of the key while the first waits to do its work), ``completed`` (a completed
key run again), ``resend`` (an export, then a forced rerun of it).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import airflow_idempotency
from airflow_idempotency.runner import RunOptions, run_idempotently
from devtools import invariants
from devtools.chaos.faults import take_over_lease, terminate_lock
from devtools.chaos.phases import Event
from invoicing import tasks
from invoicing.seed import seed_orders

D = "2026-10-01"
CREATE = "finalize_invoices.create_invoices"
EXPORT = "finalize_invoices.export_invoices"
MODE = {"lock_mode": "advisory"}  # main() sets the scenario's


def run(dsn: str, job: str, work: Callable[[Any], Any], force: bool = False) -> str:
    """One run; its outcome, or the exception it raised."""
    try:
        return run_idempotently(
            connect=lambda: psycopg.connect(dsn),
            job_name=job,
            run_key=D,
            work=work,
            options=RunOptions(force=force),
            lock_mode=MODE["lock_mode"],
        ).outcome.value
    except Exception as exc:
        return type(exc).__name__


def slowly(work: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``work`` after 2 s: the run holds its lock, its attempt started, its work not done."""

    def later(run: Any) -> Any:
        time.sleep(2)
        return work(run)

    return later


def slow_create(dsn: str, outcomes: list[str]) -> threading.Thread:
    """create_invoices in a thread, its work 2 s after the start (lock held, not done)."""

    def create() -> str:
        return run(dsn, CREATE, slowly(tasks.create_invoices))

    thread = threading.Thread(target=lambda: outcomes.append(create()), daemon=True)
    thread.start()
    return thread


def while_creating(dsn: str, after: float, action: Callable[[list[str]], None]) -> list[str]:
    """``action`` ``after`` seconds into a slow create_invoices (its lock held, its work not
    done); the outcomes of both, once the create has ended."""
    outcomes: list[str] = []
    thread = slow_create(dsn, outcomes)
    time.sleep(after)
    action(outcomes)
    thread.join()
    return outcomes


def fence(dsn: str) -> list[str]:
    def terminate_its_lock(outcomes: list[str]) -> None:
        lose = take_over_lease if MODE["lock_mode"] == "lease" else terminate_lock
        event = Event(1, lose.__name__, "", 0)
        outcomes.append(lose(dsn, event, {"pick": 0, "work": True}))

    return while_creating(dsn, 1, terminate_its_lock)


def lock(dsn: str) -> list[str]:
    return while_creating(dsn, 0.5, lambda outcomes: slow_create(dsn, outcomes).join())


def completed(dsn: str) -> list[str]:
    return [run(dsn, CREATE, tasks.create_invoices), run(dsn, CREATE, tasks.create_invoices)]


def resend(dsn: str) -> list[str]:
    from devtools.accounting import run_accounting_service

    outcomes = [run(dsn, CREATE, tasks.create_invoices)]
    with run_accounting_service(dsn) as service:

        def export(run: Any) -> Any:
            return tasks.export_invoices(run, service.url)

        outcomes += [run(dsn, EXPORT, export), run(dsn, EXPORT, export, force=True)]
    return outcomes


SCENARIOS = {"fence": fence, "lock": lock, "completed": completed, "resend": resend}


def main(dsn: str, scenario: str, lock_mode: str = "advisory") -> None:
    from accounting_service.store import ensure_schema as ensure_accounting_schema

    MODE["lock_mode"] = lock_mode
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_orders(conn, dt.date(2026, 10, 1), dt.date(2026, 10, 1), 3, 1)
    asyncio.run(ensure_accounting_schema(dsn))
    invariants.prepare(dsn)
    outcomes = SCENARIOS[scenario](dsn)
    violated = sorted(v.invariant.name for v in invariants.check(dsn, [D], ("always",)))
    print(
        json.dumps(
            {
                "provider": airflow_idempotency.__file__,
                "lock_mode": lock_mode,
                "outcomes": outcomes,
                "violated": violated,
                "lease_tokens": lease_tokens(dsn),
            }
        )
    )


def lease_tokens(dsn: str) -> int:
    """Lease tokens the job database drew (0 in the advisory mode)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END"
            " FROM idempotency.run_lease_tokens"
        ).fetchone()
    return int(row[0]) if row else 0


if __name__ == "__main__":
    main(*sys.argv[1:4])
