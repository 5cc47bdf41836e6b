"""argparse types for the CLI's values, each refusing what it cannot take (exit 2).

A refusal is a message argparse prints after the option's name (``argument --limit: ...``),
exit 2, before anything connects.

A refused value is quoted back (``repr``: a control character shows as ``\\x00``), but for
a DSN: it may hold a password.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import unicodedata
from collections.abc import Callable

import psycopg
from psycopg.conninfo import conninfo_to_dict

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.schema import validate_schema_name

# The longest text an option takes: a job name, a run key, an idempotency key are at most
# 200 characters (run_key.MAX_KEY_LENGTH) and are stored as text; a reason is a sentence.
MAX_TEXT = 1000
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: int() also reads Arabic-Indic digits, or "1_000"


def count(maximum: int) -> Callable[[str], int]:
    """argparse type: a whole number from 1 to ``maximum``, written with ASCII digits."""

    def parse(value: str) -> int:
        if _DIGITS.fullmatch(value) and 1 <= int(value) <= maximum:
            return int(value)
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a whole number from 1 to {maximum}, e.g. 50"
        )

    parse.__name__ = "count"
    return parse


def text(value: str) -> str:
    """argparse type: text PostgreSQL can store and a terminal shows: not empty or blank, no
    control character (a NUL byte, a newline) and no undecodable byte (a surrogate), at most
    :data:`MAX_TEXT` characters."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r} is empty: give the text")
    if len(value) > MAX_TEXT:
        raise argparse.ArgumentTypeError(f"is {len(value)} characters long; at most {MAX_TEXT}")
    bad = sorted({c for c in value if unicodedata.category(c) in ("Cc", "Cs")})
    if bad:
        raise argparse.ArgumentTypeError(
            f"{value!r} contains control characters or bytes that are not UTF-8 "
            f"({', '.join(repr(c) for c in bad)}): write the text without them"
        )
    return value


def dsn(value: str) -> str:
    """argparse type: a libpq connection string (``host=db dbname=jobs``) or URI
    (``postgresql://user@db/jobs``), as psycopg reads it; never quoted back."""
    check_dsn(value, "the value")
    return value


def check_dsn(value: str, what: str) -> None:
    """Raise ``argparse.ArgumentTypeError`` unless ``value`` is a connection string psycopg
    reads; the message names ``what`` and never repeats the value (it may hold a password)."""
    try:
        conninfo_to_dict(value)
    except (psycopg.Error, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{what} is not a libpq connection string or URI (not shown: it may hold a "
            "password), e.g. 'host=db dbname=jobs user=airflow' or "
            "postgresql://airflow@db/jobs; quote a value with a space or a quote in it, "
            "with a backslash before a quote: password='it\\'s secret'"
        ) from None


def schema_name(value: str) -> str:
    """argparse type: a bookkeeping schema name (lower-case letters, digits, underscores)."""
    try:
        return validate_schema_name(value)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def business_date(value: str) -> str:
    """argparse type: a real calendar date written YYYY-MM-DD."""
    try:
        if len(value) == 10 and value.isascii():
            return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r} is not a date in the format YYYY-MM-DD")


def instant(value: str) -> dt.datetime:
    """argparse type: an ISO date or date-time; a bare date is midnight, a naive time UTC."""
    try:
        if not value.isascii():
            raise ValueError(value)
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a date or date-time, e.g. 2026-10-02 or 2026-10-02T01:00:00+00:00"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def age_in_days(value: str) -> dt.timedelta:
    """argparse type: an age in whole days, ``400d`` (:func:`retention.parse_age`)."""
    from airflow_idempotency import retention

    try:
        return retention.parse_age(value)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def http_url(value: str) -> str:
    """argparse type: the http(s) URL of a server (``http://airflow:8080``), without
    credentials, a query or a fragment (credentials go in the environment, not the process
    list); never quoted back (it may hold a password)."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(unicodedata.category(c) in ("Cc", "Cs", "Zs") for c in value)
    ):
        raise argparse.ArgumentTypeError(
            "is not the http(s) URL of a server (not shown), e.g. http://airflow:8080"
        )
    if parts.username or parts.password or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            "holds credentials, a query or a fragment (not shown): give the server's address "
            "only, e.g. http://airflow:8080; credentials go in the environment (docs/adopt.md)"
        )
    return value
