-- name: count_execution
-- The first statement of every work transaction of the example: one row in work_witness
-- (schema.sql), committed with the transaction or not at all.
INSERT INTO work_witness (attempt_id, job_name, run_key, forced, work)
VALUES (%(attempt_id)s, %(job_name)s, %(run_key)s, %(forced)s, %(work)s);

-- name: create_invoices
-- One statement: invoice every order shipped on the date that has no invoice yet, and
-- mark exactly those orders invoiced. ON CONFLICT on the natural key makes a rerun, or a
-- run racing a crashed one, create nothing twice.
WITH new_invoices AS (
    INSERT INTO invoices (
        invoice_number, order_id, business_date, store_id, customer_id, amount_cents, currency
    )
    SELECT 'INV-' || o.order_id, o.order_id, o.shipped_on, o.store_id, o.customer_id,
           o.amount_cents, o.currency
    FROM orders AS o
    WHERE o.shipped_on = %(business_date)s
    ON CONFLICT (order_id) DO NOTHING
    RETURNING order_id
),
marked AS (
    UPDATE orders AS o
    SET invoiced_at = now()
    FROM new_invoices AS n
    WHERE o.order_id = n.order_id
    RETURNING o.order_id
)
SELECT (SELECT count(*) FROM orders WHERE shipped_on = %(business_date)s) AS orders_seen,
       (SELECT count(*) FROM new_invoices) AS invoices_created,
       (SELECT count(*) FROM marked) AS orders_marked;

-- name: delete_totals
DELETE FROM daily_invoice_totals WHERE business_date = %(business_date)s;

-- name: insert_totals
INSERT INTO daily_invoice_totals (business_date, store_id, invoice_count, amount_cents)
SELECT business_date, store_id, count(*), sum(amount_cents)
FROM invoices
WHERE business_date = %(business_date)s
GROUP BY business_date, store_id;

-- name: count_invoices
SELECT count(*) FROM invoices WHERE business_date = %(business_date)s;

-- name: invoices_to_export
SELECT invoice_number, order_id, store_id, customer_id, amount_cents, currency, business_date
FROM invoices
WHERE business_date = %(business_date)s
ORDER BY invoice_number;

-- name: upsert_store_reconciliation
INSERT INTO store_reconciliation (
    business_date, store_id, orders_count, orders_amount_cents, invoiced_count,
    invoiced_amount_cents, difference_cents
)
SELECT %(business_date)s::date, o.store_id, count(*), sum(o.amount_cents),
       count(i.order_id), coalesce(sum(i.amount_cents), 0),
       sum(o.amount_cents) - coalesce(sum(i.amount_cents), 0)
FROM orders AS o
LEFT JOIN invoices AS i ON i.order_id = o.order_id
WHERE o.shipped_on = %(business_date)s
GROUP BY o.store_id
ON CONFLICT (business_date, store_id) DO UPDATE
SET orders_count = EXCLUDED.orders_count,
    orders_amount_cents = EXCLUDED.orders_amount_cents,
    invoiced_count = EXCLUDED.invoiced_count,
    invoiced_amount_cents = EXCLUDED.invoiced_amount_cents,
    difference_cents = EXCLUDED.difference_cents,
    reconciled_at = now();

-- name: upsert_reconciliation_summary
INSERT INTO reconciliation_summary (
    business_date, stores, orders_amount_cents, invoiced_amount_cents, mismatched_stores
)
SELECT %(business_date)s::date, count(*), coalesce(sum(orders_amount_cents), 0),
       coalesce(sum(invoiced_amount_cents), 0), count(*) FILTER (WHERE difference_cents <> 0)
FROM store_reconciliation
WHERE business_date = %(business_date)s
ON CONFLICT (business_date) DO UPDATE
SET stores = EXCLUDED.stores,
    orders_amount_cents = EXCLUDED.orders_amount_cents,
    invoiced_amount_cents = EXCLUDED.invoiced_amount_cents,
    mismatched_stores = EXCLUDED.mismatched_stores,
    runs = reconciliation_summary.runs + 1,
    reconciled_at = now()
RETURNING stores, mismatched_stores, runs;

-- name: seed_orders_from_staging
INSERT INTO orders (order_id, store_id, customer_id, amount_cents, currency, shipped_on)
SELECT order_id, store_id, customer_id, amount_cents, currency, shipped_on FROM staging_orders
ON CONFLICT (order_id) DO NOTHING;

-- name: create_region_invoices
-- create_invoices for the orders of one region (the partitioned variant's mapped task).
WITH new_invoices AS (
    INSERT INTO invoices (
        invoice_number, order_id, business_date, store_id, customer_id, amount_cents, currency
    )
    SELECT 'INV-' || o.order_id, o.order_id, o.shipped_on, o.store_id, o.customer_id,
           o.amount_cents, o.currency
    FROM orders AS o
    WHERE o.shipped_on = %(business_date)s AND store_region(o.store_id) = %(region)s
    ON CONFLICT (order_id) DO NOTHING
    RETURNING order_id
),
marked AS (
    UPDATE orders AS o
    SET invoiced_at = now()
    FROM new_invoices AS n
    WHERE o.order_id = n.order_id
    RETURNING o.order_id
)
SELECT (SELECT count(*) FROM orders
        WHERE shipped_on = %(business_date)s AND store_region(store_id) = %(region)s)
           AS orders_seen,
       (SELECT count(*) FROM new_invoices) AS invoices_created,
       (SELECT count(*) FROM marked) AS orders_marked;

-- name: upsert_region_reconciliation
-- ONE row per region and date; `runs` counts the reconciliations that did the work.
INSERT INTO region_reconciliation (
    business_date, region, orders_count, invoiced_count, difference_cents
)
SELECT %(business_date)s::date, %(region)s, count(*), count(i.order_id),
       coalesce(sum(o.amount_cents), 0) - coalesce(sum(i.amount_cents), 0)
FROM orders AS o
LEFT JOIN invoices AS i ON i.order_id = o.order_id
WHERE o.shipped_on = %(business_date)s AND store_region(o.store_id) = %(region)s
ON CONFLICT (business_date, region) DO UPDATE
SET orders_count = EXCLUDED.orders_count,
    invoiced_count = EXCLUDED.invoiced_count,
    difference_cents = EXCLUDED.difference_cents,
    runs = region_reconciliation.runs + 1,
    reconciled_at = now()
RETURNING orders_count, invoiced_count, difference_cents, runs;

-- name: daily_totals
-- The date's totals per store (rebuilt by rebuild_totals), for the finance summary email.
SELECT store_id, invoice_count, amount_cents
FROM daily_invoice_totals
WHERE business_date = %(business_date)s
ORDER BY store_id;
