-- The invoice example's date state and its invariants, by name (devtools/invariants.py).
-- One home for what the tests, the fault scenarios, the demo and chaos check.
--
-- Date state: %(day)s is a business date (= the run key), YYYY-MM-DD.
-- Invariants: each returns the rows that break it (none: it holds). %(keys)s is the run keys
-- in scope (text[]); every row names its run_key (and its job_name where there is one), so
-- that a violation can print the history of that key.
--
-- Two witnesses make the checks count executions instead of looking at end states that an
-- idempotent workload would reach anyway:
-- * work_witness (dags/invoicing/schema.sql): one row per committed work transaction of
--   the example, with the database clock at its BEGIN and at its COMMIT;
-- * accounting.requests (the accounting service's schema.sql): every request that reached
--   the remote, by idempotency key, with the time it came in.
-- and chaos records in witness_lock_losses when it ended a lock session (the database clock
-- once the backend was gone).

-- name: lock_losses_table
CREATE TABLE IF NOT EXISTS witness_lock_losses (
    backend_pid    integer     NOT NULL,
    lock_key       bigint      NOT NULL,
    backend_start  timestamptz NOT NULL,
    terminated_at  timestamptz NOT NULL,  -- pg_terminate_backend() was called
    gone_at        timestamptz NOT NULL,  -- the backend was no longer in pg_stat_activity
    PRIMARY KEY (backend_pid, backend_start, lock_key)
);
-- The lease mode's counterpart (no session holds a lease): each lease chaos took over, as a
-- successor does (a new token, after the holder's open fenced transactions ended), the
-- attempt that held it, and the database clock once the take-over had committed.
CREATE TABLE IF NOT EXISTS witness_lease_losses (
    lock_key       bigint      NOT NULL,
    token          bigint      NOT NULL,  -- the token taken over: the attempt's lease
    attempt_id     bigint      NOT NULL,
    taken_over_at  timestamptz NOT NULL,  -- after the take-over's COMMIT
    PRIMARY KEY (lock_key, token)
);

-- name: lock_losses_table_exists
SELECT to_regclass('public.witness_lock_losses') IS NOT NULL
       AND to_regclass('public.witness_lease_losses') IS NOT NULL;

-- name: run_lock_sessions
-- Sessions holding a run lock right now, with the attempt (if any) that runs under it.
SELECT h.pid, h.lock_key, s.backend_start, a.job_name, a.attempt_id
FROM idempotency.held_run_locks() AS h
JOIN pg_stat_activity AS s ON s.pid = h.pid
LEFT JOIN LATERAL (
    SELECT job_name, attempt_id FROM idempotency.job_run_attempts
    WHERE lock_key = h.lock_key AND lock_backend_pid = h.pid AND outcome = 'running'
    ORDER BY attempt_id DESC LIMIT 1
) AS a ON true
ORDER BY h.pid;

-- name: live_leases
-- The lease mode's counterpart: live leases now, each with the running attempt that started
-- under it (started after the lease was taken; none before its start is recorded).
SELECT l.lock_key, l.token, a.job_name, a.attempt_id
FROM idempotency.run_leases AS l
JOIN LATERAL (
    SELECT job_name, attempt_id FROM idempotency.job_run_attempts
    WHERE lock_key = l.lock_key AND lock_backend_pid IS NULL AND outcome = 'running'
      AND started_at >= l.acquired_at
    ORDER BY attempt_id DESC LIMIT 1
) AS a ON true
WHERE l.expires_at > clock_timestamp()
ORDER BY l.lock_key;

-- name: take_over_fence
-- Chaos takes a lease over as a successor's start does, in one transaction: first the key's
-- fence key exclusively (every fenced transaction of the holder has ended; at most
-- %(wait_ms)s ms; their commit-time checks forgotten) ...
SELECT idempotency.fence_take_over(%(lock_key)s, %(wait_ms)s);

-- name: take_over_lease
-- ... then a new token, the lease left expired (free to take). No row: the lease was gone.
UPDATE idempotency.run_leases
SET token = nextval('idempotency.run_lease_tokens'), acquired_at = clock_timestamp(),
    renewed_at = clock_timestamp(), expires_at = clock_timestamp()
WHERE lock_key = %(lock_key)s AND token = %(token)s
RETURNING token;

-- name: record_lease_loss
INSERT INTO witness_lease_losses (lock_key, token, attempt_id, taken_over_at)
VALUES (%(lock_key)s, %(token)s, %(attempt_id)s, clock_timestamp())
ON CONFLICT DO NOTHING;

-- name: backend_gone
-- Whether the session is gone, and the database clock when that was seen.
SELECT NOT EXISTS (
    SELECT FROM pg_stat_activity WHERE pid = %(pid)s AND backend_start = %(backend_start)s
) AS gone, clock_timestamp() AS seen_at;

-- name: record_lock_loss
INSERT INTO witness_lock_losses (backend_pid, lock_key, backend_start, terminated_at, gone_at)
VALUES (%(pid)s, %(lock_key)s, %(backend_start)s, %(terminated_at)s, %(gone_at)s)
ON CONFLICT DO NOTHING;

-- ------------------------------------------------------------------- the date state

-- name: provider_schema_exists
SELECT to_regclass('idempotency.job_run_attempts') IS NOT NULL
   AND to_regprocedure('idempotency.held_run_locks()') IS NOT NULL;

-- name: state_orders
SELECT count(*) FROM orders WHERE shipped_on = %(day)s::date;

-- name: state_invoices
SELECT invoice_number, order_id, business_date::text, store_id, customer_id, amount_cents,
       currency
FROM invoices WHERE business_date = %(day)s::date ORDER BY invoice_number;

-- name: state_uninvoiced_orders
SELECT count(*) FROM orders WHERE shipped_on = %(day)s::date AND invoiced_at IS NULL;

-- name: state_totals
SELECT store_id, invoice_count, amount_cents FROM daily_invoice_totals
WHERE business_date = %(day)s::date ORDER BY store_id;

-- name: state_ledger
SELECT idempotency_key, status, remote_reference FROM idempotency.outbound_ledger
WHERE run_key = %(day)s AND remote_system = 'accounting' ORDER BY idempotency_key;

-- name: state_remote
SELECT idempotency_key, id, (invoice->>'order_id')::bigint FROM accounting.invoices
WHERE invoice->>'business_date' = %(day)s ORDER BY idempotency_key;

-- name: state_jobs
-- The finalize_invoices jobs of the date and their status (absent: never started).
SELECT job_name, status FROM idempotency.job_runs
WHERE run_key = %(day)s AND starts_with(job_name, 'finalize_invoices.') ORDER BY job_name;

-- name: state_counts
-- One date's counts in every place the job writes to (the demo's tables). The date is
-- one parameter: cast where it is compared as text.
SELECT
  (SELECT count(*) FROM orders WHERE shipped_on = %(day)s::date) AS orders,
  (SELECT count(*) FROM invoices WHERE business_date = %(day)s::date) AS invoices,
  (SELECT count(*) FROM orders WHERE shipped_on = %(day)s::date AND invoiced_at IS NULL)
    AS uninvoiced,
  (SELECT coalesce(sum(invoice_count), 0) FROM daily_invoice_totals
    WHERE business_date = %(day)s::date) AS totals,
  (SELECT count(*) FROM idempotency.outbound_ledger
    WHERE run_key = %(day)s::text AND remote_system = 'accounting' AND status = 'succeeded') AS ledger_succeeded,
  (SELECT count(*) FROM idempotency.outbound_ledger
    WHERE run_key = %(day)s::text AND remote_system = 'accounting' AND status = 'pending') AS ledger_pending,
  (SELECT count(*) FROM idempotency.outbound_ledger
    WHERE run_key = %(day)s::text AND remote_system = 'accounting' AND status = 'failed') AS ledger_failed,
  (SELECT count(*) FROM accounting.invoices WHERE invoice->>'business_date' = %(day)s::text)
    AS remote,
  (SELECT count(DISTINCT invoice->>'order_id') FROM accounting.invoices
    WHERE invoice->>'business_date' = %(day)s::text) AS remote_orders;

-- name: state_fingerprint
-- A digest of everything a no-op must leave alone on the dates %(keys)s (rows, statuses,
-- rebuild times, call counts, the remote's invoices).
SELECT
  (SELECT md5(coalesce(string_agg(invoice_number || ':' || order_id || ':'
     || amount_cents, ',' ORDER BY invoice_number), ''))
     FROM invoices WHERE business_date = ANY(%(keys)s::date[])),
  (SELECT md5(coalesce(string_agg(business_date || ':' || store_id || ':'
     || invoice_count || ':' || rebuilt_at, ',' ORDER BY business_date, store_id), ''))
     FROM daily_invoice_totals WHERE business_date = ANY(%(keys)s::date[])),
  (SELECT md5(coalesce(string_agg(idempotency_key || ':' || status || ':'
     || coalesce(remote_reference, '') || ':' || call_count, ','
     ORDER BY idempotency_key), ''))
     FROM idempotency.outbound_ledger
     WHERE run_key = ANY(%(keys)s::text[]) AND remote_system = 'accounting'),
  (SELECT count(*) FROM accounting.invoices),
  (SELECT coalesce(max(id), 0) FROM accounting.invoices);

-- ------------------------------------------------------------------- invariants: history
-- Facts about what happened: they hold at any moment, runs in flight or not.

-- name: recomputed_without_force
-- Work attempts on a key already completed, not forced, with no unfinished forced
-- recompute between that completion and them (a plain run finishes a forced recompute
-- that did not complete: docs/run-keys.md, "force"). Which attempts did work, %(seen_by)s:
-- 'witness', those that committed a work transaction (work_witness); 'records', those the
-- provider recorded as work (not noop, lock_held, reset or a dry run).
WITH work AS (
    SELECT w.job_name, w.run_key, w.attempt_id, bool_or(w.forced) AS forced
    FROM work_witness AS w
    WHERE %(seen_by)s = 'witness' AND w.run_key = ANY(%(keys)s)
    GROUP BY w.job_name, w.run_key, w.attempt_id
    UNION ALL
    SELECT a.job_name, a.run_key, a.attempt_id, a.force
    FROM idempotency.job_run_attempts AS a
    WHERE %(seen_by)s = 'records' AND a.run_key = ANY(%(keys)s) AND NOT a.dry_run
      AND a.outcome NOT IN ('noop', 'lock_held', 'reset')
)
SELECT w.job_name, w.run_key, w.attempt_id, c.attempt_id AS previous_completion
FROM work AS w
JOIN LATERAL (
    SELECT a.attempt_id FROM idempotency.job_run_attempts AS a
    WHERE a.job_name = w.job_name AND a.run_key = w.run_key
      AND a.attempt_id < w.attempt_id AND a.outcome = 'completed'
    ORDER BY a.attempt_id DESC LIMIT 1
) AS c ON true
WHERE NOT w.forced
  AND NOT EXISTS (
      SELECT FROM idempotency.job_run_attempts AS f
      WHERE f.job_name = w.job_name AND f.run_key = w.run_key
        AND f.attempt_id > c.attempt_id AND f.attempt_id < w.attempt_id
        AND f.force AND NOT f.dry_run
        AND f.outcome NOT IN ('completed', 'noop', 'lock_held', 'reset')
  )
ORDER BY w.job_name, w.run_key, w.attempt_id;

-- name: work_transactions_overlap
-- Two attempts' committed work transactions of one key whose [BEGIN, COMMIT] intervals
-- overlap: the run lock excluded no one.
SELECT a.job_name, a.run_key, a.attempt_id, b.attempt_id AS other_attempt,
       a.began_at, a.committed_at, b.began_at AS other_began_at,
       b.committed_at AS other_committed_at
FROM work_witness AS a
JOIN work_witness AS b
  ON b.job_name = a.job_name AND b.run_key = a.run_key AND b.attempt_id > a.attempt_id
WHERE a.run_key = ANY(%(keys)s)
  AND a.began_at < b.committed_at AND b.began_at < a.committed_at
ORDER BY a.job_name, a.run_key, a.attempt_id;

-- name: commit_after_lock_lost
-- Work committed by an attempt after its lock session was gone (chaos ended it and saw it
-- gone at gone_at). The attempt is the one whose recorded lock backend is that session:
-- the same pid and lock key, started after the session did. In the lease mode: after chaos
-- took its lease over (witness_lease_losses, the attempt recorded then).
SELECT w.job_name, w.run_key, w.attempt_id, w.committed_at, l.backend_pid AS lost_lock_pid,
       NULL::bigint AS lost_lease_token, l.gone_at
FROM witness_lock_losses AS l
JOIN idempotency.job_run_attempts AS a
  ON a.lock_backend_pid = l.backend_pid AND a.lock_key = l.lock_key
 AND a.started_at >= l.backend_start
JOIN work_witness AS w ON w.attempt_id = a.attempt_id
WHERE w.run_key = ANY(%(keys)s) AND w.committed_at > l.gone_at
UNION ALL
SELECT w.job_name, w.run_key, w.attempt_id, w.committed_at, NULL, l.token, l.taken_over_at
FROM witness_lease_losses AS l
JOIN work_witness AS w ON w.attempt_id = l.attempt_id
WHERE w.run_key = ANY(%(keys)s) AND w.committed_at > l.taken_over_at
ORDER BY 1, 2, 3;

-- name: commit_after_successor_started
-- Work committed by an attempt after a later attempt of the same key had started: that
-- one held the lock, so the first one no longer did. (noop and lock_held attempts are
-- recorded in the lock transaction, whose clock is its BEGIN, before the lock was taken;
-- reset is the CLI's, without a lock: none of them counts as a start.)
SELECT w.job_name, w.run_key, w.attempt_id, w.committed_at, b.attempt_id AS later_attempt,
       b.started_at AS later_started_at
FROM work_witness AS w
JOIN idempotency.job_run_attempts AS b
  ON b.job_name = w.job_name AND b.run_key = w.run_key AND b.attempt_id > w.attempt_id
 AND b.outcome NOT IN ('noop', 'lock_held', 'reset')
WHERE w.run_key = ANY(%(keys)s) AND w.committed_at > b.started_at
ORDER BY w.job_name, w.run_key, w.attempt_id;

-- name: confirmed_effect_resent
-- Requests that reached the remote for a key after the ledger had recorded it confirmed.
SELECT l.run_key, l.idempotency_key, l.confirmed_at, r.received_at, r.outcome
FROM idempotency.outbound_ledger AS l
JOIN accounting.requests AS r ON r.idempotency_key = l.idempotency_key
WHERE l.run_key = ANY(%(keys)s) AND l.remote_system = 'accounting' AND l.status = 'succeeded'
  AND r.received_at > l.confirmed_at
ORDER BY l.run_key, l.idempotency_key, r.received_at;

-- name: remote_duplicate_orders
-- Orders with more than one invoice at the remote (any date, any key).
SELECT min(invoice->>'business_date') AS run_key, invoice->>'order_id' AS order_id,
       count(*), array_agg(idempotency_key ORDER BY idempotency_key) AS keys
FROM accounting.invoices
GROUP BY invoice->>'order_id' HAVING count(*) > 1
ORDER BY 1, 2;

-- name: remote_key_order_mismatch
-- Remote invoices whose idempotency key names another date or order than the invoice.
SELECT invoice->>'business_date' AS run_key, idempotency_key, invoice->>'order_id' AS order_id
FROM accounting.invoices
WHERE idempotency_key <> 'finalize_invoices:' || (invoice->>'business_date')
                         || ':order_' || (invoice->>'order_id')
ORDER BY 1, 2;

-- name: duplicate_invoices
-- Orders with more than one invoice in the job database (any date).
SELECT min(business_date)::text AS run_key, order_id, count(*)
FROM invoices GROUP BY order_id HAVING count(*) > 1 ORDER BY 1, 2;

-- ------------------------------------------------------------------- invariants: end state
-- What must hold once nothing runs (a quiescent point).

-- name: export_not_one_remote_invoice_per_order
-- Orders of a date whose export_invoices is completed without exactly one remote invoice.
SELECT o.shipped_on::text AS run_key, o.order_id, count(r.id) AS remote_invoices
FROM orders AS o
LEFT JOIN accounting.invoices AS r ON r.invoice->>'order_id' = o.order_id::text
WHERE o.shipped_on::text = ANY(%(keys)s)
  AND EXISTS (
      SELECT FROM idempotency.job_runs AS j
      WHERE j.job_name = 'finalize_invoices.export_invoices'
        AND j.run_key = o.shipped_on::text AND j.status = 'completed'
  )
GROUP BY 1, 2 HAVING count(r.id) <> 1
ORDER BY 1, 2;

-- name: ledger_not_confirmed_by_remote
-- Ledger rows of a date whose export_invoices is completed that are not confirmed, or whose
-- reference is not the remote's invoice for that key (format_reference() of the accounting
-- service's store.py: ACC- and the id, zero-padded to six digits at least).
SELECT l.run_key, l.idempotency_key, l.status, l.remote_reference, r.id AS remote_id,
       l.last_error
FROM idempotency.outbound_ledger AS l
LEFT JOIN accounting.invoices AS r USING (idempotency_key)
WHERE l.run_key = ANY(%(keys)s) AND l.remote_system = 'accounting'
  AND EXISTS (
      SELECT FROM idempotency.job_runs AS j
      WHERE j.job_name = 'finalize_invoices.export_invoices'
        AND j.run_key = l.run_key AND j.status = 'completed'
  )
  AND (l.status <> 'succeeded' OR r.id IS NULL
       OR l.remote_reference IS DISTINCT FROM
          'ACC-' || repeat('0', greatest(0, 6 - length(r.id::text))) || r.id::text)
ORDER BY 1, 2;

-- name: create_not_every_order_invoiced
-- Dates whose create_invoices is completed with orders not invoiced (or not marked so).
SELECT o.shipped_on::text AS run_key, count(*) AS orders, count(i.order_id) AS invoices,
       count(*) FILTER (WHERE o.invoiced_at IS NULL) AS unmarked
FROM orders AS o
LEFT JOIN invoices AS i USING (order_id)
WHERE o.shipped_on::text = ANY(%(keys)s)
  AND EXISTS (
      SELECT FROM idempotency.job_runs AS j
      WHERE j.job_name = 'finalize_invoices.create_invoices'
        AND j.run_key = o.shipped_on::text AND j.status = 'completed'
  )
GROUP BY 1 HAVING count(*) <> count(i.order_id) OR bool_or(o.invoiced_at IS NULL)
ORDER BY 1;

-- name: totals_not_recomputed
-- daily_invoice_totals rows of a date whose rebuild_totals is completed that differ from
-- a fresh recomputation from the invoices (either side).
WITH done AS (
    SELECT j.run_key::date AS business_date FROM idempotency.job_runs AS j
    WHERE j.job_name = 'finalize_invoices.rebuild_totals' AND j.status = 'completed'
      AND j.run_key = ANY(%(keys)s)
),
fresh AS (
    SELECT business_date, store_id, count(*)::int AS n, sum(amount_cents)::bigint AS cents
    FROM invoices WHERE business_date IN (SELECT business_date FROM done) GROUP BY 1, 2
),
stored AS (
    SELECT business_date, store_id, invoice_count AS n, amount_cents AS cents
    FROM daily_invoice_totals WHERE business_date IN (SELECT business_date FROM done)
)
SELECT business_date::text AS run_key, 'stored' AS side, store_id, n, cents
FROM (SELECT * FROM stored EXCEPT SELECT * FROM fresh) AS s
UNION ALL
SELECT business_date::text, 'fresh', store_id, n, cents
FROM (SELECT * FROM fresh EXCEPT SELECT * FROM stored) AS f
ORDER BY 1, 2, 3;

-- name: summary_not_one_per_date
SELECT business_date::text AS run_key, count(*) FROM reconciliation_summary
GROUP BY 1 HAVING count(*) > 1 ORDER BY 1;

-- name: completed_run_not_by_completed_attempt
-- Completed job_runs whose current attempt did not complete (e.g. it lost its lock).
SELECT r.job_name, r.run_key, r.current_attempt_id, a.outcome
FROM idempotency.job_runs AS r
LEFT JOIN idempotency.job_run_attempts AS a ON a.attempt_id = r.current_attempt_id
WHERE r.run_key = ANY(%(keys)s) AND r.status = 'completed'
  AND a.outcome IS DISTINCT FROM 'completed'
ORDER BY 1, 2;

-- name: advisory_locks_left
-- Advisory locks of this database held by anyone (nothing runs: none may be).
SELECT NULL::text AS run_key, l.pid, l.classid, l.objid, a.application_name, a.state
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a USING (pid)
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.pid;

-- ------------------------------------------------------------------- invariants: converged
-- What must hold after every touched date was rerun until completed.

-- name: running_attempt_without_holder
-- A running attempt's holder: its lock session (the advisory mode), or a live lease of its
-- key taken before it started (the lease mode: no lock session, lock_backend_pid NULL).
SELECT a.job_name, a.run_key, a.attempt_id, a.lock_backend_pid
FROM idempotency.job_run_attempts AS a
WHERE a.run_key = ANY(%(keys)s) AND a.outcome = 'running'
  AND NOT EXISTS (SELECT FROM pg_stat_activity AS s WHERE s.pid = a.lock_backend_pid)
  AND NOT EXISTS (
      SELECT FROM idempotency.run_leases AS l
      WHERE a.lock_backend_pid IS NULL AND l.lock_key = a.lock_key
        AND l.acquired_at <= a.started_at AND l.expires_at > clock_timestamp()
  )
ORDER BY 1, 2, 3;

-- name: job_not_completed
-- The jobs %(jobs)s of the dates %(keys)s that are not completed.
SELECT j.job_name, k.run_key, r.status
FROM unnest(%(keys)s::text[]) AS k(run_key)
CROSS JOIN unnest(%(jobs)s::text[]) AS j(job_name)
LEFT JOIN idempotency.job_runs AS r ON r.job_name = j.job_name AND r.run_key = k.run_key
WHERE r.status IS DISTINCT FROM 'completed'
ORDER BY 2, 1;

-- name: date_not_converged
-- Dates that are not finished everywhere: invoices = orders, all marked, totals count
-- them all, every ledger row confirmed, exactly one remote invoice per order.
WITH counts AS (
    SELECT k.run_key,
      (SELECT count(*) FROM orders WHERE shipped_on = k.run_key::date) AS orders,
      (SELECT count(*) FROM invoices WHERE business_date = k.run_key::date) AS invoices,
      (SELECT count(*) FROM orders WHERE shipped_on = k.run_key::date AND invoiced_at IS NULL)
        AS uninvoiced,
      (SELECT coalesce(sum(invoice_count), 0) FROM daily_invoice_totals
        WHERE business_date = k.run_key::date) AS totals,
      (SELECT count(*) FROM idempotency.outbound_ledger
        WHERE run_key = k.run_key AND remote_system = 'accounting' AND status = 'succeeded')
        AS ledger_succeeded,
      (SELECT count(*) FROM idempotency.outbound_ledger
        WHERE run_key = k.run_key AND remote_system = 'accounting') AS ledger_rows,
      (SELECT count(*) FROM accounting.invoices WHERE invoice->>'business_date' = k.run_key)
        AS remote,
      (SELECT count(DISTINCT invoice->>'order_id') FROM accounting.invoices
        WHERE invoice->>'business_date' = k.run_key) AS remote_orders
    FROM unnest(%(keys)s::text[]) AS k(run_key)
)
SELECT * FROM counts
WHERE orders = 0 OR invoices <> orders OR uninvoiced <> 0 OR totals <> orders
   OR ledger_succeeded <> orders OR ledger_rows <> orders OR remote <> orders
   OR remote_orders <> orders
ORDER BY run_key;

-- ------------------------------------------------------------------- histories

-- name: history_attempts
SELECT attempt_id, job_name, outcome, force, dry_run, lock_backend_pid, started_at,
       finished_at, dag_id, run_id, task_id, try_number, left(error, 160) AS error
FROM idempotency.job_run_attempts
WHERE run_key = %(run_key)s AND (%(job_name)s::text IS NULL OR job_name = %(job_name)s)
ORDER BY attempt_id;

-- name: history_witness
SELECT witness_id, attempt_id, job_name, work, forced, backend_pid, began_at, committed_at
FROM work_witness
WHERE run_key = %(run_key)s AND (%(job_name)s::text IS NULL OR job_name = %(job_name)s)
ORDER BY witness_id;

-- name: history_lock_losses
SELECT l.backend_pid, l.lock_key, l.backend_start, l.terminated_at, l.gone_at,
       a.attempt_id, a.job_name
FROM witness_lock_losses AS l
JOIN idempotency.job_run_attempts AS a
  ON a.lock_backend_pid = l.backend_pid AND a.lock_key = l.lock_key
 AND a.started_at >= l.backend_start
WHERE a.run_key = %(run_key)s AND (%(job_name)s::text IS NULL OR a.job_name = %(job_name)s)
UNION ALL
SELECT NULL, l.lock_key, NULL, NULL, l.taken_over_at, a.attempt_id, a.job_name
FROM witness_lease_losses AS l
JOIN idempotency.job_run_attempts AS a ON a.attempt_id = l.attempt_id
WHERE a.run_key = %(run_key)s AND (%(job_name)s::text IS NULL OR a.job_name = %(job_name)s)
ORDER BY 5;

-- name: history_requests
-- The remote's requests of the date's keys (idempotency keys finalize_invoices:<date>:...).
SELECT r.id, r.idempotency_key, r.outcome, r.received_at, r.answered_at, r.invoice_id,
       l.status AS ledger_status, l.confirmed_at AS ledger_confirmed_at
FROM accounting.requests AS r
LEFT JOIN idempotency.outbound_ledger AS l
  ON l.remote_system = 'accounting' AND l.idempotency_key = r.idempotency_key
WHERE starts_with(r.idempotency_key, 'finalize_invoices:' || %(run_key)s || ':')
ORDER BY r.id
LIMIT 40;

-- name: execution_without_attempt
-- Task instances Airflow says succeeded (%(dag_ids)s, %(run_ids)s, %(task_ids)s, %(tries)s,
-- read from its metadata database) with no attempt row of a successful outcome.
SELECT t.dag_id, t.run_id, t.task_id, t.try_number, NULL::text AS run_key
FROM unnest(%(dag_ids)s::text[], %(run_ids)s::text[], %(task_ids)s::text[], %(tries)s::int[])
  AS t(dag_id, run_id, task_id, try_number)
WHERE NOT EXISTS (
    SELECT FROM idempotency.job_run_attempts AS a
    WHERE a.dag_id = t.dag_id AND a.run_id = t.run_id AND a.task_id = t.task_id
      AND a.try_number = t.try_number AND a.outcome IN ('completed', 'noop', 'dry_run')
)
ORDER BY 1, 2, 3, 4;
