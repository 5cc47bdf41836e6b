"""What the CLI says, as a new user meets it, against a real job database: a database without
the tables is named as such, an Airflow connection whose password has a space or a quote
works and its password is never printed, job names are never cut to look alike, a conf with a
run key is explained as the manual run it is."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_idempotency.cli import main
from airflow_idempotency.cli._database import redact
from devtools.airflow_env import airflow_connection_json
from support.cli import cli, record
from support.workers import TEST_DAGS

pytestmark = pytest.mark.both_airflow_lines

READ_ONLY = [
    ["runs"],
    ["runs", "--stale"],
    ["show", "j", "2026-10-01"],
    ["locks"],
    ["ledger"],
    ["ledger", "--remote", "finance_mail", "--key", "mail:1"],
    ["ledger", "resend", "finance_mail", "mail:1", "--reason", "x"],
    ["gaps", "j", "--from", "2026-10-01", "--to", "2026-10-02"],
    ["prune", "--attempts-older-than", "400d"],
]


@pytest.mark.parametrize("argv", READ_ONLY, ids=" ".join)
def test_a_database_without_the_tables_is_named_and_left_alone(
    argv: list[str], pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command that only reads, on a database no task ran against: exit 69, the message
    names the database and schema and how to create them (it said "cannot reach the job
    database: the connection is closed"), and nothing is created."""
    code, _, err = cli(capsys, *argv, "--dsn", pg_dsn)
    dbname = conninfo_to_dict(pg_dsn)["dbname"]
    assert code == 69, err
    assert f"database {dbname!r} has no bookkeeping tables in schema 'idempotency'" in err
    assert "airflow-idempotency migrate" in err and "connection is closed" not in err
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'")
        assert found.fetchone() == (0,)


PASSWORD = 'it\'s a "s3cr3t\\word" = x'


@pytest.fixture
def quoted_role(pg_dsn: str) -> Iterator[str]:
    """A role whose password has spaces, quotes, a backslash and '=', allowed to read the
    bookkeeping tables of the test's database; its DSN."""
    name = f"idem_cli_{uuid.uuid4().hex[:10]}"
    record(pg_dsn, "j", "2026-10-01")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(PASSWORD)
            )
        )
        admin.execute(
            sql.SQL(
                "GRANT USAGE ON SCHEMA idempotency TO {0};"
                " GRANT SELECT ON ALL TABLES IN SCHEMA idempotency TO {0}"
            ).format(sql.Identifier(name))
        )
    try:
        yield make_conninfo(pg_dsn, user=name, password=PASSWORD)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(name)))


def test_an_airflow_connection_whose_password_has_quotes_and_spaces_works(
    quoted_role: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runs --conn-id` of an Airflow connection whose password has a space, quotes, a
    backslash and '=': the runs are listed (the password was appended to the DSN unquoted,
    which broke every command and printed part of it); nothing printed holds it."""
    monkeypatch.setenv("AIRFLOW_CONN_QUOTED_JOBS", airflow_connection_json(quoted_role))
    monkeypatch.delenv("AIRFLOW_IDEMPOTENCY_DSN", raising=False)
    capsys.readouterr()
    code = main(["runs", "--conn-id", "quoted_jobs", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert [r["run_key"] for r in json.loads(out.out)] == ["2026-10-01"]
    assert "s3cr3t" not in out.err


def test_a_connection_error_never_prints_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A database that cannot be reached: exit 69 naming where, the password nowhere, even
    where libpq's own message would repeat the connection string."""
    dsn = make_conninfo("", host="127.0.0.1", port=1, password=PASSWORD, connect_timeout=3)
    code, _, err = cli(capsys, "runs", "--dsn", dsn)
    assert code == 69 and "cannot reach the job database" in err and "port 1" in err
    assert "s3cr3t" not in err
    assert redact(f"failed near {PASSWORD}", dsn) == "failed near ***"


@pytest.mark.parametrize("spelling", ["keywords", "uri"])
def test_a_password_inside_the_database_name_is_never_printed(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], spelling: str
) -> None:
    """A whole connection string pasted as the database name (by mistake: ``--dsn
    "dbname='host=db password=...'"``): the server answers that no such database exists, and
    PostgreSQL's message names the database, password and all. The password is masked there
    too, in either spelling of the pasted string."""
    inner = (
        make_conninfo("", host="db.example", user="u", password="s3cr3t-inner", dbname="jobs")
        if spelling == "keywords"
        else "postgresql://u:s3cr3t-inner@db.example/jobs"
    )
    dsn = make_conninfo(pg_dsn, dbname=inner)
    code, _, err = cli(capsys, "runs", "--dsn", dsn)
    assert code == 69 and "does not exist" in err, err
    assert "s3cr3t" not in err, err


@given(
    password=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1),
    nested=st.booleans(),
)
def test_redact_masks_a_password_wherever_the_connection_string_holds_it(
    password: str, nested: bool
) -> None:
    """Any password (quotes, spaces, '=', backslashes, non-ASCII), given as the connection's
    own or inside a connection string pasted as its database name: a message quoting the
    whole connection string, or the password alone, is printed without it."""
    inner = make_conninfo("", host="h", password=password)
    dsn = make_conninfo("", host="h", dbname=inner) if nested else inner
    for message in (f"failed: {dsn}", f"failed near {password}!"):
        assert password not in redact(message, dsn)


def test_job_names_that_differ_at_their_end_are_printed_whole(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs` as a table: three long job names with one beginning are each printed whole on
    one line (they were cut to the same "finalize_invoices.export_invoices_to_…")."""
    jobs = [f"finalize_invoices.export_invoices_to_the_accounting_service_{r}" for r in "abc"]
    for job in jobs:
        record(pg_dsn, job, "2026-10-01")
    capsys.readouterr()
    assert main(["runs", "--dsn", pg_dsn]) == 0
    out = capsys.readouterr().out
    assert all(job in out for job in jobs), out
    assert "…" not in out


def test_explain_takes_a_conf_with_a_run_key_as_a_manual_run(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`explain --conf '{"run_key": ...}'` without --run-type explains the manual run that
    conf belongs to (the key as given, exit 0); it assumed a scheduled run and refused."""
    code, found, err = cli(
        capsys, "explain", "core_slow_job", "--conf", '{"run_key": "2026-10-01"}',
        "--dags-folder", str(TEST_DAGS),
    )  # fmt: skip
    assert code == 0, err
    assert [e["run_key"] for e in found] == ["2026-10-01"]
    capsys.readouterr()
    argv = ["explain", "core_slow_job", "--conf", '{"run_key": "2026-10-01"}']
    assert main([*argv, "--dags-folder", str(TEST_DAGS)]) == 0
    assert "core_slow_job: manual run" in capsys.readouterr().out


FULLWIDTH_DAY = "\uff12\uff10\uff12\uff16-\uff11\uff10-\uff10\uff11"


@pytest.mark.parametrize(
    "argv",
    [["show", "j", FULLWIDTH_DAY], ["reset", "j", FULLWIDTH_DAY, "--reason", "x"]],
    ids=["show", "reset"],
)
def test_a_key_typed_in_other_digits_is_pointed_at_its_one_spelling(
    argv: list[str], pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """2026-10-01 completed; `show j` of it in fullwidth digits (an input method's) said only "no
    run recorded", as if the day never ran (adversary, issue 31). The message names the
    key's one spelling, '2026-10-01', so the operator looks there; nothing is written."""
    record(pg_dsn, "j", "2026-10-01")
    code, _, err = cli(capsys, *argv, "--dsn", pg_dsn)
    assert code == 1, err
    assert "one spelling is '2026-10-01'" in err, err
