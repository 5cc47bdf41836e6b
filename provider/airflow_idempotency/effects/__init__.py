"""Every kind of side effect beyond the ledger's own HTTP, each sent through the ledger.

Each goes through the outbound ledger (:mod:`airflow_idempotency.ledger`):

- :mod:`~airflow_idempotency.effects.mail`: email (``SmtpSender``, ``email_effect``);
- :mod:`~airflow_idempotency.effects.notifications`: notifications from task callbacks,
  once per (job, run key, event) (``notify_once``);
- :mod:`~airflow_idempotency.effects.outputs`: a run key's output file (``OutputFile``);
- :mod:`~airflow_idempotency.effects.resolutions`: an operator's choice for an effect left
  ``unknown`` (mark it sent, or resend it).
"""
