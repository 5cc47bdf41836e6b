"""A test auth manager with per-DAG rules, on SimpleAuthManager.

SimpleAuthManager, where the users named in
``IDEMPOTENCY_TEST_DENIED_DAGS`` (JSON ``{"user": ["dag_id", ...]}``) may not read, or do
anything else with, the DAGs listed. SimpleAuthManager itself has no per-DAG rules; FAB and
other managers do. Selected with
``AIRFLOW__CORE__AUTH_MANAGER=support.auth_manager.RestrictedAuthManager``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

DENIED_ENV = "IDEMPOTENCY_TEST_DENIED_DAGS"


class RestrictedAuthManager(SimpleAuthManager):
    def is_authorized_dag(
        self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None
    ) -> bool:
        denied = json.loads(os.environ.get(DENIED_ENV, "{}")).get(user.get_name(), [])
        if details is not None and details.id in denied:
            return False
        return bool(
            super().is_authorized_dag(
                method=method, user=user, access_entity=access_entity, details=details
            )
        )
