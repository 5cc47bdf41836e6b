"""The decision's row as one JSON text (advisory ``decide``, lease ``decide_lease``, and the
start's ``completed`` run): what comes back must be the ``job_runs`` row, whatever the session's
settings and whichever Python the package supports (pyproject: ``requires-python >=3.10``).

PostgreSQL writes a timestamp in JSON with its fraction of a second trimmed of trailing zeros
(``10:23:44.12+00:00``); Python 3.10's ``datetime.fromisoformat`` accepts only 3 or 6 digits
there, so on 3.10 about one completed key in four failed its no-op decision with ``ValueError``
(and a lease-mode rerun of a failed key left the lease it had just taken behind).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import types
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency import records
from airflow_idempotency.run_context import autocommit_connection
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools.postgres import PostgresServer, temporary_database
from support.db import rows

JOB = "decided-json"
# Python 3.10's fromisoformat: a fraction of a second of exactly 3 or 6 digits, nothing else
_PY310_FRACTION = re.compile(r"T\d\d:\d\d:\d\d(\.(\d{3}|\d{6}))?([+-]|Z|$)")


class _Py310Datetime(dt.datetime):
    """``datetime`` whose ``fromisoformat`` refuses what Python 3.10's refuses (a fraction of
    a second that is not 3 or 6 digits long), as 3.10.13 does: checked against it by hand."""

    @classmethod
    def fromisoformat(cls, date_string: str) -> Any:
        if "T" in date_string and not _PY310_FRACTION.search(date_string):
            raise ValueError(f"Invalid isoformat string: {date_string!r}")
        return dt.datetime.fromisoformat(date_string)


@pytest.fixture
def py310(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(**{k: getattr(dt, k) for k in dir(dt) if not k.startswith("__")})
    fake.datetime = _Py310Datetime
    monkeypatch.setattr(records, "dt", fake)


@pytest.fixture
def db(pg_server: PostgresServer) -> Iterator[str]:
    with temporary_database(pg_server, "adv32d_json") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
        yield dsn


def _run(dsn: str, key: str, mode: str, work: Any = None, **options: Any) -> Any:
    def done(ctx: RunContext) -> dict[str, Any]:
        return {"rows": 1}

    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=key,
        work=work or done,
        lock_mode=mode,
        **options,
    )


# timestamps whose JSON text has a fraction of 2, 1 and 5 digits
_TRIMMED = {
    "started_at": "2026-12-01 02:00:00.12+00",
    "completed_at": "2026-12-01 02:00:01.1+00",
    "updated_at": "2026-12-01 02:00:01.10001+00",
}


def _set_times(dsn: str, key: str) -> None:
    rows(
        dsn,
        "UPDATE idempotency.job_runs SET started_at = %(started_at)s, "
        "completed_at = CASE WHEN status = 'completed' THEN %(completed_at)s::timestamptz END, "
        "updated_at = %(updated_at)s WHERE job_name = %(job)s AND run_key = %(key)s",
        {**_TRIMMED, "job": JOB, "key": key},
    )


@pytest.mark.usefixtures("py310")
@pytest.mark.parametrize("mode", ["advisory", "lease"])
def test_a_completed_keys_no_op_parses_postgresqls_trimmed_fractions_as_python_3_10_does(
    db: str, mode: str
) -> None:
    key = f"2026-12-01-{mode}"
    assert _run(db, key, mode).outcome is RunOutcome.COMPLETED
    _set_times(db, key)
    again = _run(db, key, mode)
    assert again.outcome is RunOutcome.NOOP
    assert again.counts == {"rows": 1}


@pytest.mark.usefixtures("py310")
def test_a_lease_rerun_of_a_failed_key_parses_its_times_and_leaves_no_lease(db: str) -> None:
    key = "2026-12-02"

    def fail(ctx: RunContext) -> None:
        raise RuntimeError("the first attempt fails")

    with pytest.raises(RuntimeError):
        _run(db, key, "lease", fail)
    _set_times(db, key)
    assert _run(db, key, "lease").outcome is RunOutcome.COMPLETED
    assert rows(db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]


@pytest.mark.parametrize("zone", ["Asia/Kathmandu", "America/St_Johns", "UTC", "<-0345>+03:45"])
def test_the_decided_run_is_the_job_runs_row_whatever_the_databases_timezone(
    pg_server: PostgresServer, zone: str
) -> None:
    """Both modes' no-op record equals get_run's typed read, with the database's TimeZone set
    as an operator may set it (offsets of :45 and -3:30, a POSIX zone)."""
    with temporary_database(pg_server, "adv32d_tz") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            name = conn.info.dbname
            conn.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET timezone = {}").format(
                    psycopg.sql.Identifier(name), psycopg.sql.Literal(zone)
                )
            )
        seen: dict[str, Any] = {}
        for mode in ("advisory", "lease"):
            key = f"tz-{mode}"
            _run(dsn, key, mode)
            _set_times(dsn, key)

            def spy(job: str, run_key: str, row: dict[str, Any], mode: str = mode) -> Any:
                seen[mode] = records.decided_run(job, run_key, row)
                return seen[mode]

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("airflow_idempotency.run_steps.decided_run", spy)
                patch.setattr("airflow_idempotency.lease_run.decided_run", spy)
                assert _run(dsn, key, mode).outcome is RunOutcome.NOOP
            with psycopg.connect(dsn) as conn:
                typed = records.get_run(conn, "idempotency", JOB, key)
            assert seen[mode] == typed
            assert seen[mode].completed_at == dt.datetime(
                2026, 12, 1, 2, 0, 1, 100000, tzinfo=dt.timezone.utc
            )


@pytest.mark.parametrize("datestyle", ["SQL, DMY", "German", "Postgres, MDY"])
@pytest.mark.parametrize("mode", ["advisory", "lease"])
def test_a_run_completes_and_no_ops_whatever_the_databases_datestyle(
    pg_server: PostgresServer, mode: str, datestyle: str
) -> None:
    """A database (or role) whose DateStyle is not ISO, as a European operator may set it:
    psycopg reads no timestamptz then (NotImplementedError), yet the provider's own reads of
    timestamps must not fail a run whose work it committed (they did: NotImplementedError
    after the completion COMMITTED; fixed: the provider's own connections in DateStyle ISO)."""
    with temporary_database(pg_server, "adv32d_ds") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET datestyle = {}").format(
                    psycopg.sql.Identifier(conn.info.dbname), psycopg.sql.Literal(datestyle)
                )
            )
        first = _run(dsn, "2026-12-03", mode)
        assert first.outcome is RunOutcome.COMPLETED
        assert _run(dsn, "2026-12-03", mode).outcome is RunOutcome.NOOP
        forced = _run(dsn, "2026-12-03", mode, options=RunOptions(force=True))
        assert forced.outcome is RunOutcome.COMPLETED


def test_a_connection_of_the_provider_is_given_back_in_its_own_datestyle(db: str) -> None:
    """A pool's connection in DateStyle 'SQL, DMY' is ISO while the provider uses it, and
    goes back to the pool in its own DateStyle (the user's statements on it read it)."""
    with psycopg.connect(db, autocommit=False) as conn:
        conn.execute("SET datestyle = 'SQL, DMY'")
        conn.commit()
        with autocommit_connection(lambda: contextlib.nullcontext(conn)) as own:
            assert own.info.parameter_status("DateStyle") == "ISO, DMY"
            assert own.execute("SELECT now()").fetchone() is not None
        assert conn.info.parameter_status("DateStyle") == "SQL, DMY"
        assert not conn.autocommit


@pytest.mark.parametrize("command", [["runs"], ["show", JOB, "2026-12-05"]])
def test_the_cli_reads_runs_whatever_the_databases_datestyle(
    pg_server: PostgresServer, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`airflow-idempotency runs` and `show` crashed with NotImplementedError (a traceback,
    not an exit code) on a database in DateStyle 'SQL, DMY'."""
    from airflow_idempotency.cli import main

    with temporary_database(pg_server, "adv32d_cli") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET datestyle = 'SQL, DMY'").format(
                    psycopg.sql.Identifier(conn.info.dbname)
                )
            )
        _run(dsn, "2026-12-05", "advisory")
        assert main(["--dsn", dsn, *command]) == 0
        assert "2026-12-05" in capsys.readouterr().out
