"""Airflow provider that makes batch jobs safe to run again.

Public API (imported lazily, so that Airflow can load the provider entry point while its
own configuration is still initialising)::

    from airflow_idempotency import IdempotentRunOperator, RunContext, RunKeyRule
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from airflow_idempotency.provider_info import __version__

if TYPE_CHECKING:
    from airflow_idempotency._sql import named_queries
    from airflow_idempotency.crashpoints import crash_point
    from airflow_idempotency.decorator import idempotent_run_task
    from airflow_idempotency.effects import BlockingEffectSender, EffectSender, HttpSender, webhook
    from airflow_idempotency.exceptions import (
        ConfigurationError,
        EffectsUnknownError,
        IdempotencyError,
        IdempotencyKeyConflictError,
        InvalidEffectError,
        InvalidInputError,
        InvalidRunKeyError,
        LockLostError,
        OutcomeUnknownError,
        PeriodNotEndedError,
        PermanentRemoteError,
        RemoteCallError,
        RemoteError,
        RemoteUnreachableError,
        RunKeyMissingError,
        RunLockedError,
        SchemaError,
        TransientRemoteError,
        WorkConflictError,
    )
    from airflow_idempotency.hook import IdempotencyHook
    from airflow_idempotency.ledger import (
        Confirmation,
        Effect,
        LedgerSummary,
        OutboundLedger,
        Retries,
        post_json,
    )
    from airflow_idempotency.mail import Recipients, SmtpSecurity, SmtpSender, email_effect
    from airflow_idempotency.notifications import notify_once
    from airflow_idempotency.operator import IdempotentRunOperator, conf_flag, idempotency_params
    from airflow_idempotency.outputs import OutputConflictError, OutputFile
    from airflow_idempotency.records import RunOptions, Trigger
    from airflow_idempotency.run_context import RunContext
    from airflow_idempotency.run_key import RunKeyRule
    from airflow_idempotency.runner import (
        RunOutcome,
        RunResult,
        run_idempotently,
    )
    from airflow_idempotency.watch import watch_problems

_EXPORTS = {
    "IdempotentRunOperator": "operator",
    "idempotency_params": "operator",
    "conf_flag": "operator",
    "idempotent_run_task": "decorator",
    "IdempotencyHook": "hook",
    "RunContext": "run_context",
    "RunOptions": "records",
    "RunOutcome": "runner",
    "RunResult": "runner",
    "run_idempotently": "runner",
    "RunKeyRule": "run_key",
    "named_queries": "_sql",
    "crash_point": "crashpoints",
    "watch_problems": "watch",
    "OutboundLedger": "ledger",
    "Effect": "ledger",
    "Confirmation": "ledger",
    "LedgerSummary": "ledger",
    "Retries": "ledger",
    "post_json": "ledger",
    "EffectSender": "effects",
    "BlockingEffectSender": "effects",
    "HttpSender": "effects",
    "webhook": "effects",
    "SmtpSender": "mail",
    "SmtpSecurity": "mail",
    "Recipients": "mail",
    "email_effect": "mail",
    "notify_once": "notifications",
    "OutputFile": "outputs",
    "OutputConflictError": "outputs",
    "Trigger": "records",
    "IdempotencyError": "exceptions",
    "InvalidInputError": "exceptions",
    "InvalidRunKeyError": "exceptions",
    "RunKeyMissingError": "exceptions",
    "PeriodNotEndedError": "exceptions",
    "IdempotencyKeyConflictError": "exceptions",
    "SchemaError": "exceptions",
    "RunLockedError": "exceptions",
    "LockLostError": "exceptions",
    "WorkConflictError": "exceptions",
    "RemoteCallError": "exceptions",
    "RemoteError": "exceptions",
    "RemoteUnreachableError": "exceptions",
    "TransientRemoteError": "exceptions",
    "PermanentRemoteError": "exceptions",
    "OutcomeUnknownError": "exceptions",
    "EffectsUnknownError": "exceptions",
    "InvalidEffectError": "exceptions",
    "ConfigurationError": "exceptions",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'airflow_idempotency' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"airflow_idempotency.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
