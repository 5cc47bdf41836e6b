"""The statements the provider sends stay cheap for its client (issue 32, goal 4): every
named query of sql/ is sent without its header comments and fits psycopg's cache of parsed
statements, so psycopg parses it once per process, not on every execution."""

from __future__ import annotations

import pytest
from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

from airflow_idempotency._sql import _queries, query

FILES = ("queries.sql", "migrator.sql")


@pytest.mark.parametrize("file", FILES)
def test_every_query_fits_psycopgs_statement_cache(file: str) -> None:
    too_long = {
        name: len(query(name, "idempotency", file).encode())
        for name in _queries(file)
        if len(query(name, "idempotency", file).encode()) > MAX_CACHED_STATEMENT_LENGTH
    }
    assert not too_long, (
        f"parsed again by psycopg on every execution (longer than {MAX_CACHED_STATEMENT_LENGTH} "
        f"bytes): {too_long}; shorten them or split them"
    )


def test_the_header_comments_stay_in_the_file_and_the_statement_is_whole() -> None:
    text = _queries("queries.sql")["start_attempt"]
    sent = query("start_attempt", "idempotency")
    assert text.startswith("--") and not sent.startswith("--")
    body = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    assert [line for line in sent.splitlines() if not line.lstrip().startswith("--")] == [
        line.replace("{schema}", '"idempotency"') for line in body
    ]
