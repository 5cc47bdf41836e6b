"""The job database as the tests read it: one statement's rows, from a connection of its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

Params = Sequence[Any] | Mapping[str, Any] | None


def rows(dsn: str, sql: str, params: Params = None) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` (with ``params``), run alone on a new autocommit connection; a
    statement that returns none (an INSERT, a DDL) gives ``[]``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []
