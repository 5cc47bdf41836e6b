"""The outbound ledger: external side effects that a rerun never repeats.

:class:`OutboundLedger` (:mod:`~airflow_idempotency.ledger.outbound`) sends effects through
a sender (:mod:`~airflow_idempotency.ledger.senders`: the interface a sender implements).
"""

from airflow_idempotency.ledger.outbound import (
    LedgerScope,
    LedgerSummary,
    OutboundLedger,
    Retries,
    check_idempotency_key,
)
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    Confirmation,
    Effect,
    EffectSender,
    HttpSender,
    Sender,
    post_json,
    webhook,
)

__all__ = [
    "BlockingEffectSender",
    "Confirmation",
    "Effect",
    "EffectSender",
    "HttpSender",
    "LedgerScope",
    "LedgerSummary",
    "OutboundLedger",
    "Retries",
    "Sender",
    "check_idempotency_key",
    "post_json",
    "webhook",
]
