"""Provider metadata read by Airflow's provider discovery.

Airflow loads this entry point while its configuration is still initialising, so this
module must import nothing from Airflow (importing ``airflow.sdk`` here breaks every
``airflow`` command with ``cannot import name 'conf'``).
"""

from __future__ import annotations

import copy
from typing import Any

__version__ = "0.1.0"

PROVIDER_INFO: dict[str, Any] = {
    "package-name": "airflow-provider-idempotency",
    "name": "Idempotency",
    "description": (
        "Run keys, Postgres advisory locks, durable run records and an outbound "
        "ledger that make batch jobs safe to run again."
    ),
    "versions": [__version__],
    "integrations": [
        {
            "integration-name": "Idempotency",
            "external-doc-url": "https://github.com/airflow-provider-idempotency/airflow-provider-idempotency#readme",
            "tags": ["software"],
        }
    ],
    "operators": [
        {
            "integration-name": "Idempotency",
            "python-modules": ["airflow_idempotency.operator"],
        }
    ],
    "hooks": [
        {
            "integration-name": "Idempotency",
            "python-modules": ["airflow_idempotency.hook"],
        }
    ],
    "connection-types": [
        {
            "connection-type": "idempotency_postgres",
            "hook-class-name": "airflow_idempotency.hook.IdempotencyHook",
        }
    ],
    "config": {
        "idempotency": {
            "description": (
                "The Run keys view of the Airflow 3 UI (the plugin's app on the "
                "api-server). Airflow 2.11 has no such view: use the "
                "airflow-idempotency CLI."
            ),
            "options": {
                "ui_conn_id": {
                    "description": "Airflow connection of the job database the view reads.",
                    "version_added": "0.2.0",
                    "type": "string",
                    "example": "jobs_db",
                    "default": "idempotency_default",
                },
                "ui_schema": {
                    "description": "Schema of the bookkeeping tables the view reads.",
                    "version_added": "0.2.0",
                    "type": "string",
                    "example": "idempotency",
                    "default": "idempotency",
                },
            },
        }
    },
    "task-decorators": [
        {
            "name": "idempotent_run",
            "class-name": "airflow_idempotency.decorator.idempotent_run_task",
        }
    ],
}
"""The provider description that ``airflow providers list`` shows (the Airflow provider schema)."""


def get_provider_info() -> dict[str, Any]:
    """Return :data:`PROVIDER_INFO` (a copy: a caller may change what it gets)."""
    return copy.deepcopy(PROVIDER_INFO)
