"""Airflow provider that makes batch jobs safe to run again.

Public API: what a DAG author or a script needs, imported lazily (so that Airflow can load
the provider entry point while its own configuration is still initialising)::

    from airflow_idempotency import IdempotentRunOperator, RunContext, RunKeyRule

The rest of the API is imported from its module, by the path docs/api.md shows (e.g.
``from airflow_idempotency.records import Trigger``); anything not shown there is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from airflow_idempotency.provider_info import __version__

if TYPE_CHECKING:
    from airflow_idempotency.decorator import idempotent_run_task
    from airflow_idempotency.effects.mail import Recipients, SmtpSecurity, SmtpSender, email_effect
    from airflow_idempotency.effects.notifications import notify_once
    from airflow_idempotency.effects.outputs import OutputFile
    from airflow_idempotency.exceptions import (
        ConfigurationError,
        EffectsUnknownError,
        IdempotencyError,
        InvalidInputError,
        LockLostError,
        RemoteCallError,
        RunLockedError,
        WorkConflictError,
    )
    from airflow_idempotency.ledger import Effect, OutboundLedger, Retries, post_json, webhook
    from airflow_idempotency.operator import IdempotentRunOperator, idempotency_params
    from airflow_idempotency.records import RunOptions
    from airflow_idempotency.run_context import RunContext
    from airflow_idempotency.run_key import RunKeyRule
    from airflow_idempotency.runner import RunOutcome, run_idempotently

_EXPORTS = {
    # The operator, the decorator and what a DAG gives them.
    "IdempotentRunOperator": "operator",
    "idempotent_run_task": "decorator",
    "idempotency_params": "operator",
    "RunKeyRule": "run_key",
    # The run: what the work receives, and the contract without Airflow.
    "RunContext": "run_context",
    "run_idempotently": "runner",
    "RunOptions": "records",
    "RunOutcome": "runner",
    # The outbound ledger and its senders.
    "OutboundLedger": "ledger",
    "Retries": "ledger",
    "Effect": "ledger",
    "post_json": "ledger",
    "webhook": "ledger",
    "SmtpSender": "effects.mail",
    "SmtpSecurity": "effects.mail",
    "Recipients": "effects.mail",
    "email_effect": "effects.mail",
    "notify_once": "effects.notifications",
    "OutputFile": "effects.outputs",
    # The exceptions to catch: their base class, and one per way a run can fail (docs/api.md
    # says what each means for a task).
    "IdempotencyError": "exceptions",
    "InvalidInputError": "exceptions",
    "ConfigurationError": "exceptions",
    "RunLockedError": "exceptions",
    "LockLostError": "exceptions",
    "WorkConflictError": "exceptions",
    "RemoteCallError": "exceptions",
    "EffectsUnknownError": "exceptions",
}

# A literal list, so that type checkers see the names it re-exports (mypy --strict reads no
# `*_EXPORTS`); tests/unit/test_public_api.py checks that it names exactly the lazy exports.
__all__ = [
    "ConfigurationError",
    "Effect",
    "EffectsUnknownError",
    "IdempotencyError",
    "IdempotentRunOperator",
    "InvalidInputError",
    "LockLostError",
    "OutboundLedger",
    "OutputFile",
    "Recipients",
    "RemoteCallError",
    "Retries",
    "RunContext",
    "RunKeyRule",
    "RunLockedError",
    "RunOptions",
    "RunOutcome",
    "SmtpSecurity",
    "SmtpSender",
    "WorkConflictError",
    "__version__",
    "email_effect",
    "idempotency_params",
    "idempotent_run_task",
    "notify_once",
    "post_json",
    "run_idempotently",
    "webhook",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'airflow_idempotency' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"airflow_idempotency.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
