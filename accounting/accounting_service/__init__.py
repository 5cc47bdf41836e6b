"""Example accounting HTTP service: the system the example invoice DAG exports invoices to.

A real service (Starlette, uvicorn, PostgreSQL through psycopg 3) that keeps its data in
schema ``accounting`` of the database it is given, creating it at start-up.

Run it with ``accounting-service --dsn DSN`` (or ``python -m accounting_service``); it
prints ``accounting service listening on http://HOST:PORT`` once it serves.

API
    ``POST /api/invoices``            header ``Idempotency-Key`` (1-255 characters), JSON
                                      object body -> 201 ``{reference, idempotency_key,
                                      invoice}``; same key and body -> the first response
                                      again, with ``Idempotent-Replayed: true``; same key,
                                      other body -> 422 ``idempotency_error``; 400 on a bad
                                      key or body.
    ``GET /api/invoices/{reference}`` one invoice (``ACC-000123``), or 404.
    ``GET /api/invoices?idempotency_key=K``               a list of zero or one invoice.
    ``GET /api/invoices?key_prefix=P&after=K&limit=N``    ``{items, next_after}``, in key
                                      order; ``limit`` 1-10000, default 1000.
    ``GET /api/stats``                ``{invoices, requests, replays, conflicts,
                                      faults_injected: {fail, reset, timeout_after_commit}}``;
                                      all but ``invoices`` count this run of the service.
    ``GET|PUT /admin/faults``         read or change the fault settings (PUT merges).
    ``GET /healthz``                  200 once the database answers.

Errors are ``{"error": {"type": ..., "message": ...}}``. Fault settings are described in
:mod:`accounting_service.faults`.
"""
