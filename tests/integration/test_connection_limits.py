"""A run refused a connection by a limit other than the server's last slot (adversary, issue
30): a role's or a database's CONNECTION LIMIT, and the slots PostgreSQL reserves for
superusers, which is what a non-superuser role meets at max_connections. Each is the same
sizing rule as "too many clients already" (tests/faults/test_faults_overload.py): a
PoolExhaustedError naming it, never a raw psycopg error, and the attempt recorded when it had
a connection to record it on."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_idempotency import run_idempotently
from airflow_idempotency.exceptions import ConnectionWaitError, PoolExhaustedError
from airflow_idempotency.locks import pooler_refusal
from support.db import rows


@pytest.fixture
def limited_role(pg_dsn: str) -> Iterator[str]:
    """The test database as a role (not a superuser) of CONNECTION LIMIT 1: a run's lock
    connection gets the one slot, its work's connection is refused."""
    role = f"adv_limited_{uuid.uuid4().hex[:8]}"
    dbname = conninfo_to_dict(pg_dsn)["dbname"]
    rows(pg_dsn, f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1')
    rows(pg_dsn, f'GRANT ALL ON DATABASE "{dbname}" TO "{role}"')
    rows(pg_dsn, f'GRANT ALL ON SCHEMA public TO "{role}"')
    run_idempotently(  # the bookkeeping schema, made as the test's superuser
        connect=lambda: psycopg.connect(pg_dsn), job_name="setup", run_key="k", work=lambda r: None
    )
    rows(pg_dsn, f'GRANT ALL ON SCHEMA idempotency TO "{role}"')
    rows(pg_dsn, f'GRANT ALL ON ALL TABLES IN SCHEMA idempotency TO "{role}"')
    rows(pg_dsn, f'GRANT ALL ON ALL SEQUENCES IN SCHEMA idempotency TO "{role}"')
    try:
        yield make_conninfo(pg_dsn, user=role)
    finally:
        rows(pg_dsn, f'DROP OWNED BY "{role}"')
        rows(pg_dsn, f'DROP ROLE "{role}"')


def test_a_roles_connection_limit_names_the_sizing_rule(limited_role: str, pg_dsn: str) -> None:
    """The work's connection refused by the role's CONNECTION LIMIT: PoolExhaustedError naming
    the sizing rule, the attempt recorded failed with it."""
    with pytest.raises(PoolExhaustedError, match=r"docs/deploying\.md"):
        run_idempotently(
            connect=lambda: psycopg.connect(limited_role), job_name="job", run_key="2026-10-01",
            work=lambda run: {"done": 1},
        )  # fmt: skip
    recorded = rows(
        pg_dsn, "SELECT outcome, error FROM idempotency.job_run_attempts WHERE job_name = 'job'"
    )
    assert [outcome for outcome, _ in recorded] == ["failed"]
    assert "max_connections" in recorded[0][1]


@pytest.mark.parametrize(
    "said",
    [
        'FATAL:  too many connections for role "airflow"',
        'FATAL:  too many connections for database "jobs"',
        "FATAL:  remaining connection slots are reserved for non-replication superuser "
        "connections",  # PostgreSQL <= 15, a non-superuser at max_connections
        "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
        "FATAL:  remaining connection slots are reserved for roles with privileges of the "
        '"pg_use_reserved_connections" role',
    ],
)
def test_every_slot_refusal_is_the_sizing_rule(said: str) -> None:
    """Each text PostgreSQL refuses a connection with for want of a slot (psycopg gives them as
    a plain OperationalError, without SQLSTATE) is a PoolExhaustedError."""
    exc = psycopg.OperationalError(
        f'connection failed: connection to server at "db" failed: {said}'
    )
    assert isinstance(pooler_refusal(exc), PoolExhaustedError)


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_a_connection_not_had_within_connect_timeout_names_the_sizing_rule(
    pg_dsn: str, lock_mode: str
) -> None:
    """The run's second connection (its work's) goes to a server that accepts and never
    answers (a pooler whose queue is full): ConnectionWaitError within connect_timeout, naming
    the sizing rule and not the DSN's password; the attempt recorded failed with it on a
    connection had later."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    stalled = make_conninfo(
        host="127.0.0.1", port=str(port), user="u", password="s3cret-pw", connect_timeout="1"
    )
    calls: list[int] = []

    def connect() -> psycopg.Connection:
        calls.append(1)
        return psycopg.connect(stalled if len(calls) == 2 else pg_dsn)

    try:
        with pytest.raises(ConnectionWaitError, match=r"docs/deploying\.md") as raised:
            run_idempotently(
                connect=connect, job_name="job", run_key="2026-10-01",
                work=lambda run: {"done": 1}, lock_mode=lock_mode,
            )  # fmt: skip
    finally:
        silent.close()
    assert "s3cret-pw" not in str(raised.value)
    recorded = rows(
        pg_dsn, "SELECT outcome, error FROM idempotency.job_run_attempts WHERE job_name = 'job'"
    )
    assert [outcome for outcome, _ in recorded] == ["failed"], recorded
    assert "connect_timeout" in recorded[0][1] and "s3cret-pw" not in recorded[0][1]
