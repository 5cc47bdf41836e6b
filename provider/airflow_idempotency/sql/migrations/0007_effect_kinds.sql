-- Version 7: every kind of external effect, not only calls to a remote that deduplicates.
-- effect_kind     = what the effect is: http, email, notification, webhook, file, or a
--                   sender's own name (shown by the CLI and the Run keys view).
-- deduplicating   = the remote honours the idempotency key (a resend on doubt is safe).
-- status 'unknown' (not deduplicating only) = the intent was recorded and the call began,
--                   and no outcome was recorded: it may have happened. Never sent again on its
--                   own; an operator resolves it (outbound_ledger_resolutions).
-- intent_at       = when the last call of a not-deduplicating effect began.
-- Adding columns with constant defaults rewrites nothing (PostgreSQL 11+). The new CHECK
-- allows a superset of the old one, so existing rows satisfy it: NOT VALID skips the scan.
ALTER TABLE outbound_ledger
    ADD COLUMN IF NOT EXISTS effect_kind text NOT NULL DEFAULT 'http',
    ADD COLUMN IF NOT EXISTS deduplicating boolean NOT NULL DEFAULT true,
    ADD COLUMN IF NOT EXISTS intent_at timestamptz;

ALTER TABLE outbound_ledger DROP CONSTRAINT IF EXISTS outbound_ledger_status_check;
ALTER TABLE outbound_ledger ADD CONSTRAINT outbound_ledger_status_check
    CHECK (status IN ('pending', 'unknown', 'succeeded', 'failed')) NOT VALID;

-- The operator's explicit choices for effects left unknown, append-only: who, when, why,
-- and what the row was before. 'mark_sent' confirms it, 'resend' makes it pending again
-- (the next run of its key sends it).
CREATE TABLE IF NOT EXISTS outbound_ledger_resolutions (
    resolution_id   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ledger_id       bigint      NOT NULL REFERENCES outbound_ledger (ledger_id),
    action          text        NOT NULL
        CONSTRAINT outbound_ledger_resolutions_action_check CHECK (action IN ('mark_sent', 'resend')),
    previous_status text        NOT NULL,
    resolved_by     text        NOT NULL,
    reason          text        NOT NULL,
    resolved_at     timestamptz NOT NULL DEFAULT statement_timestamp()
);

CREATE INDEX IF NOT EXISTS outbound_ledger_resolutions_ledger_idx
    ON outbound_ledger_resolutions (ledger_id);
