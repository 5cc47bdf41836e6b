"""Retention: old attempt rows deleted (``airflow-idempotency prune``).

Never what keeps a rerun a no-op or a confirmed effect from being sent again.
"""

from __future__ import annotations

import datetime as dt
import re

import psycopg

from airflow_idempotency._sql import query_rows
from airflow_idempotency._transactions import bounded_transaction
from airflow_idempotency.exceptions import InvalidInputError

# Retention beyond a century is no retention: and an age must leave a cut-off date that
# exists (``now - age``), which an unbounded number of days would not.
MAX_AGE_DAYS = 36_500
_AGE = re.compile(r"([0-9]+)d")  # ASCII digits: str.isdigit() also takes fullwidth ones


def parse_age(text: str) -> dt.timedelta:
    """``400d`` -> 400 days (whole days only: retention is a matter of days), from 1 day to
    :data:`MAX_AGE_DAYS`."""
    match = _AGE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise InvalidInputError(f"{text!r} is not an age in days: write it like 400d")
    days = int(match[1]) if len(match[1]) <= len(str(MAX_AGE_DAYS)) else MAX_AGE_DAYS + 1
    if not 1 <= days <= MAX_AGE_DAYS:
        raise InvalidInputError(
            f"{text!r}: an age from 1d to {MAX_AGE_DAYS}d (a hundred years), e.g. 400d"
        )
    return dt.timedelta(days=days)


def prune_attempts(
    conn: psycopg.Connection,
    schema: str,
    older_than: dt.timedelta,
    *,
    dry_run: bool = False,
    batch_size: int = 10_000,
) -> int:
    """Delete attempt rows older than ``older_than`` of completed keys, in batches of
    ``batch_size`` (each its own transaction); return how many were (or would be) deleted.

    Kept forever: every ``job_runs`` row (a completed key is what makes a rerun a year later
    a no-op), the attempt that completed each key, attempts of keys not completed, the
    outbound ledger (what keeps a confirmed effect from being sent again).
    """
    if batch_size < 1:
        raise InvalidInputError("batch_size must be >= 1")
    before = dt.datetime.now(dt.timezone.utc) - older_than
    total, after = 0, 0
    while True:
        with bounded_transaction(conn, schema):
            (row,) = query_rows(
                conn,
                "prune_attempts",
                schema,
                {"after": after, "before": before, "batch": batch_size, "dry_run": dry_run},
            )
        total += int(row["selected"])
        if row["selected"] < batch_size:
            return total
        after = row["last_id"]
