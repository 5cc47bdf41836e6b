"""The job database's connections (airflow_idempotency.connection): the same psycopg
arguments as IdempotencyHook builds, opened without importing the Postgres provider's hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest

from airflow_idempotency.compat import AIRFLOW_NOT_FOUND
from airflow_idempotency.connection import JobDatabase
from airflow_idempotency.hook import IdempotencyHook
from devtools import airflow_env


def test_the_same_arguments_as_the_hook(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> None:
    """libpq extras pass, the provider's own extras do not, our defaults apply unless the
    extra sets them; and the session opens."""
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    extra = {
        "sslmode": "disable",
        "application_name": "nightly",
        "keepalives_idle": 7,
        "cursor": "dictcursor",
        "sqlalchemy_scheme": "postgresql",
    }
    uri = {
        "conn_type": "postgres",
        "host": info["host"],
        "port": int(str(info.get("port", 5432))),
        "login": info.get("user"),
        "schema": info["dbname"],
        "extra": extra,
    }
    monkeypatch.setenv("AIRFLOW_CONN_JOBS_WITH_EXTRAS", json.dumps(uri))
    database = JobDatabase("jobs_with_extras")
    kwargs = database.connection_kwargs()
    assert kwargs == IdempotencyHook(postgres_conn_id="jobs_with_extras").connection_kwargs()
    assert kwargs["application_name"] == "nightly" and kwargs["keepalives_idle"] == 7
    assert kwargs["connect_timeout"] == 10 and "keepalives_interval" in kwargs
    assert not {"cursor", "sqlalchemy_scheme"} & set(kwargs)
    with database.new_connection() as conn:
        row = conn.execute("SELECT current_setting('application_name')").fetchone()
    assert row == ("nightly",)


def test_an_iam_connection_gets_a_fresh_token_from_the_postgres_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extra ``iam``: login, password and port come from ``PostgresHook.get_iam_token``
    (AWS is out of reach here, so the token call is the one thing replaced), a new token
    for every session, the same for the hook and JobDatabase; the provider's extras stay out."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    tokens = iter(range(1, 100))

    def get_iam_token(self: PostgresHook, conn: object) -> tuple[str, str, int]:
        return "iam_user", f"token-{next(tokens)}", 5439

    monkeypatch.setattr(PostgresHook, "get_iam_token", get_iam_token)
    uri = {
        "conn_type": "postgres",
        "host": "db.example.com",
        "login": "someone",
        "schema": "jobs",
        "extra": {"iam": True, "aws_conn_id": "aws_default", "sslmode": "require"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_JOBS_IAM", json.dumps(uri))
    database = JobDatabase("jobs_iam")
    first, second = database.connection_kwargs(), database.connection_kwargs()
    hook = IdempotencyHook(postgres_conn_id="jobs_iam").connection_kwargs()
    assert (first["user"], first["password"], first["port"]) == ("iam_user", "token-1", 5439)
    assert second["password"] == "token-2" and hook["password"] == "token-3"
    assert {k: v for k, v in first.items() if k != "password"} == {
        k: v for k, v in hook.items() if k != "password"
    }
    assert first["sslmode"] == "require" and not {"iam", "aws_conn_id"} & set(first)
    assert database.connection.login == "someone", "the looked-up connection is left as it was"


def test_an_unknown_connection_id_is_airflows_not_found_error() -> None:
    with pytest.raises(Exception, match="isn't defined") as raised:
        JobDatabase("no_such_connection_anywhere").connection  # noqa: B018
    assert isinstance(raised.value, AIRFLOW_NOT_FOUND)  # what the operator and the view catch


_OPERATOR_CONNECTS = """
import json, sys
from airflow_idempotency import IdempotentRunOperator
op = IdempotentRunOperator(task_id="t", python_callable=lambda run: None)
op._check_connection()
with op.job_database.new_connection() as conn:
    conn.execute("SELECT 1").fetchone()
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("airflow.providers.postgres.hooks",
      "psycopg2", "sqlparse")))))
"""


def test_the_operator_connects_without_the_postgres_providers_hook(pg_dsn: str) -> None:
    """What a task process pays for its connections: the Airflow connection lookup and
    psycopg, not the provider hook's imports (SQLAlchemy, psycopg2, sqlparse: ~60 ms)."""
    env = {
        **os.environ,
        **airflow_env.connection_env(pg_dsn),
    }
    done = subprocess.run(
        [sys.executable, "-c", _OPERATOR_CONNECTS],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
