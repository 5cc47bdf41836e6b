"""docs/connection.md's URIs read as the page says: each, put in an AIRFLOW_CONN_ variable,
is what the provider connects with (the job database's psycopg arguments, SmtpSender's
settings), through Airflow's own connection parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support import ROOT

PAGE = (ROOT / "docs" / "connection.md").read_text(encoding="utf-8")


def _job_database(monkeypatch: pytest.MonkeyPatch, value: str) -> dict[str, object]:
    from airflow_idempotency.connection import JobDatabase

    monkeypatch.setenv("AIRFLOW_CONN_DOCS_JOBS", value)
    return JobDatabase("docs_jobs").connection_kwargs()


def test_the_postgres_uri_json_and_socket_forms(
    airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's command, environment variable and JSON form give one set of connection
    arguments (the database from the URI's path, sslmode from its query, the provider's
    connect_timeout); the socket form's host is the directory."""
    (uri,) = set(re.findall(r"--conn-uri '([^']+)'", PAGE))
    (exported,) = set(re.findall(r"AIRFLOW_CONN_IDEMPOTENCY_DEFAULT='([^']+)'", PAGE))
    assert uri == exported
    from_uri = _job_database(monkeypatch, uri)
    assert {k: from_uri[k] for k in ("host", "port", "user", "password", "dbname", "sslmode")} == {
        "host": "db.example.com",
        "port": 5432,
        "user": "airflow_jobs",
        "password": "change-me",
        "dbname": "jobs",
        "sslmode": "require",
    }
    assert from_uri["connect_timeout"] == 10
    (as_json,) = re.findall(r"`(\{\"conn_type\": \"postgres\".*?\})`", PAGE)
    assert _job_database(monkeypatch, json.dumps(json.loads(as_json))) == from_uri
    (socket,) = re.findall(r"`(postgresql://postgres@%2F[^`]+)`", PAGE)
    from_socket = _job_database(monkeypatch, socket)
    assert (from_socket["host"], from_socket["dbname"]) == ("/var/run/postgresql", "jobs")


def test_the_smtp_uris(airflow_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STARTTLS on 587, SMTPS on 465 and a local relay read as SmtpSender's settings, with
    the percent-encoded login and sender address decoded."""
    from airflow_idempotency.effects.mail import SmtpSender

    uris = re.findall(r"AIRFLOW_CONN_SMTP_DEFAULT='([^']+)'", PAGE)
    assert len(uris) == 3
    seen = []
    for uri in uris:
        monkeypatch.setenv("AIRFLOW_CONN_DOCS_SMTP", uri)
        sender = SmtpSender.from_connection("docs_smtp")
        seen.append((sender.host, sender.port, sender.security.tls, sender.security.login))
        assert sender.from_email == "finance@example.com"
    assert seen == [
        ("smtp.example.com", 587, "starttls", "reports@example.com"),
        ("smtp.example.com", 465, "ssl", "reports@example.com"),
        ("localhost", 25, None, None),
    ]
