"""The view's connections to the job database, and why a page cannot read it now.

Line-neutral (Airflow 3's api-server and 2.11's webserver alike). No DDL ever: a missing or
older schema is refused with :class:`ViewUnavailable`, which the pages show as a 503 that
says why and what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from airflow_idempotency.exceptions import SchemaNotReadyError
from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.schema import require_readable
from airflow_idempotency.ui.reads import RecordsReader, Visibility
from airflow_idempotency.ui.settings import CONFIG_SECTION, Settings


class ViewUnavailable(Exception):
    """The job database cannot be read now: shown as a 503 page that says why and what to do."""

    def __init__(self, title: str, detail: str) -> None:
        super().__init__(f"{title}: {detail}")
        self.title = title
        self.detail = detail


def _connection_kwargs(settings: Settings) -> dict[str, Any]:
    try:
        kwargs = IdempotencyHook(postgres_conn_id=settings.conn_id).connection_kwargs()
    except Exception as exc:
        if type(exc).__name__ != "AirflowNotFoundException":
            raise
        raise ViewUnavailable(
            "No job database",
            f"the Airflow connection {settings.conn_id!r} is not defined. Create it, or name "
            f"another one in [{CONFIG_SECTION}] ui_conn_id "
            f"(AIRFLOW__{CONFIG_SECTION.upper()}__UI_CONN_ID).",
        ) from exc
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "airflow-idempotency ui")
    return kwargs


def _require_readable(conn: psycopg.Connection, settings: Settings) -> None:
    try:
        require_readable(conn, settings.schema)
    except SchemaNotReadyError as exc:
        hint = (
            "No idempotent task has run against this database yet, or the connection "
            f"{settings.conn_id!r} ([{CONFIG_SECTION}] ui_conn_id) or the schema "
            f"([{CONFIG_SECTION}] ui_schema) point elsewhere."
            if exc.version == 0
            else "The next idempotent task of this provider version migrates it, or run "
            "`airflow-idempotency migrate`. This view never changes the schema."
        )
        raise ViewUnavailable("The job database is not ready", f"{exc}. {hint}") from exc


@contextmanager
def open_reader(settings: Settings, visibility: Visibility) -> Iterator[RecordsReader]:
    """A reader seeing ``visibility`` on a new connection to the job database, closed
    afterwards; the schema is checked first."""
    kwargs = _connection_kwargs(settings)
    try:
        conn = psycopg.connect(**kwargs, autocommit=True, prepare_threshold=None)
    except psycopg.OperationalError as exc:
        raise ViewUnavailable(
            "Cannot reach the job database",
            f"connection {settings.conn_id!r}: {str(exc).strip()}",
        ) from exc
    with conn:
        _require_readable(conn, settings)
        yield RecordsReader(conn, settings.schema, visibility)


__all__ = ["ViewUnavailable", "open_reader"]
