"""Load the SQL shipped in ``sql/``: named queries and numbered migrations."""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any, NamedTuple

from psycopg import sql
from psycopg.rows import dict_row

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    import psycopg

_NAME = re.compile(r"^-- name: (?P<name>\w+)\s*$", re.MULTILINE)


def named_queries(text: str) -> dict[str, str]:
    """Split SQL text into statements by their ``-- name: NAME`` header lines."""
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def _queries(file: str) -> dict[str, str]:
    text = files("airflow_idempotency").joinpath("sql", file).read_text(encoding="utf-8")
    return named_queries(text)


@cache
def query(name: str, schema: str, file: str = "queries.sql") -> str:
    """The statement called ``name`` in sql/queries.sql (or sql/``file``), its names qualified
    with ``schema``.

    ``{schema}`` in the file becomes the quoted identifier (psycopg.sql does the quoting;
    callers validate the name first). Cached: composed once per statement and schema.
    """
    try:
        text = _queries(file)[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in sql/{file}") from None
    return sql.SQL(_without_header(text)).format(schema=sql.Identifier(schema)).as_string()


def _without_header(text: str) -> str:
    """``text`` without the comment lines before its first statement line: they document the
    query in the file and need not travel with it. Shorter, a statement stays within psycopg's
    cache of parsed statements (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``, 4096
    bytes): a longer one is parsed again on every execution (start_attempt's 4872 bytes
    with its header cost a new key about 0.1 ms of CPU; issue 32, goal 4)."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if not line.lstrip().startswith("--")), 0)
    return "\n".join(lines[first:])


def query_rows(
    conn: psycopg.Connection, name: str, schema: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The rows of the statement called ``name`` (see :func:`query`), as dicts."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query(name, schema), params).fetchall()


def query_row(
    conn: psycopg.Connection, name: str, schema: str, params: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The first row of the statement called ``name`` as a dict, or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query(name, schema), params).fetchone()


@cache
def _migration_files() -> tuple[tuple[int, Traversable], ...]:
    folder = files("airflow_idempotency").joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    found.sort(key=lambda item: item[0])
    versions = [v for v, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return tuple(found)


def latest_migration() -> int:
    """The number of the newest file in sql/migrations/ (without reading the files)."""
    return _migration_files()[-1][0]


class Migration(NamedTuple):
    """One file of sql/migrations/: its number, its file name and its statements."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 of the file's text (newlines as read: ``\\n``), hex: what the database
        records when it applies the file, and compares with on every check."""
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


@cache
def migrations() -> tuple[Migration, ...]:
    """Each file in sql/migrations/, in order of its number."""
    return tuple(
        Migration(version, entry.name, entry.read_text(encoding="utf-8"))
        for version, entry in _migration_files()
    )
