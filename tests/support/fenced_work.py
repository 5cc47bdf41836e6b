"""What the fence tests' work writes and reads: the `public.facts` table; a recording remote.

The ``facts`` fixture (tests/conftest.py) creates the table; :func:`writer` is work that
writes one row of it inside ``run.transaction()``; :func:`written` and :func:`outcomes` read
what committed and how the attempts ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from airflow_idempotency.ledger.senders import BlockingEffectSender, Confirmation, Effect
from airflow_idempotency.runner import RunContext
from support.db import rows

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
