"""The outbound ledger: external side effects that a rerun never repeats.

:class:`OutboundLedger` (:mod:`~airflow_idempotency.ledger.outbound`) sends effects through
a sender (:mod:`~airflow_idempotency.ledger.senders`), HTTP's in :mod:`.http`.
"""

from airflow_idempotency.ledger.claim import check_idempotency_key
from airflow_idempotency.ledger.http import HttpSender, Sender, post_json, webhook
from airflow_idempotency.ledger.outbound import OutboundLedger
from airflow_idempotency.ledger.outcomes import LedgerSummary
from airflow_idempotency.ledger.retries import Retries
from airflow_idempotency.ledger.scope import LedgerScope
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    Confirmation,
    Effect,
    EffectSender,
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
