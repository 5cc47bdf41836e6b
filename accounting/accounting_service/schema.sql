-- The accounting service's own schema. Run at every start-up, inside one transaction
-- that first takes a transaction-scoped advisory lock: CREATE ... IF NOT EXISTS alone
-- is not safe when two instances start at once (both see "missing", one then fails on
-- a duplicate catalog entry).

CREATE SCHEMA IF NOT EXISTS accounting;

CREATE TABLE IF NOT EXISTS accounting.invoices (
    -- The public reference is derived from the id: ACC-000123.
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Byte order ("C") makes keyset pagination independent of the server's locale and
    -- lets LIKE 'prefix%' use the unique index.
    idempotency_key text COLLATE "C" NOT NULL UNIQUE,
    -- SHA-256 of the canonical JSON body: the same key with another body is a conflict.
    request_hash text NOT NULL,
    -- json, not jsonb: it keeps the client's key order, so the replayed response is
    -- byte for byte the first one.
    invoice json NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Request counters for GET /api/stats. Each worker process adds its own row per
-- counter, so workers never contend for a row; stats sum the rows of one instance
-- (one run of the service, all its workers).
CREATE TABLE IF NOT EXISTS accounting.request_counters (
    instance_id text NOT NULL,
    worker_pid integer NOT NULL,
    name text NOT NULL,
    value bigint NOT NULL,
    PRIMARY KEY (instance_id, worker_pid, name)
);

-- Every POST /api/invoices that reached the service, by idempotency key: what the remote
-- itself saw, however the client counts. Each row is written by the very statement that
-- decides the answer (created, replayed, conflict), or, for a request refused before that
-- (an injected 503 or reset, an invalid request), by one statement of its own before the
-- answer goes out. received_at is the service's clock when the request came in (before any
-- injected latency); on one host that is the database's clock too.
CREATE TABLE IF NOT EXISTS accounting.requests (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key text COLLATE "C" NOT NULL,
    received_at timestamptz NOT NULL,
    answered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- created | replayed | conflict | invalid | fail | reset_before_commit
    outcome text NOT NULL,
    invoice_id bigint,
    instance_id text NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_key_idx ON accounting.requests (idempotency_key, received_at);
