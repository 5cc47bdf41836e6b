"""The invoice example's world as the tests get it (the ``invoicing`` fixture): ``InvoicingEnv``.

A job database seeded with orders, the accounting service running as its own process, and
the Airflow connections that reach both.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg

from devtools.accounting import AccountingService
from devtools.airflow_env import connection_env
from devtools.invariants import date_state


class InvoicingEnv:
    """A job database seeded with orders, the accounting service, and Airflow connections."""

    def __init__(self, dsn: str, service: AccountingService) -> None:
        self.dsn = dsn
        self.service = service

    def seed(self, start: str, end: str | None = None, orders: int = 120, seed: int = 7) -> int:
        from invoicing.seed import seed_orders

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return seed_orders(
                conn,
                dt.date.fromisoformat(start),
                dt.date.fromisoformat(end or start),
                orders,
                seed,
            )

    def connection_env(self, **extra: Any) -> dict[str, str]:
        """AIRFLOW_CONN_* variables for the job DB and the accounting service."""
        return connection_env(self.dsn, self.service.url, **extra)

    def state(self, business_date: str) -> dict[str, Any]:
        """Everything a rerun must leave identical, for row-by-row comparisons."""
        return date_state(self.dsn, business_date)
