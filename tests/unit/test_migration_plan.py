"""The migration decision (migrator.plan), for every record a database can hold.

Given the files a release ships and the rows ``schema_version`` holds: the files past the
newest applied one are run, rows without a checksum are adopted, and a record that disagrees
with the files (another name, another checksum, a hole) or is newer is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_idempotency._sql import Migration, migrations
from airflow_idempotency.exceptions import (
    ConfigurationError,
    MigrationMismatchError,
    SchemaTooNewError,
)
from airflow_idempotency.migrator import Applied, plan

WHERE = "schema 'idempotency' of database 'db'"


def shipped(count: int) -> tuple[Migration, ...]:
    return tuple(
        Migration(v, f"{v:04d}_step_{v}.sql", f"CREATE TABLE t{v} ();\n")
        for v in range(1, count + 1)
    )


def record(files: tuple[Migration, ...], checksummed: list[bool]) -> list[Applied]:
    return [
        Applied(m.version, m.name, m.checksum if known else None)
        for m, known in zip(files, checksummed, strict=False)
    ]


@given(
    count=st.integers(1, 12),
    data=st.data(),
)
def test_a_matching_record_runs_the_rest_and_adopts_rows_without_checksum(
    count: int, data: st.DataObject
) -> None:
    """A record that is a prefix of the release's files: the rest is pending, in order, and
    exactly the rows without a checksum are adopted."""
    files = shipped(count)
    applied_count = data.draw(st.integers(0, count))
    known = data.draw(st.lists(st.booleans(), min_size=applied_count, max_size=applied_count))
    result = plan(record(files, known), files, WHERE)
    assert result.pending == files[applied_count:]
    assert result.adopt == tuple(m for m, k in zip(files, known, strict=False) if not k)


@given(count=st.integers(1, 10), extra=st.integers(1, 5), data=st.data())
def test_a_newer_record_is_refused_as_too_new(count: int, extra: int, data: st.DataObject) -> None:
    """A record with files past the release's newest (a newer release migrated it): a
    SchemaTooNewError with both versions, which is not a ConfigurationError (retryable)."""
    newer = shipped(count + extra)
    known = data.draw(st.lists(st.booleans(), min_size=count + extra, max_size=count + extra))
    with pytest.raises(SchemaTooNewError) as raised:
        plan(record(newer, known), shipped(count), WHERE)
    assert (raised.value.version, raised.value.expected) == (count + extra, count)
    assert not isinstance(raised.value, ConfigurationError)


@given(count=st.integers(1, 10), data=st.data())
def test_a_record_that_disagrees_with_the_files_is_refused(count: int, data: st.DataObject) -> None:
    """Another name or checksum at any applied number, or a missing number, is refused with
    MigrationMismatchError, whatever else the record holds (even a newer release's rows)."""
    files = shipped(count)
    applied_count = data.draw(st.integers(1, count))
    extra = data.draw(st.integers(0, 2))
    rows = record(shipped(applied_count + extra), [True] * (applied_count + extra))
    at = data.draw(st.integers(0, applied_count - 1))
    change = data.draw(st.sampled_from(["name", "checksum", "hole"]))
    if change == "hole":
        del rows[at]
        if at == len(rows):  # removing the newest is not a hole: the record is just shorter
            return
    else:
        rows[at] = (
            rows[at]._replace(name=rows[at].name + "x")
            if change == "name"
            else rows[at]._replace(checksum="0")
        )
    with pytest.raises(MigrationMismatchError):
        plan(rows, files, WHERE)


def test_the_shipped_files_are_numbered_and_checksummed() -> None:
    """This release's files: numbered 1..n, file names NNNN_name.sql, checksum = SHA-256."""
    import hashlib
    import re

    files = migrations()
    assert [m.version for m in files] == list(range(1, len(files) + 1))
    for m in files:
        assert re.fullmatch(rf"{m.version:04d}_\w+\.sql", m.name)
        assert m.checksum == hashlib.sha256(m.sql.encode()).hexdigest()
