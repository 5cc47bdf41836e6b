"""What the fence tests' work writes and reads: the `public.facts` table; a recording remote.

The ``facts`` fixture (tests/conftest.py) creates the table; :func:`writer` is work that
writes one row of it inside ``run.transaction()``; :func:`written` and :func:`outcomes` read
what committed and how the attempts ended; :func:`late_start_race` is the race of a start
after its lock was lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from airflow_idempotency.ledger.senders import BlockingEffectSender, Confirmation, Effect
from airflow_idempotency.runner import RunContext, run_idempotently
from support.db import rows
from support.locks import Background, terminate_lock_session, wait_for

FENCE_KEYS = 2
"""pg_locks.objsubid of the fence keys (the (int4, int4) advisory space)."""


def create_facts(dsn: str) -> str:
    """Create ``public.facts (writer text)``; return the DSN."""
    rows(dsn, "CREATE TABLE public.facts (writer text NOT NULL)")
    return dsn


def written(dsn: str) -> list[str]:
    """The writers of the committed rows of ``public.facts``, sorted."""
    return [w for (w,) in rows(dsn, "SELECT writer FROM public.facts ORDER BY writer")]


def outcomes(dsn: str) -> list[str]:
    """The outcome of every attempt, in order."""
    found = rows(dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id")
    return [outcome for (outcome,) in found]


def insert(cur: psycopg.Cursor[Any], name: str) -> None:
    cur.execute("INSERT INTO public.facts VALUES (%s)", (name,))


def writer(name: str) -> Callable[[RunContext], None]:
    """Work that writes the row ``name`` in one fenced transaction."""

    def work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, name)

    return work


class Recorder(BlockingEffectSender[None]):
    """A remote that keeps every call it receives."""

    kind = "webhook"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        self.calls.append(effect.idempotency_key)
        return Confirmation(reference=effect.idempotency_key)


def late_start_race(
    dsn: str, job: str, key: str, on_late_connect: Callable[[], None] = lambda: None
) -> tuple[Background, Background]:
    """The race of a start after its lock was lost (the fence model's finding): a first
    attempt takes the run lock, its lock session is terminated before its start, a successor
    takes the key and writes one row of ``finding_rows`` inside ``run.transaction()``, and only
    then does the first attempt's start go on. Returns (late, successor), both joined.
    ``on_late_connect`` runs on the late attempt's thread at each of its connects."""
    late_start, successor_works = threading.Event(), threading.Event()
    connects = {"late": 0}

    def late_connect() -> psycopg.Connection[Any]:
        on_late_connect()
        connects["late"] += 1
        if connects["late"] == 2:  # the work connection: opened after the lock is taken
            late_start.wait(30)
        return psycopg.connect(dsn)

    def successor_work(run: RunContext) -> None:
        successor_works.set()
        with run.transaction() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS finding_rows (n int)")
            cur.execute("INSERT INTO finding_rows VALUES (1)")
        wait_for("the late start", lambda: late.error is not None or late.result is not None)

    late = Background(
        lambda: run_idempotently(
            connect=late_connect, job_name=job, run_key=key, work=lambda run: None
        )
    )
    wait_for("the first attempt's lock", lambda: connects["late"] == 2)
    terminate_lock_session(dsn, job, key)  # its lock session ends before its start
    successor = Background(
        lambda: run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name=job, run_key=key, work=successor_work
        )
    )
    assert successor_works.wait(30), "the successor did not start its work"
    late_start.set()  # the lost attempt's start goes on now
    late.join()
    successor.join()
    return late, successor
