"""Schemathesis against the Run keys view's own OpenAPI schema (``/api/openapi.json``), on
Airflow 3: every JSON twin, valid and invalid parameters generated from the schema, as a
signed-in admin over records the real runner wrote.

Bounded: a few examples per operation and mode (the whole run well under a minute); the
seed is printed, and ``IDEMPOTENCY_SCHEMATHESIS_SEED`` replays a run.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from test_ui_app import auth_manager, seeded, token  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.usefixtures("airflow_home")

EXAMPLES = 12
"""Examples per operation and generation mode: 6 operations x 2 modes x 12 (~25 s)."""


def test_schemathesis_finds_no_server_error_and_answers_as_the_schema_says(
    auth_manager: Any,  # noqa: F811
    seeded: str,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Generated requests to each ``/api`` operation, valid (positive) and invalid (negative):
    none answers a 5xx, each status, content type and body is one the schema documents, and
    every invalid request is refused (a 4xx)."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    from airflow_idempotency.ui.app import Settings, create_app

    seed = int(os.environ.get("IDEMPOTENCY_SCHEMATHESIS_SEED") or random.randrange(2**32))
    with capsys.disabled():
        print(f"\n[schemathesis] seed {seed} (IDEMPOTENCY_SCHEMATHESIS_SEED={seed} replays it)")
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", create_app(Settings()))
    headers = {"Authorization": f"Bearer {token(auth_manager, 'admin', 'admin')}"}
    conformance = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            negative = [negative_data_rejection] if mode is GenerationMode.NEGATIVE else []
            exercise(
                operation.as_strategy(generation_mode=mode), seed, headers, conformance + negative
            )


def exercise(strategy: Any, seed: int, headers: dict[str, str], checks: list[Any]) -> None:
    """Call and check ``EXAMPLES`` cases drawn from ``strategy``, from ``seed``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    @with_seed(seed)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def call(case: Any) -> None:
        case.call_and_validate(headers=headers, checks=checks)

    call()
