-- Version 2: the outbound ledger, one row per external side effect.
-- pending   = written before the call; the remote may or may not have acted on it.
-- succeeded = the remote confirmed (remote_reference holds its id); never sent again.
-- failed    = the remote refused permanently (last_error says why); retried on a rerun.

CREATE TABLE IF NOT EXISTS outbound_ledger (
    ledger_id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    remote_system       text        NOT NULL,
    idempotency_key     text        NOT NULL,
    job_name            text        NOT NULL,
    run_key             text        NOT NULL,
    request_fingerprint text        NOT NULL,
    status              text        NOT NULL DEFAULT 'pending'
        CONSTRAINT outbound_ledger_status_check CHECK (status IN ('pending', 'succeeded', 'failed')),
    remote_reference    text,
    call_count          integer     NOT NULL DEFAULT 0,
    last_error          text,
    last_attempt_id     bigint,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    confirmed_at        timestamptz,
    CONSTRAINT outbound_ledger_key UNIQUE (remote_system, idempotency_key)
);

CREATE INDEX IF NOT EXISTS outbound_ledger_run_idx
    ON outbound_ledger (job_name, run_key, status);
