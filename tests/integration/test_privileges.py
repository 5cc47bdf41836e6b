"""A job database role without the privileges it needs is refused at once, with both ways out;
the three set-ups docs/connection.md gives work, with the statements written there.

Against a real server: a role of the test's own, without CREATE on the test's database (as
any role that does not own it). docs/connection.md's SQL blocks are run as written, their
role and database names replaced by the test's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_idempotency.exceptions import MissingPrivilegeError
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from airflow_idempotency.schema import ensure_schema
from support import ROOT

PAGE = (ROOT / "docs" / "connection.md").read_text(encoding="utf-8")
PASSWORD = "not-a-secret"


def doc_block(language: str, first_line: str) -> str:
    """The ```language block of docs/connection.md whose first line starts so."""
    for body in re.findall(rf"^```{language}\n(.*?)^```$", PAGE, re.M | re.S):
        if body.startswith(first_line):
            return str(body)
    raise AssertionError(f"docs/connection.md has no {language} block starting {first_line!r}")


def as_written(block: str, role: str, dbname: str) -> list[str]:
    """The statements of a block of the page, its role and database replaced by the test's."""
    text = "\n".join(line for line in block.splitlines() if not line.startswith("--"))
    text = re.sub(r"\bjobs\b", dbname, re.sub(r"\bairflow_jobs\b", role, text))
    return [statement.strip() for statement in text.split(";\n") if statement.strip()]


class Role:
    """A login role without privileges on the test's database beyond CONNECT."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.name = f"idem_role_{uuid.uuid4().hex[:10]}"
        self.dbname = str(conninfo_to_dict(admin_dsn)["dbname"])
        self.dsn = make_conninfo(admin_dsn, user=self.name, password=PASSWORD)

    def admin(self, *statements: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # the page's own DDL, trusted test input

    def run(self, work_calls: list[str] | None = None) -> Any:
        calls = work_calls if work_calls is not None else []

        def work(run: RunContext) -> dict[str, int]:
            calls.append(run.run_key)
            return {"done": 1}

        return run_idempotently(
            connect=lambda: psycopg.connect(self.dsn),
            job_name="privileges.job",
            run_key="2026-10-01",
            work=work,
        )


@pytest.fixture
def role(pg_dsn: str) -> Iterator[Role]:
    made = Role(pg_dsn)
    made.admin(f"CREATE ROLE {made.name} LOGIN PASSWORD '{PASSWORD}'")
    try:
        yield made
    finally:
        made.admin(
            "DROP SCHEMA IF EXISTS idempotency CASCADE",
            f"DROP OWNED BY {made.name}",
            f"DROP ROLE {made.name}",
        )


def _schema_exists(role: Role) -> bool:
    with psycopg.connect(role.admin_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'")
        return row.fetchone() == (1,)


def test_a_role_without_create_is_refused_at_once_naming_both_ways_out(role: Role) -> None:
    """The first run of a role that may not create the schema raises MissingPrivilegeError
    (a ConfigurationError: no retry) naming the role, the database, GRANT CREATE, CREATE
    SCHEMA ... AUTHORIZATION and a DBA's `airflow-idempotency migrate`; nothing is written."""
    calls: list[str] = []
    with pytest.raises(MissingPrivilegeError) as refused:
        role.run(calls)
    message = str(refused.value)
    assert f"role {role.name!r} may not create or migrate the bookkeeping tables" in message
    assert f'GRANT CREATE ON DATABASE "{role.dbname}" TO "{role.name}";' in message
    assert f'CREATE SCHEMA "idempotency" AUTHORIZATION "{role.name}";' in message
    assert "airflow-idempotency migrate --dsn DBA_DSN --schema idempotency" in message
    assert "permission denied for database" in message
    assert PASSWORD not in message
    assert calls == [] and not _schema_exists(role)


def test_migrate_of_a_role_without_create_says_what_to_do_without_a_traceback(
    role: Role, capsys: pytest.CaptureFixture[str]
) -> None:
    """`airflow-idempotency migrate` as a role that may not create the schema: exit 69 and the
    refusal's message (the statements for a DBA), no traceback (it ended in 17 lines of one),
    no password; nothing is created."""
    from airflow_idempotency.cli import main

    capsys.readouterr()
    assert main(["migrate", "--dsn", role.dsn]) == 69
    err = capsys.readouterr().err
    assert err.startswith(f"error: role {role.name!r} may not create or migrate the bookkeeping")
    assert "airflow-idempotency migrate --dsn DBA_DSN" in err and "Traceback" not in err
    assert PASSWORD not in err and not _schema_exists(role)


def test_migrate_of_a_role_without_usage_on_an_existing_schema_says_so_without_a_traceback(
    role: Role, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DBA migrated the schema and granted nothing yet: `migrate` as the role read the
    version it starts from unguarded and ended in a traceback, exit 1 (adversary, issue 31).
    Exit 69, the refusal's message naming the role and the grants, no password."""
    from airflow_idempotency.cli import main

    with psycopg.connect(role.admin_dsn, autocommit=True) as conn:
        ensure_schema(conn, "idempotency")
    capsys.readouterr()
    assert main(["migrate", "--dsn", role.dsn]) == 69
    err = capsys.readouterr().err
    assert err.startswith(f"error: role {role.name!r} may not use the bookkeeping tables"), err
    assert 'GRANT USAGE ON SCHEMA "idempotency"' in err and "Traceback" not in err
    assert PASSWORD not in err


def test_a_schema_the_dba_created_for_the_role_is_enough(role: Role) -> None:
    """docs/connection.md's CREATE SCHEMA ... AUTHORIZATION: the role, without CREATE on the
    database, creates and migrates its tables itself, runs the key, then no-ops."""
    role.admin(*as_written(doc_block("sql", "-- as a DBA: the schema"), role.name, role.dbname))
    assert role.run().outcome is RunOutcome.COMPLETED
    assert role.run().outcome is RunOutcome.NOOP


def test_a_dba_run_migrate_and_the_pages_grants_are_enough(role: Role) -> None:
    """The DBA path as the page writes it: `airflow-idempotency migrate` as the admin, the
    page's GRANTs; then the role, with no DDL privilege, runs the key and no-ops. Without
    the grants the role is refused as a user of the tables, the message naming what it
    lacks and both ways out."""
    migrate = doc_block("bash", "airflow-idempotency migrate --dsn")
    assert migrate.split("--dsn")[0].split() == ["airflow-idempotency", "migrate"]
    done = subprocess.run(
        [sys.executable, "-m", "airflow_idempotency.cli", "migrate", "--dsn", role.admin_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(MissingPrivilegeError) as refused:
        role.run()
    message = str(refused.value)
    assert f"role {role.name!r} may not use the bookkeeping tables" in message
    assert f'GRANT USAGE ON SCHEMA "idempotency" TO "{role.name}";' in message
    assert "airflow-idempotency migrate" in message

    grants = doc_block("sql", "-- as the DBA who ran migrate")
    statements = as_written(grants, role.name, role.dbname)
    role.admin(statements[0])  # USAGE only: every table still refuses
    with pytest.raises(MissingPrivilegeError, match=r"It lacks .*INSERT on table job_run_attempts"):
        role.run()
    role.admin(*statements[1:])
    assert role.run().outcome is RunOutcome.COMPLETED
    assert role.run().outcome is RunOutcome.NOOP


def test_the_works_own_missing_privilege_is_not_blamed_on_the_bookkeeping(role: Role) -> None:
    """A work refused on a table of its own raises PostgreSQL's error as it is: the
    bookkeeping tables are fine, and the message would point the wrong way."""
    role.admin(
        *as_written(doc_block("sql", "-- as a DBA: the schema"), role.name, role.dbname),
        "CREATE TABLE public.not_theirs (x int)",
    )

    def work(run: Any) -> None:
        with run.transaction() as cur:
            cur.execute("INSERT INTO public.not_theirs VALUES (1)")

    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not_theirs"):
        run_idempotently(
            connect=lambda: psycopg.connect(role.dsn),
            job_name="privileges.job",
            run_key="2026-10-01",
            work=work,
        )
    role.admin("DROP TABLE public.not_theirs")


@pytest.mark.both_airflow_lines
def test_the_task_fails_without_a_retry(
    role: Role, airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Airflow (dag.test): a task with retries=3 whose role may not create the schema
    fails in its first try, its log's error the refusal (no retry is burnt)."""
    import pendulum
    from airflow.providers.common.compat.sdk import DAG

    from airflow_idempotency import IdempotentRunOperator
    from devtools.airflow_env import airflow_connection_json
    from support.dag_runs import FAILED, run_dag, utc

    monkeypatch.setenv("AIRFLOW_CONN_NO_CREATE", airflow_connection_json(role.dsn))
    with DAG(
        "privileges_no_create",
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    ) as dag:
        IdempotentRunOperator(
            task_id="work",
            python_callable=lambda run: None,
            postgres_conn_id="no_create",
            retries=3,
        )
    dag_run = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    (ti,) = dag_run.get_task_instances()
    assert dag_run.state == FAILED and ti.try_number == 1
    assert not _schema_exists(role)


def test_a_read_only_role_is_not_told_a_false_client_by_locks(
    role: Role, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/connection.md: a read-only role (USAGE, SELECT) may run `locks`. PostgreSQL hides
    another role's client address from it (NULL, as for a Unix socket): `locks` must not
    report the holder as connected by 'local socket' when it is not."""
    from support.cli import cli
    from support.locks import key_held

    record_tables = subprocess.run(
        [sys.executable, "-m", "airflow_idempotency.cli", "migrate", "--dsn", pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert record_tables.returncode == 0, record_tables.stderr
    role.admin(
        f"GRANT USAGE ON SCHEMA idempotency TO {role.name}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA idempotency TO {role.name}",
    )
    with key_held(pg_dsn, "privileges.held", "2026-10-01"):
        _, (seen_by_owner,), _ = cli(capsys, "locks", "--dsn", pg_dsn)
        code, (seen_read_only,), _ = cli(capsys, "locks", "--dsn", role.dsn)
    assert code == 0 and seen_read_only["run_key"] == "2026-10-01"
    if seen_by_owner["client"] != "local socket":  # a TCP connection: hidden, and said so
        assert seen_read_only["client"] == "not shown to this role", seen_read_only
