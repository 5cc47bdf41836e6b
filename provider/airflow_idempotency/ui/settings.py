"""Where the Run keys view reads: the job database's Airflow connection and its schema.

Read by the api-server (Airflow 3) or the webserver (Airflow 2.11) from ``airflow.cfg`` or
the environment, section ``[idempotency]``:

- ``ui_conn_id`` / ``AIRFLOW__IDEMPOTENCY__UI_CONN_ID``: the Airflow connection of the job
  database (default ``idempotency_default``);
- ``ui_schema`` / ``AIRFLOW__IDEMPOTENCY__UI_SCHEMA``: the bookkeeping schema (default
  ``idempotency``).
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.schema import DEFAULT_SCHEMA, validate_schema_name

CONFIG_SECTION = "idempotency"


@dataclass(frozen=True)
class Settings:
    """Where the view reads: an Airflow connection and the bookkeeping schema."""

    conn_id: str = IdempotencyHook.default_conn_name
    schema: str = DEFAULT_SCHEMA

    @classmethod
    def from_airflow_config(cls) -> Settings:
        from airflow.configuration import conf

        return cls(
            conn_id=conf.get(CONFIG_SECTION, "ui_conn_id", fallback=cls.conn_id),
            schema=validate_schema_name(conf.get(CONFIG_SECTION, "ui_schema", fallback=cls.schema)),
        )


__all__ = ["CONFIG_SECTION", "Settings"]
