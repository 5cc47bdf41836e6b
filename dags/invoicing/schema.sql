-- The example's own tables (in the job database, schema public). Idempotent DDL, applied
-- by invoicing.ensure_example_schema only when this file's digest is not yet recorded.

CREATE TABLE IF NOT EXISTS invoicing_schema (
    digest      text        PRIMARY KEY,  -- SHA-256 of this file
    applied_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS orders (
    order_id      bigint      PRIMARY KEY,
    store_id      integer     NOT NULL,
    customer_id   bigint      NOT NULL,
    amount_cents  bigint      NOT NULL CHECK (amount_cents >= 0),
    currency      text        NOT NULL DEFAULT 'EUR',
    shipped_on    date        NOT NULL,
    invoiced_at   timestamptz
);
CREATE INDEX IF NOT EXISTS orders_shipped_on_idx ON orders (shipped_on);

-- One invoice per order, forever: order_id and invoice_number are natural unique keys.
CREATE TABLE IF NOT EXISTS invoices (
    invoice_id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_number  text        NOT NULL UNIQUE,
    order_id        bigint      NOT NULL UNIQUE REFERENCES orders (order_id),
    business_date   date        NOT NULL,
    store_id        integer     NOT NULL,
    customer_id     bigint      NOT NULL,
    amount_cents    bigint      NOT NULL,
    currency        text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS invoices_business_date_idx ON invoices (business_date, invoice_number);

-- An aggregate, rebuilt whole for a business date (delete + insert in one transaction).
CREATE TABLE IF NOT EXISTS daily_invoice_totals (
    business_date  date        NOT NULL,
    store_id       integer     NOT NULL,
    invoice_count  integer     NOT NULL,
    amount_cents   bigint      NOT NULL,
    rebuilt_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, store_id)
);

-- daily_reconciliation: per-store detail, unique per (date, store) ...
CREATE TABLE IF NOT EXISTS store_reconciliation (
    business_date          date        NOT NULL,
    store_id               integer     NOT NULL,
    orders_count           integer     NOT NULL,
    orders_amount_cents    bigint      NOT NULL,
    invoiced_count         integer     NOT NULL,
    invoiced_amount_cents  bigint      NOT NULL,
    difference_cents       bigint      NOT NULL,
    reconciled_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, store_id)
);

-- ... and ONE summary row per business date: a second run can never add a second one.
CREATE TABLE IF NOT EXISTS reconciliation_summary (
    business_date          date        PRIMARY KEY,
    stores                 integer     NOT NULL,
    orders_amount_cents    bigint      NOT NULL,
    invoiced_amount_cents  bigint      NOT NULL,
    mismatched_stores      integer     NOT NULL,
    runs                   integer     NOT NULL DEFAULT 1,
    reconciled_at          timestamptz NOT NULL DEFAULT now()
);

-- The partitioned variant (dags/partitioned_invoices.py): a store's region is its own column
-- of the order, derived here (stores 1-12 are in the eu, the others in the us), and ONE
-- reconciliation row per region and business date.
CREATE OR REPLACE FUNCTION store_region(store_id integer) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT CASE WHEN store_id <= 12 THEN 'eu' ELSE 'us' END $$;

CREATE TABLE IF NOT EXISTS region_reconciliation (
    business_date          date        NOT NULL,
    region                 text        NOT NULL,
    orders_count           integer     NOT NULL,
    invoiced_count         integer     NOT NULL,
    difference_cents       bigint      NOT NULL,
    runs                   integer     NOT NULL DEFAULT 1,
    reconciled_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, region)
);

-- The executions witness (read by devtools/invariants.sql): every work transaction of the
-- example appends one row as its first statement, so a second execution of a key is a
-- second row however idempotent the writes themselves are. began_at is the database clock
-- when the transaction began; committed_at is set at COMMIT by the deferred constraint
-- trigger below (the last thing the transaction does before it commits). A transaction
-- that rolls back (a dry run, a commit the fence refused, a crash) leaves no row. It lives
-- in the example, not in the provider, so that a broken provider cannot silence it.
CREATE TABLE IF NOT EXISTS work_witness (
    witness_id    bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    attempt_id    bigint      NOT NULL,
    job_name      text        NOT NULL,
    run_key       text        NOT NULL,
    forced        boolean     NOT NULL,  -- run.force as the work saw it
    work          text        NOT NULL,  -- which transaction: create_invoices, ...
    backend_pid   integer     NOT NULL DEFAULT pg_backend_pid(),
    began_at      timestamptz NOT NULL DEFAULT transaction_timestamp(),
    committed_at  timestamptz
);
CREATE INDEX IF NOT EXISTS work_witness_key_idx ON work_witness (job_name, run_key, attempt_id);

CREATE OR REPLACE FUNCTION work_witness_commit_time() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE work_witness SET committed_at = clock_timestamp() WHERE witness_id = NEW.witness_id;
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT FROM pg_trigger
        WHERE tgname = 'work_witness_commit_time' AND tgrelid = 'work_witness'::regclass
    ) THEN
        CREATE CONSTRAINT TRIGGER work_witness_commit_time AFTER INSERT ON work_witness
            DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION work_witness_commit_time();
    END IF;
END
$$;
