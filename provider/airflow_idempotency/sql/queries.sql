-- Every statement this provider runs, by name. Loaded once by _sql.py.
-- Named parameters only: nothing here is ever built by string formatting. {schema} is the
-- bookkeeping schema, a validated identifier quoted by psycopg.sql when the file is loaded:
-- every name is qualified, so no statement depends on a session's search_path (a pooled
-- server connection may carry another client's, see docs/deploying.md).
-- Times are statement_timestamp(), never now(): some statements run in the lock
-- transaction, which began when the run did, and now() is the start of the transaction.
-- Row locks: a transaction that locks a key's job_runs row and rows of its job_run_attempts
-- locks the run's row first (start_attempt, complete_attempt, mark_failed before
-- finish_attempt: run_failures.record_failure); the other order deadlocks with a successor's
-- start (tests/integration/test_lock_order.py).

-- name: acquire_run_lock
-- The first statement of the lock transaction (locks.hold_run_lock), which runs READ COMMITTED
-- whatever the database's default: it takes no snapshot between statements, so it holds back no
-- vacuum however long the run, and its completion reads the start the work connection committed.
-- It tries the run lock for the length of this transaction, names the session in
-- pg_stat_activity, lifts idle_in_transaction_session_timeout and (PostgreSQL 17+)
-- transaction_timeout, bounds a dead peer (bound_dead_peer, migration 6) and every lock wait of
-- the provider's statements in it (lock_timeout). Every setting is transaction-local: nothing
-- outlives it on a pooled server connection. holder names the lock transaction itself (its
-- virtual transaction id, migration 8): with the pid, what the fencing checks compare, since a
-- pid alone is reused.
-- already_held is read first (the MATERIALIZED CTE is scanned before the SELECT list runs):
-- a session that already holds the key before this transaction tried it is shared with
-- another client (a session-level lock left on a pooled server connection), and taking the
-- lock "again" there would succeed without excluding anyone.
WITH before AS MATERIALIZED (
    SELECT EXISTS (
        SELECT 1 FROM {schema}.held_run_locks() AS h
        WHERE h.lock_key = %(lock_key)s AND h.pid = pg_backend_pid()
    ) AS already_held
)
SELECT before.already_held,
       pg_try_advisory_xact_lock(%(lock_key)s) AS acquired,
       pg_backend_pid() AS backend_pid,
       (SELECT l.virtualtransaction FROM pg_catalog.pg_lock_status() AS l
        WHERE l.pid = pg_backend_pid() AND l.locktype = 'virtualxid' LIMIT 1) AS holder,
       set_config('lock_timeout', %(lock_wait_ms)s, true) AS lock_timeout,
       set_config('application_name', %(application_name)s, true) AS application_name,
       set_config('idle_in_transaction_session_timeout', '0', true) AS idle_timeout,
       -- CASE evaluates lazily: older servers do not know the setting and would refuse it
       CASE WHEN current_setting('server_version_num')::integer >= 170000
            THEN set_config('transaction_timeout', '0', true) END AS transaction_timeout,
       {schema}.bound_dead_peer(%(keepalives_idle)s, %(keepalives_interval)s,
                                %(keepalives_count)s, %(tcp_user_timeout)s) AS dead_peer
FROM before;

-- name: decide
-- The first round trip of a run's lock transaction (the advisory mode, run_steps.Run._decide):
-- its BEGIN and run_decide() (migration 16: zone check, run lock, read, the no-op's record)
-- in ONE simple-protocol message, values bound by psycopg's client-side cursor. One message,
-- not a pipeline: a connection pooler that refuses the transaction (statement mode) or gives
-- up waiting for a server connection (query_wait_timeout) then closes the connection with
-- nothing of the client's left unread, so its error reaches the client (pipelined statements
-- after the BEGIN would reset the connection, and the pooler's words would be lost).
-- The row comes back as one JSON text (timestamps in ISO 8601 whatever the DateStyle): one
-- column to load instead of 21, the cheapest form for the client (run_steps.decide parses it).
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT row_to_json(d)::text
FROM {schema}.run_decide(%(lock_key)s, %(job_name)s, %(run_key)s, %(force)s,
                         %(key_zone)s, %(session)s, %(attempt)s) AS d;

-- name: run_lock_holder
-- Who holds a run lock, in one round trip: the session (from pg_stat_activity) and the
-- attempt it runs, as recorded by that attempt itself (host and pid of the worker).
SELECT a.pid,
       a.application_name,
       host(a.client_addr) AS client_addr,
       a.client_hostname,
       coalesce(a.client_hostname, host(a.client_addr),
                CASE a.client_port WHEN -1 THEN 'local socket' ELSE 'not shown to this role' END)
           AS client,
       a.usename AS user_name,
       a.backend_start,
       a.state,
       a.state_change,
       -- the holder's attempt, prefixed: the runner nests these under "attempt"
       att.attempt_id AS attempt_attempt_id,
       att.hostname AS attempt_hostname,
       att.pid AS attempt_pid,
       att.started_at AS attempt_started_at,
       att.dag_id AS attempt_dag_id,
       att.run_id AS attempt_run_id,
       att.task_id AS attempt_task_id,
       att.try_number AS attempt_try_number,
       att.triggered_by AS attempt_triggered_by
FROM {schema}.held_run_locks() AS h
JOIN pg_stat_activity AS a ON a.pid = h.pid
LEFT JOIN LATERAL (
    SELECT attempt_id, hostname, pid, started_at, dag_id, run_id, task_id, try_number,
           triggered_by
    FROM {schema}.job_run_attempts
    WHERE lock_key = %(lock_key)s AND lock_backend_pid = a.pid AND outcome = 'running'
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
WHERE h.lock_key = %(lock_key)s;

-- name: lock_is_held_by
-- Fencing check, from any session: does the lock transaction that took the lock still hold it?
SELECT {schema}.run_lock_held_by(%(lock_key)s, %(lock_backend_pid)s, %(lock_holder)s) AS held;

-- name: fence_enter
-- The first statement of every fenced transaction (RunContext.transaction(), the ledger's claims):
-- see migrations 6 and 8. Raises SQLSTATE IF001 when this attempt's lock transaction no longer
-- holds the run lock, IF002 when the fence was not free within lock_wait_ms; arms the check at
-- COMMIT; bounds a dead peer for the rest of the transaction.
SELECT {schema}.fence_enter(%(lock_key)s, %(lock_backend_pid)s, %(lock_holder)s,
                            %(attempt_id)s, %(lock_wait_ms)s),
       {schema}.bound_dead_peer(%(keepalives_idle)s, %(keepalives_interval)s,
                                %(keepalives_count)s, %(tcp_user_timeout)s);

-- name: fence_arm
-- The last statement before COMMIT of a read-write fenced transaction (sent with the COMMIT):
-- arms the commit-time check of migration 6 again, so that it runs after the work's own deferred
-- triggers (fence_enter armed it first).
SELECT {schema}.fence_arm(%(lock_key)s, %(lock_backend_pid)s, %(lock_holder)s, %(attempt_id)s);

-- name: fence_take_over
-- The first statement of an attempt's start: waits until every fenced transaction of the key's
-- previous attempts has ended (at most lock_wait_ms, then IF002 naming them), and forgets their
-- arms (migrations 6 and 8); then refuses (IF001) unless this attempt's lock transaction
-- still holds the run lock (migration 12). Every lock wait of the start's transaction is
-- bounded by it.
SELECT {schema}.fence_take_over(%(lock_key)s, %(lock_wait_ms)s, %(lock_backend_pid)s,
                                %(lock_holder)s),
       {schema}.bound_dead_peer(%(keepalives_idle)s, %(keepalives_interval)s,
                                %(keepalives_count)s, %(tcp_user_timeout)s);

-- name: lease_acquire
-- The lease mode (migration 14): take the key's lease, in one short transaction, when the key
-- has no lease or its lease expired (clock_timestamp(): the server's clock). The same
-- transaction tries the key's advisory run lock for its own length: a run of the advisory mode
-- holding the key refuses the lease, two workers taking the lease at once exclude each other,
-- and a session-level lock left on a pooled server connection is seen (already_held) as in
-- acquire_run_lock. A takeover draws a new token (run_lease_tokens): the fencing token the
-- fence compares (holder 'lease:<token>'). token is NULL when the lease was not taken.
WITH before AS MATERIALIZED (
    SELECT EXISTS (
        SELECT 1 FROM {schema}.held_run_locks() AS h
        WHERE h.lock_key = %(lock_key)s AND h.pid = pg_backend_pid()
    ) AS already_held
),
advisory AS MATERIALIZED (
    SELECT before.already_held, pg_try_advisory_xact_lock(%(lock_key)s) AS free FROM before
),
taken AS (
    INSERT INTO {schema}.run_leases AS l (lock_key, holder, acquired_at, renewed_at, expires_at)
    SELECT %(lock_key)s, %(holder)s, clock_timestamp(), clock_timestamp(),
           clock_timestamp() + make_interval(secs => %(ttl)s)
    FROM advisory
    WHERE advisory.free AND NOT advisory.already_held
    ON CONFLICT (lock_key) DO UPDATE
    SET token = EXCLUDED.token, holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at,
        renewed_at = EXCLUDED.renewed_at, expires_at = EXCLUDED.expires_at
    WHERE l.expires_at <= clock_timestamp()
    RETURNING l.token, l.expires_at
)
SELECT advisory.already_held, advisory.free, taken.token, taken.expires_at
FROM advisory LEFT JOIN taken ON true;

-- name: decide_lease
-- The decision of a run of the lease mode (lease_run.decide_lease): its BEGIN, run_decide_lease()
-- (migration 19: zone check, the key's advisory run lock for this transaction, a live lease
-- refused, the read, the no-op's record without a lease, or the lease taken) and its COMMIT in
-- ONE simple-protocol message, values bound by psycopg's client-side cursor: one round trip, and
-- a pooler's refusal reaches the client (see decide). The row comes back as one JSON text, as
-- decide's does (lease_run.decide_lease parses it).
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT row_to_json(d)::text
FROM {schema}.run_decide_lease(%(lock_key)s, %(job_name)s, %(run_key)s, %(force)s,
                               %(key_zone)s, %(session)s, %(attempt)s) AS d;
COMMIT;

-- name: lease_release_at_commit
-- The last statement of the lease mode's completion (after fence_arm, before its COMMIT): the
-- lease is released AT that COMMIT, after the fence's check there (migration 19's deferred
-- trigger on lease_releases), and only when the completion wrote (complete_attempt_lease
-- found the run still this attempt's): a completion refused at COMMIT releases nothing.
INSERT INTO {schema}.lease_releases (lock_key, token, lock_holder)
SELECT %(lock_key)s, %(token)s, %(lock_holder)s
WHERE EXISTS (
    SELECT 1 FROM {schema}.job_run_attempts
    WHERE attempt_id = %(attempt_id)s AND outcome = 'completed'
);

-- name: lease_renew
-- The heartbeat of a lease (a short transaction on a borrowed connection): extends it while it
-- is still this acquisition's (its token), expired or not (migration 18: a lease is held until
-- another run takes the key over; expiry only allows that). No row back: the key was taken
-- over or released, and the lease is lost for good.
UPDATE {schema}.run_leases
SET renewed_at = clock_timestamp(),
    expires_at = greatest(expires_at, clock_timestamp() + make_interval(secs => %(ttl)s))
WHERE lock_key = %(lock_key)s AND token = %(token)s
RETURNING expires_at;

-- name: lease_release
-- The end of a run of the lease mode, after its outcome committed: the lease goes (if it is
-- still this acquisition's) with the commit-time checks of its fenced transactions (spent).
-- One simple-protocol message in autocommit, no transaction block: it works through a pooler
-- in statement mode too (whose refusal of the run's start must not leave the key leased until
-- the lease expires). Its two statements run in the message's one implicit transaction, each
-- parsed just before it runs: the set_config (local to that transaction) bounds every lock
-- wait of the DELETE, its tables' locks too, which are taken when it is parsed (a set_config
-- inside the DELETE ran after them: an ALTER TABLE queued behind a long reader held it up for
-- as long; adv34). Sent by a client-side cursor (leases.release_lease): the DELETE's row is
-- its second result.
SELECT set_config('lock_timeout', %(lock_wait_ms)s, true);
WITH disarmed AS (
    DELETE FROM {schema}.fence_arms
    WHERE lock_key = %(lock_key)s AND lock_holder = %(lock_holder)s
)
DELETE FROM {schema}.run_leases
WHERE lock_key = %(lock_key)s AND token = %(token)s
RETURNING token;

-- name: lease_live
-- Whether a key has a live lease (the lease mode): the CLI's reset, an operator's resolution
-- of an effect and adopt, which hold the key's advisory run lock for their transaction (so no
-- lease can be taken meanwhile: lease_acquire tries that lock), are refused while one is live.
-- An expired lease is taken over by them: its row goes, so that its holder, whose lease is
-- held until taken over (migration 18), can never commit again.
-- Locks in the order of the runs' own transactions (tests/integration/test_lease_adversary2.py):
-- - the run's row FIRST (FOR UPDATE), before the lease's: the holder's completion locks the run
--   (complete_attempt_lease), then deletes its lease at its COMMIT (lease_release_on_commit);
--   the other order deadlocked a reset with the completion of the lease it took over;
-- - an expired lease is taken over under the key's fence key EXCLUSIVE, as a start takes a key
--   over (fence_take_over; an advisory start deletes an expired lease under it too): tried,
--   never awaited, and a key whose fence key is busy (the holder has a fenced transaction or a
--   start open right now: it is still working) is answered live. Without it the holder's
--   start, which checks its lease before it waits for the run's row, passed its check while
--   the lease's deletion was not committed yet, then waited for adopt's row and overwrote the
--   adopted, completed run with 'started'. The fence key is held until the caller's COMMIT:
--   a start or fenced transaction of the holder then finds its lease gone (IF001).
WITH now AS MATERIALIZED (SELECT clock_timestamp() AS at),
run AS MATERIALIZED (
    SELECT 1 FROM {schema}.job_runs AS r
    WHERE r.job_name = %(job_name)s AND r.run_key = %(run_key)s
    FOR UPDATE OF r
),
lease AS MATERIALIZED (
    SELECT l.expires_at > now.at AS live
    FROM {schema}.run_leases AS l, now
    WHERE l.lock_key = %(lock_key)s
      AND (SELECT count(*) FROM run) >= 0  -- the run's row locked before the lease's
),
fence AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(k.hi, k.lo) AS free
    FROM {schema}.fence_key(%(lock_key)s) AS k
    WHERE EXISTS (SELECT 1 FROM lease WHERE NOT lease.live)
),
broken AS (
    DELETE FROM {schema}.run_leases AS l
    USING now
    WHERE l.lock_key = %(lock_key)s AND l.expires_at <= now.at
      AND (SELECT bool_and(fence.free) FROM fence)
)
SELECT EXISTS (SELECT 1 FROM lease WHERE lease.live)
       OR NOT coalesce((SELECT bool_and(fence.free) FROM fence), true) AS live;

-- name: lease_holder
-- Who holds a key's lease, for the refusal message: the worker, since when, until when, and
-- the attempt it runs (the newest running attempt of the key).
SELECT l.token, l.holder, l.acquired_at, l.renewed_at, l.expires_at,
       att.attempt_id AS attempt_attempt_id,
       att.hostname AS attempt_hostname,
       att.pid AS attempt_pid,
       att.started_at AS attempt_started_at,
       att.dag_id AS attempt_dag_id,
       att.run_id AS attempt_run_id,
       att.task_id AS attempt_task_id,
       att.try_number AS attempt_try_number,
       att.triggered_by AS attempt_triggered_by
FROM {schema}.run_leases AS l
LEFT JOIN LATERAL (
    SELECT attempt_id, hostname, pid, started_at, dag_id, run_id, task_id, try_number,
           triggered_by
    FROM {schema}.job_run_attempts
    WHERE lock_key = l.lock_key AND outcome = 'running'
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
WHERE l.lock_key = %(lock_key)s AND l.expires_at > clock_timestamp();

-- name: bound_lock_waits
-- The first statement of a transaction of the provider's own (after fence_enter in a fenced one):
-- every lock wait in it ends after lock_wait_ms with lock_not_available (55P03).
SELECT set_config('lock_timeout', %(lock_wait_ms)s, true);

-- name: bookkeeping_lock_holders
-- Who holds, or waits for, a lock on a table of the bookkeeping schema that a writer or a
-- reader of it would queue behind (for the message of a lock wait that reached its bound): a
-- migration's ALTER (granted or pending), an explicit table lock. Error paths only (percent signs
-- doubled: psycopg's placeholders).
SELECT format('backend pid %%s (application_name %%L, %%s %%s on %%s)', l.pid,
              coalesce(a.application_name, ''), CASE WHEN l.granted THEN 'holds' ELSE 'awaits' END,
              l.mode, c.relname) AS holder
FROM pg_catalog.pg_locks AS l
JOIN pg_catalog.pg_class AS c ON c.oid = l.relation
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
WHERE n.nspname = %(schema)s
  AND l.pid <> pg_backend_pid()
  AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
ORDER BY l.pid, c.relname;

-- name: completed_by_this_dag_run
-- The attempt that completed the key, when it ran in this very DAG run, task, map index and
-- clear, in an earlier try: a retry of a forced run reads it (its force was honoured by an
-- earlier try). An earlier try, not the same one: a DAG run deleted and triggered again for
-- its logical date has the same run id and clear number, and starts again at try 1.
SELECT a.attempt_id, a.try_number
FROM {schema}.job_runs AS r
JOIN {schema}.job_run_attempts AS a ON a.attempt_id = r.current_attempt_id
WHERE r.job_name = %(job_name)s AND r.run_key = %(run_key)s AND r.status = 'completed'
  AND a.outcome = 'completed' AND a.dag_id = %(dag_id)s AND a.run_id = %(run_id)s
  AND a.task_id = %(task_id)s AND a.map_index IS NOT DISTINCT FROM %(map_index)s::integer
  AND a.clear_number IS NOT DISTINCT FROM %(clear_number)s::integer
  AND a.try_number < %(try_number)s::integer;

-- name: get_run
-- completed_counts: what the completing attempt's work returned (details also keeps what
-- earlier attempts and resets added, e.g. last_error), the value a no-op passes on.
SELECT job_name, run_key, status, triggered_by, triggering_user, dag_id, run_id, task_id,
       attempt_count, current_attempt_id, started_at, completed_at, updated_at, details,
       (SELECT a.details -> 'counts' FROM {schema}.job_run_attempts AS a
        WHERE a.attempt_id = r.current_attempt_id AND r.status = 'completed') AS completed_counts
FROM {schema}.job_runs AS r
WHERE job_name = %(job_name)s AND run_key = %(run_key)s;

-- name: key_zone_conflict
-- The other zones the job's run keys were made in, if any (the DAG's timezone changed since,
-- or is written another way: key_zone.py tells which): each zone, its latest key and how
-- many keys it holds, most keys first. job_runs_key_zone_idx serves it.
SELECT key_zone, max(run_key) AS run_key, count(*) AS keys
FROM {schema}.job_runs
WHERE job_name = %(job_name)s AND key_zone IS NOT NULL AND key_zone <> %(key_zone)s
GROUP BY key_zone
ORDER BY keys DESC, key_zone;

-- name: insert_attempt
INSERT INTO {schema}.job_run_attempts (
    job_name, run_key, lock_key, outcome, triggered_by, triggering_user,
    dag_id, run_id, task_id, try_number, map_index, hostname, pid, lock_backend_pid,
    force, dry_run, started_at, finished_at, error, details,
    ti_id, run_type, clear_number, dag_version_id
) VALUES (
    %(job_name)s, %(run_key)s, %(lock_key)s, %(outcome)s, %(triggered_by)s, %(triggering_user)s,
    %(dag_id)s, %(run_id)s, %(task_id)s, %(try_number)s, %(map_index)s, %(hostname)s, %(pid)s,
    %(lock_backend_pid)s, %(force)s, %(dry_run)s, statement_timestamp(),
    CASE WHEN %(outcome)s = 'running' THEN NULL ELSE statement_timestamp() END,
    %(error)s, %(trigger_details)s || %(details)s,
    %(ti_id)s, %(run_type)s, %(clear_number)s, %(dag_version_id)s
)
RETURNING attempt_id;

-- name: finish_attempt
-- An attempt that is no longer running was closed by someone else meanwhile (a successor
-- that took the key over closes it as abandoned, lock_lost): that record stays, and what
-- this attempt learnt late about itself is added to its details.
UPDATE {schema}.job_run_attempts
SET outcome = CASE WHEN outcome = 'running' THEN %(outcome)s ELSE outcome END,
    finished_at = CASE WHEN outcome = 'running' THEN statement_timestamp() ELSE finished_at END,
    error = CASE WHEN outcome = 'running' THEN %(error)s ELSE error END,
    details = details || %(details)s || CASE
        WHEN outcome = 'running' THEN jsonb_build_object()
        ELSE jsonb_build_object('late_outcome', %(outcome)s::text, 'late_error', %(error)s::text)
    END
WHERE attempt_id = %(attempt_id)s;

-- name: start_attempt
-- One statement, one commit: record this execution as running and take job_runs over for it.
-- Never a bare INSERT into job_runs: a rerun of a failed or crashed key takes the existing
-- row over. This attempt holds the lock, so any other attempt of the key still marked
-- running died without finishing (a killed worker): close it. (The UPDATE does not see the
-- row inserted by the same statement.)
-- A run found completed is not taken over unless forced: the attempt is recorded as a
-- finished 'noop', nothing else is written, and the row returns the run as sql: get_run
-- reads it (completed_run: the no-op's result, run_steps.Run._start). The decision read the
-- run BEFORE this start's fence_take_over waited for the previous attempt's open
-- transactions: a completion that passed its commit-time check while its lease was still its
-- holder's can become visible only then (a slow COMMIT: a synchronous standby). This
-- statement's snapshot is taken after that wait, under the exclusive fence key, so it sees
-- such a completion (FOR UPDATE: the row read is the row the upsert below finds).
WITH found AS (
    SELECT r.status, r.triggered_by, r.triggering_user, r.dag_id, r.run_id, r.task_id,
           r.attempt_count, r.current_attempt_id, r.started_at, r.completed_at, r.updated_at,
           r.details,
           (SELECT a.details -> 'counts' FROM {schema}.job_run_attempts AS a
            WHERE a.attempt_id = r.current_attempt_id AND r.status = 'completed')
               AS completed_counts,
           r.status = 'completed' AND NOT %(force)s AS noop
    FROM {schema}.job_runs AS r
    WHERE r.job_name = %(job_name)s AND r.run_key = %(run_key)s
    FOR UPDATE OF r
),
decided AS (
    SELECT coalesce(bool_or(found.noop), false) AS noop, max(found.completed_at) AS completed_at
    FROM found
),
attempt AS (
    INSERT INTO {schema}.job_run_attempts (
        job_name, run_key, lock_key, outcome, triggered_by, triggering_user,
        dag_id, run_id, task_id, try_number, map_index, hostname, pid, lock_backend_pid,
        force, dry_run, started_at, finished_at, details, ti_id, run_type, clear_number,
        dag_version_id
    ) VALUES (
        %(job_name)s, %(run_key)s, %(lock_key)s,
        CASE WHEN (SELECT noop FROM decided) THEN 'noop' ELSE 'running' END, %(triggered_by)s,
        %(triggering_user)s, %(dag_id)s, %(run_id)s, %(task_id)s, %(try_number)s,
        %(map_index)s, %(hostname)s, %(pid)s, %(lock_backend_pid)s, %(force)s, false,
        statement_timestamp(),
        CASE WHEN (SELECT noop FROM decided) THEN statement_timestamp() END,
        %(trigger_details)s || (
            SELECT CASE WHEN noop
                THEN jsonb_build_object('completed_at', completed_at,
                                        'completed_before_start', true)
                ELSE jsonb_build_object() END
            FROM decided
        ),
        %(ti_id)s, %(run_type)s, %(clear_number)s, %(dag_version_id)s
    )
    RETURNING attempt_id, outcome
),
abandoned AS (
    UPDATE {schema}.job_run_attempts
    SET outcome = 'lock_lost', finished_at = statement_timestamp(),
        error = 'abandoned: the worker ended without finishing; taken over by attempt '
                || (SELECT attempt_id FROM attempt)::text
    WHERE job_name = %(job_name)s AND run_key = %(run_key)s AND outcome = 'running'
      AND (SELECT outcome FROM attempt) = 'running'
    RETURNING attempt_id
),
run AS (
    INSERT INTO {schema}.job_runs (
        job_name, run_key, lock_key, status, triggered_by, triggering_user, dag_id, run_id,
        task_id, attempt_count, current_attempt_id, started_at, updated_at, key_zone
    )
    SELECT %(job_name)s, %(run_key)s, %(lock_key)s, 'started', %(triggered_by)s,
           %(triggering_user)s, %(dag_id)s, %(run_id)s, %(task_id)s, 1, attempt.attempt_id,
           statement_timestamp(), statement_timestamp(), %(key_zone)s
    FROM attempt
    WHERE attempt.outcome = 'running'
    ON CONFLICT (job_name, run_key) DO UPDATE
    SET status = 'started',
        key_zone = coalesce(EXCLUDED.key_zone, job_runs.key_zone),
        triggered_by = EXCLUDED.triggered_by,
        triggering_user = EXCLUDED.triggering_user,
        dag_id = EXCLUDED.dag_id,
        run_id = EXCLUDED.run_id,
        task_id = EXCLUDED.task_id,
        attempt_count = job_runs.attempt_count + 1,
        current_attempt_id = EXCLUDED.current_attempt_id,
        started_at = statement_timestamp(),
        completed_at = NULL,
        updated_at = statement_timestamp()
    RETURNING attempt_count
)
SELECT attempt.attempt_id, coalesce(run.attempt_count, found.attempt_count) AS attempt_count,
       (SELECT count(*) FROM abandoned) AS abandoned,
       CASE WHEN found.noop THEN to_jsonb(found) - 'noop' END AS completed_run
FROM attempt
LEFT JOIN run ON true
LEFT JOIN found ON true;

-- name: complete_attempt
-- Fenced, one statement: mark the run completed only for the attempt that owns it, and only
-- while this very session holds the lock; close the attempt in the same statement. It runs
-- in the lock transaction, whose COMMIT then records the completion and releases the lock
-- at the same instant. No row back means the attempt no longer owns the run or its lock,
-- and nothing changed.
WITH run AS (
    UPDATE {schema}.job_runs
    SET status = 'completed', completed_at = statement_timestamp(), updated_at = statement_timestamp(),
        details = details || %(details)s
    WHERE job_name = %(job_name)s
      AND run_key = %(run_key)s
      AND current_attempt_id = %(attempt_id)s
      AND status = 'started'
      -- this statement runs on the lock's own backend, and that backend holds the lock
      AND pg_backend_pid() = %(lock_backend_pid)s
      AND EXISTS (
          SELECT 1 FROM {schema}.held_run_locks() AS h
          WHERE h.lock_key = %(lock_key)s AND h.pid = %(lock_backend_pid)s
      )
    RETURNING completed_at
),
attempt AS (
    UPDATE {schema}.job_run_attempts
    SET outcome = 'completed', finished_at = statement_timestamp(), error = NULL,
        details = details || jsonb_build_object('counts', %(details)s)
    WHERE attempt_id = %(attempt_id)s AND EXISTS (SELECT 1 FROM run)
),
-- the commit-time checks of this attempt's fenced transactions are spent (migration 6)
disarmed AS (
    DELETE FROM {schema}.fence_arms WHERE lock_key = %(lock_key)s AND EXISTS (SELECT 1 FROM run)
)
SELECT completed_at FROM run;

-- name: complete_attempt_lease
-- The completion of the lease mode, in a fenced transaction (fence_enter with its BEGIN, the
-- check at its COMMIT: the lease must still be this attempt's): mark the run completed only for
-- the attempt that owns it, and close the attempt. No row back means the attempt no longer owns
-- the run, and nothing changed. The lease is released at its COMMIT (lease_release_at_commit,
-- its last statement: the completion, the fence's check and the release in one message).
WITH run AS (
    UPDATE {schema}.job_runs
    SET status = 'completed', completed_at = statement_timestamp(), updated_at = statement_timestamp(),
        details = details || %(details)s
    WHERE job_name = %(job_name)s
      AND run_key = %(run_key)s
      AND current_attempt_id = %(attempt_id)s
      AND status = 'started'
    RETURNING completed_at
),
attempt AS (
    UPDATE {schema}.job_run_attempts
    SET outcome = 'completed', finished_at = statement_timestamp(), error = NULL,
        details = details || jsonb_build_object('counts', %(details)s)
    WHERE attempt_id = %(attempt_id)s AND EXISTS (SELECT 1 FROM run)
)
SELECT completed_at FROM run;

-- name: mark_failed
UPDATE {schema}.job_runs
SET status = 'failed', updated_at = statement_timestamp(),
    details = details || jsonb_build_object('last_error', %(error)s::text)
WHERE job_name = %(job_name)s
  AND run_key = %(run_key)s
  AND current_attempt_id = %(attempt_id)s
  AND status = 'started'
RETURNING updated_at;

-- name: ledger_claim_batch
-- Set-based: insert the batch's new keys as pending (existing keys untouched) and return,
-- for every key that needs something, its status and fingerprint as they were before this
-- statement: new keys (status NULL), pending and failed ones, and any key whose stored
-- fingerprint differs (reused for another request). A key confirmed ('succeeded') for the
-- same fingerprint is not returned: the caller counts it as skipped.
-- Only keys without a row (status is NOT NULL in the table) go to the INSERT: a speculative
-- insert of a known key would still draw its ledger_id from the sequence, whose WAL record
-- every 32 values makes the claim's commit flush to disk. ON CONFLICT DO NOTHING stays for
-- keys inserted concurrently after this statement's snapshot.
-- The arrays are bound in binary format: no quoting or escaping of 2 x N strings.
-- Each key is looked up on its own (LATERAL ... LIMIT 1; the key is unique anyway): with
-- statistics taken while the ledger was small (e.g. right after a first large export) a
-- plain join was planned as a hash join over every row of the remote system, ~80-150 ms a
-- batch at 100,000 rows instead of ~2 ms.
WITH known AS (
    SELECT i.idempotency_key, i.request_fingerprint, l.status,
           l.request_fingerprint AS stored_fingerprint
    FROM unnest(%(keys)b::text[], %(fingerprints)b::text[]) AS i(idempotency_key, request_fingerprint)
    LEFT JOIN LATERAL (
        SELECT o.status, o.request_fingerprint
        FROM {schema}.outbound_ledger AS o
        WHERE o.remote_system = %(remote_system)s AND o.idempotency_key = i.idempotency_key
        LIMIT 1
    ) AS l ON true
),
inserted AS (
    INSERT INTO {schema}.outbound_ledger (
        remote_system, idempotency_key, job_name, run_key, request_fingerprint, last_attempt_id,
        effect_kind, deduplicating
    )
    SELECT %(remote_system)s, k.idempotency_key, %(job_name)s, %(run_key)s,
           k.request_fingerprint, %(attempt_id)s, %(effect_kind)s, %(deduplicating)s
    FROM known AS k
    WHERE k.status IS NULL
    ON CONFLICT (remote_system, idempotency_key) DO NOTHING
)
SELECT k.idempotency_key, k.status, k.stored_fingerprint
FROM known AS k
WHERE k.status IS DISTINCT FROM 'succeeded'
   OR k.stored_fingerprint <> k.request_fingerprint;

-- name: ledger_classify_batch
-- Read-only twin of ledger_claim_batch, for dry runs: the same rows, nothing written.
SELECT i.idempotency_key, l.status, l.request_fingerprint
FROM unnest(%(keys)b::text[], %(fingerprints)b::text[]) AS i(idempotency_key, request_fingerprint)
LEFT JOIN LATERAL (
    SELECT o.status, o.request_fingerprint
    FROM {schema}.outbound_ledger AS o
    WHERE o.remote_system = %(remote_system)s AND o.idempotency_key = i.idempotency_key
    LIMIT 1
) AS l ON true
WHERE l.status IS DISTINCT FROM 'succeeded'
   OR l.request_fingerprint <> i.request_fingerprint;

-- name: ledger_record_outcomes
-- One statement for a whole batch of call outcomes. A confirmation is always recorded
-- (it is a fact about the remote, whoever holds the lock); a row already succeeded is
-- never moved back to pending or failed.
UPDATE {schema}.outbound_ledger AS l
SET status = CASE WHEN l.status = 'succeeded' THEN 'succeeded' ELSE o.status END,
    remote_reference = coalesce(o.remote_reference, l.remote_reference),
    call_count = l.call_count + o.calls,
    -- A row already confirmed keeps naming the attempt that confirmed it, without error.
    last_error = CASE WHEN o.status = 'succeeded' THEN NULL
                      WHEN l.status = 'succeeded' THEN l.last_error
                      ELSE o.error END,
    last_attempt_id = CASE WHEN l.status = 'succeeded' AND o.status <> 'succeeded'
                           THEN l.last_attempt_id ELSE %(attempt_id)s END,
    updated_at = statement_timestamp(),
    confirmed_at = CASE WHEN o.status = 'succeeded' AND l.confirmed_at IS NULL THEN statement_timestamp()
                        ELSE l.confirmed_at END
FROM unnest(
    %(keys)s::text[], %(statuses)s::text[], %(references)s::text[], %(errors)s::text[],
    %(calls)s::int[]
) AS o(idempotency_key, status, remote_reference, error, calls)
WHERE l.remote_system = %(remote_system)s AND l.idempotency_key = o.idempotency_key;


-- name: ledger_rows_for_run
SELECT idempotency_key, status, request_fingerprint, remote_reference, call_count, last_error
FROM {schema}.outbound_ledger
WHERE job_name = %(job_name)s AND run_key = %(run_key)s AND remote_system = %(remote_system)s
ORDER BY idempotency_key;

-- name: ledger_record_intents
-- A not-deduplicating remote (SMTP, a chat webhook, a notifier): the intent, committed before
-- the call. Only keys neither confirmed nor already unknown move to 'unknown'; the keys returned
-- are the ones this attempt may call now (one another attempt took meanwhile, or an operator
-- resolved, is not returned: the row lock and this WHERE decide, never a read before). The
-- outcome replaces 'unknown' after the call (ledger_record_outcomes); a crash in between leaves
-- it, with this text saying so.
UPDATE {schema}.outbound_ledger AS l
SET status = 'unknown', intent_at = statement_timestamp(), updated_at = statement_timestamp(),
    last_attempt_id = %(attempt_id)s::bigint,
    last_error = 'the call began (attempt ' || coalesce(%(attempt_id)s::bigint::text, 'none')
                 || ') and no outcome was recorded: it may have happened'
WHERE l.remote_system = %(remote_system)s
  AND l.idempotency_key = ANY(%(keys)s::text[])
  AND l.status IN ('pending', 'failed')
RETURNING l.idempotency_key;

-- name: ledger_restage_output
-- An output file about to be committed (effects/outputs.py): its row takes this content's fingerprint
-- when the content it had was never committed (pending, failed: an attempt that crashed between
-- the write and the record), or, in a forced run, even when it was (succeeded): the claim then
-- finds the row pending for this very content and the ledger moves the file into place.
UPDATE {schema}.outbound_ledger
SET request_fingerprint = %(fingerprint)s, status = 'pending', last_error = NULL,
    last_attempt_id = %(attempt_id)s, updated_at = statement_timestamp()
WHERE remote_system = %(remote_system)s AND idempotency_key = %(key)s
  AND ((status IN ('pending', 'failed') AND request_fingerprint <> %(fingerprint)s)
       OR (%(force)s AND status = 'succeeded'));

-- name: ledger_effect
-- One effect by its key (the CLI; its job and run key name the lock a resolution takes).
SELECT ledger_id, remote_system, idempotency_key, job_name, run_key, status, effect_kind,
       deduplicating, intent_at, last_attempt_id, last_error
FROM {schema}.outbound_ledger
WHERE remote_system = %(remote_system)s AND idempotency_key = %(key)s;

-- name: ledger_effect_for_update
-- One effect, locked for an operator's resolution (the CLI's ledger mark-sent / resend).
SELECT ledger_id, remote_system, idempotency_key, job_name, run_key, status, effect_kind,
       deduplicating, intent_at, last_attempt_id, last_error
FROM {schema}.outbound_ledger
WHERE remote_system = %(remote_system)s AND idempotency_key = %(key)s
FOR UPDATE;

-- name: ledger_call_in_flight
-- The call of an unknown effect that may still be in flight: its intent is younger than
-- %(bound)s seconds and the attempt that recorded it has not said it ended (a worker that
-- lost its lock, or was paused, may still be calling; a callback's intent, with no attempt:
-- its age alone). No row: no call of it can still be under way.
SELECT l.intent_at, l.last_attempt_id, a.hostname, a.pid,
       extract(epoch FROM statement_timestamp() - l.intent_at)::float8 AS age_seconds
FROM {schema}.outbound_ledger AS l
LEFT JOIN {schema}.job_run_attempts AS a ON a.attempt_id = l.last_attempt_id
WHERE l.ledger_id = %(ledger_id)s
  AND l.intent_at > statement_timestamp() - make_interval(secs => %(bound)s)
  AND (a.attempt_id IS NULL OR a.outcome = 'running'
       -- closed by a successor (start_attempt: "abandoned"), not by its own worker, which
       -- adds its late outcome when it does end
       OR (a.error LIKE 'abandoned:%%' AND NOT a.details ? 'late_outcome'));

-- name: ledger_resolve_unknown
-- An operator's explicit choice for an effect left unknown, audited in one statement: the row
-- moves (mark_sent: succeeded; resend: pending, sent by the next run of its key) only if it is
-- still unknown, and the resolution row records who, when, why and what it was.
WITH moved AS (
    UPDATE {schema}.outbound_ledger
    SET status = CASE WHEN %(action)s = 'mark_sent' THEN 'succeeded' ELSE 'pending' END,
        confirmed_at = CASE WHEN %(action)s = 'mark_sent' THEN statement_timestamp()
                            ELSE confirmed_at END,
        remote_reference = CASE WHEN %(action)s = 'mark_sent'
                                THEN coalesce(remote_reference, 'marked sent by ' || %(resolved_by)s)
                                ELSE remote_reference END,
        last_error = CASE WHEN %(action)s = 'mark_sent' THEN NULL
                          ELSE 'resend chosen by ' || %(resolved_by)s || ': ' || %(reason)s END,
        updated_at = statement_timestamp()
    WHERE ledger_id = %(ledger_id)s AND status = 'unknown'
    RETURNING ledger_id
)
INSERT INTO {schema}.outbound_ledger_resolutions (ledger_id, action, previous_status, resolved_by, reason)
SELECT moved.ledger_id, %(action)s, 'unknown', %(resolved_by)s, %(reason)s FROM moved
RETURNING resolution_id, resolved_at;

-- name: ledger_resolutions
-- The audit of an effect's resolutions, oldest first.
SELECT r.resolution_id, r.action, r.previous_status, r.resolved_by, r.reason, r.resolved_at
FROM {schema}.outbound_ledger_resolutions AS r
JOIN {schema}.outbound_ledger AS l ON l.ledger_id = r.ledger_id
WHERE l.remote_system = %(remote_system)s AND l.idempotency_key = %(key)s
ORDER BY r.resolution_id;

-- name: cli_list_runs
-- Filters are optional: a NULL parameter matches everything.
SELECT job_name, run_key, status, triggered_by, triggering_user, dag_id, run_id,
       attempt_count, started_at, completed_at, updated_at, details
FROM {schema}.job_runs
WHERE (%(job)s::text IS NULL OR job_name = %(job)s)
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(from_key)s::text IS NULL OR run_key >= %(from_key)s)
  AND (%(to_key)s::text IS NULL OR run_key <= %(to_key)s)
ORDER BY run_key DESC, job_name
LIMIT %(limit)s;

-- name: cli_attempts
SELECT attempt_id, outcome, triggered_by, triggering_user, dag_id, run_id, task_id, try_number,
       map_index, ti_id, run_type, clear_number, dag_version_id,
       hostname, pid, force, dry_run, started_at, finished_at, error, details
FROM {schema}.job_run_attempts
WHERE job_name = %(job)s AND run_key = %(run_key)s
ORDER BY attempt_id;

-- name: cli_locks
-- Run locks held right now in this database, matched to the run they protect: advisory locks
-- (lock_mode advisory: the session holding each) and leases (lock_mode lease, migration 14:
-- the worker, token and expiry of each). A lease that expired without being released (its
-- worker stopped renewing it) is listed too, state 'expired, free to take over': the next run
-- of the key takes it over; a live one is 'held'.
SELECT r.job_name, r.run_key, r.status, 'advisory' AS lock_mode, 'held' AS state,
       a.pid AS backend_pid, a.application_name,
       -- PostgreSQL shows another role's client only to pg_read_all_stats: NULL then, as
       -- for a Unix socket, whose client_port is -1
       coalesce(a.client_hostname, host(a.client_addr),
                CASE a.client_port WHEN -1 THEN 'local socket' ELSE 'not shown to this role' END)
           AS client,
       a.backend_start, NULL::bigint AS lease_token, NULL::text AS lease_holder,
       NULL::timestamptz AS lease_expires_at, att.hostname AS worker_host, att.pid AS worker_pid,
       att.started_at AS attempt_started_at, att.dag_id, att.run_id,
       a.backend_start AS since
FROM {schema}.held_run_locks() AS h
JOIN pg_stat_activity AS a ON a.pid = h.pid
LEFT JOIN {schema}.job_runs AS r ON r.lock_key = h.lock_key
LEFT JOIN LATERAL (
    SELECT hostname, pid, started_at, dag_id, run_id
    FROM {schema}.job_run_attempts
    WHERE lock_backend_pid = a.pid AND outcome = 'running' AND lock_key = h.lock_key
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
UNION ALL
SELECT r.job_name, r.run_key, r.status, 'lease',
       CASE WHEN l.expires_at > clock_timestamp() THEN 'held'
            ELSE 'expired, free to take over' END,
       NULL, NULL, NULL, NULL, l.token, l.holder, l.expires_at, att.hostname, att.pid,
       att.started_at, att.dag_id, att.run_id, l.acquired_at
FROM {schema}.run_leases AS l
LEFT JOIN {schema}.job_runs AS r ON r.lock_key = l.lock_key
LEFT JOIN LATERAL (
    SELECT hostname, pid, started_at, dag_id, run_id
    FROM {schema}.job_run_attempts
    WHERE lock_key = l.lock_key AND outcome = 'running' AND details->>'lease' = 'lease:' || l.token
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
ORDER BY since;

-- name: cli_ledger_summary
-- Effects of every kind per job, key, remote and status; the unknown ones first.
SELECT job_name, run_key, remote_system, effect_kind, status, count(*) AS effects,
       max(updated_at) AS last_update
FROM {schema}.outbound_ledger
WHERE (%(job)s::text IS NULL OR job_name = %(job)s)
  AND (%(run_key)s::text IS NULL OR run_key = %(run_key)s)
  AND (%(all)s OR status <> 'succeeded')
GROUP BY job_name, run_key, remote_system, effect_kind, status
ORDER BY status = 'unknown' DESC, run_key DESC, job_name, status;

-- name: cli_ledger_problems
-- Effects not confirmed (unknown, pending, failed), unknown first, each with its last
-- resolution (who, when) if an operator resolved it before.
SELECT l.job_name, l.run_key, l.remote_system, l.effect_kind, l.idempotency_key, l.status,
       l.deduplicating, l.call_count, l.intent_at, l.last_error, l.updated_at,
       res.action AS last_resolution, res.resolved_by, res.resolved_at
FROM {schema}.outbound_ledger AS l
LEFT JOIN LATERAL (
    SELECT r.action, r.resolved_by, r.resolved_at
    FROM {schema}.outbound_ledger_resolutions AS r
    WHERE r.ledger_id = l.ledger_id
    ORDER BY r.resolution_id DESC
    LIMIT 1
) AS res ON true
WHERE l.status <> 'succeeded'
  AND (%(job)s::text IS NULL OR l.job_name = %(job)s)
  AND (%(run_key)s::text IS NULL OR l.run_key = %(run_key)s)
ORDER BY l.status = 'unknown' DESC, l.updated_at DESC
LIMIT %(limit)s;

-- name: reset_run
-- Only failed or started (stuck) runs: a completed run is recomputed with force instead.
UPDATE {schema}.job_runs
SET status = 'failed', updated_at = statement_timestamp(), current_attempt_id = %(attempt_id)s,
    details = details || jsonb_build_object('reset_reason', %(reason)s::text,
                                            'reset_at', statement_timestamp(), 'reset_from', status)
WHERE job_name = %(job)s AND run_key = %(run_key)s AND status IN ('failed', 'started')
RETURNING status;

-- name: cli_attempts_since
-- The attempts of one business date of a DAG since a moment: its plain key and the keys of
-- its segments (a task mapped over segments records eu|2026-10-01, us|2026-10-01, ...).
SELECT job_name, run_key, outcome, error
FROM {schema}.job_run_attempts
WHERE (run_key = %(run_key)s OR %(run_key)s = ANY (string_to_array(run_key, '|')))
  AND dag_id = %(dag_id)s AND started_at >= %(since)s
ORDER BY attempt_id;

-- Read-only statements of the Run keys view in the Airflow UI (airflow_idempotency.ui).
-- Each takes the reader's DAG visibility: the parameter all_dags (the user may read every
-- DAG) or dag_ids (the DAG ids the auth manager authorizes). A row leaves the database only if
-- the DAG id recorded on it is visible; rows recorded outside Airflow (no DAG id) only when
-- all DAGs are. Optional filters: a NULL parameter matches everything (the server plans each
-- statement with the values bound, so a NULL filter costs nothing).

-- name: ui_runs
-- Run keys of every job, newest key first, a page at a time: keyset pagination on
-- (run_key, job_name), the order of job_runs_run_key_idx (migration 5).
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT r.job_name, r.run_key, r.status, r.triggered_by, r.triggering_user, r.dag_id, r.run_id,
       r.task_id, r.attempt_count, r.started_at, r.completed_at, r.updated_at, r.details,
       r.lock_key IN (SELECT held.lock_key FROM held) AS locked
FROM {schema}.job_runs AS r
WHERE (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
  AND (%(job)s::text IS NULL OR r.job_name = %(job)s)
  AND (%(status)s::text IS NULL OR r.status = %(status)s)
  AND (%(dag_id)s::text IS NULL OR r.dag_id = %(dag_id)s)
  AND (%(from_key)s::text IS NULL OR r.run_key >= %(from_key)s)
  AND (%(to_key)s::text IS NULL OR r.run_key <= %(to_key)s)
  AND (%(before_key)s::text IS NULL OR (r.run_key, r.job_name) < (%(before_key)s, %(before_job)s))
ORDER BY r.run_key DESC, r.job_name DESC
LIMIT %(limit)s;

-- name: ui_attention
-- Runs that are not completed (failed, running now, or interrupted: started and no longer
-- locked, i.e. the worker died), last changed first: the newest of each status through
-- job_runs_status_idx, never all of them.
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT o.*, o.lock_key IN (SELECT held.lock_key FROM held) AS locked
FROM (
    (SELECT r.* FROM {schema}.job_runs AS r
     WHERE r.status = 'failed' AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
     ORDER BY r.updated_at DESC LIMIT %(limit)s)
    UNION ALL
    (SELECT r.* FROM {schema}.job_runs AS r
     WHERE r.status = 'started' AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
     ORDER BY r.updated_at DESC LIMIT %(limit)s)
) AS o
ORDER BY o.updated_at DESC
LIMIT %(limit)s;

-- name: ui_locks
-- Run locks held right now, by the attempt that holds each (job_run_attempts_running_idx),
-- with the holder's lock transaction start (held since) and its age: advisory locks
-- (lock_mode advisory: the session) and live leases (lock_mode lease, migration 14: the
-- worker, token and expiry; held since the lease was taken).
-- A lock taken a moment ago whose attempt is not recorded yet is not shown.
SELECT att.job_name, att.run_key, r.status, 'advisory' AS lock_mode, a.pid AS backend_pid,
       -- PostgreSQL shows another role's client only to pg_read_all_stats: NULL then, as
       -- for a Unix socket, whose client_port is -1
       coalesce(a.client_hostname, host(a.client_addr),
                CASE a.client_port WHEN -1 THEN 'local socket' ELSE 'not shown to this role' END)
           AS client,
       a.backend_start, a.xact_start AS held_since,
       statement_timestamp() - coalesce(a.xact_start, att.started_at) AS age,
       NULL::bigint AS lease_token, NULL::text AS lease_holder,
       NULL::timestamptz AS lease_expires_at,
       att.attempt_id, att.hostname AS worker_host, att.pid AS worker_pid,
       att.started_at AS attempt_started_at, att.dag_id, att.run_id, att.task_id,
       att.map_index, att.try_number, att.triggered_by, att.triggering_user
FROM {schema}.held_run_locks() AS h
JOIN pg_stat_activity AS a ON a.pid = h.pid
JOIN LATERAL (
    SELECT attempt_id, job_name, run_key, hostname, pid, started_at, dag_id, run_id, task_id,
           map_index, try_number, triggered_by, triggering_user
    FROM {schema}.job_run_attempts
    WHERE lock_key = h.lock_key AND lock_backend_pid = a.pid AND outcome = 'running'
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
LEFT JOIN {schema}.job_runs AS r ON r.job_name = att.job_name AND r.run_key = att.run_key
WHERE %(all_dags)s OR att.dag_id = ANY(%(dag_ids)s::text[])
UNION ALL
SELECT att.job_name, att.run_key, r.status, 'lease', NULL, NULL, NULL, l.acquired_at,
       statement_timestamp() - l.acquired_at, l.token, l.holder, l.expires_at,
       att.attempt_id, att.hostname, att.pid, att.started_at, att.dag_id, att.run_id,
       att.task_id, att.map_index, att.try_number, att.triggered_by, att.triggering_user
FROM {schema}.run_leases AS l
JOIN LATERAL (
    SELECT attempt_id, job_name, run_key, hostname, pid, started_at, dag_id, run_id, task_id,
           map_index, try_number, triggered_by, triggering_user
    FROM {schema}.job_run_attempts
    WHERE lock_key = l.lock_key AND outcome = 'running' AND details->>'lease' = 'lease:' || l.token
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
LEFT JOIN {schema}.job_runs AS r ON r.job_name = att.job_name AND r.run_key = att.run_key
WHERE l.expires_at > clock_timestamp()
  AND (%(all_dags)s OR att.dag_id = ANY(%(dag_ids)s::text[]))
ORDER BY attempt_started_at;

-- name: ui_unconfirmed
-- Run keys with external effects not confirmed by the remote (unknown, pending or failed), per
-- remote system, those with unknown effects first, then most recently touched first
-- (outbound_ledger_unconfirmed_idx: confirmed rows are not read).
-- The keys come sorted out of the subquery, so each one's job_runs row is looked up (by
-- primary key) only until the page is full.
SELECT u.job_name, u.run_key, u.remote_system, u.kinds, r.dag_id, u.unknown, u.pending,
       u.failed, u.last_update
FROM (
    SELECT l.job_name, l.run_key, l.remote_system,
           string_agg(DISTINCT l.effect_kind, ', ') AS kinds,
           count(*) FILTER (WHERE l.status = 'unknown') AS unknown,
           count(*) FILTER (WHERE l.status = 'pending') AS pending,
           count(*) FILTER (WHERE l.status = 'failed') AS failed,
           max(l.updated_at) AS last_update
    FROM {schema}.outbound_ledger AS l
    WHERE l.status <> 'succeeded'
    GROUP BY l.job_name, l.run_key, l.remote_system
    ORDER BY count(*) FILTER (WHERE l.status = 'unknown') > 0 DESC, last_update DESC
) AS u
LEFT JOIN LATERAL (
    -- LIMIT (the key is unique anyway) keeps this a lookup per row: a plain join is
    -- planned as a hash join over all of job_runs.
    SELECT jr.dag_id FROM {schema}.job_runs AS jr
    WHERE jr.job_name = u.job_name AND jr.run_key = u.run_key
    LIMIT 1
) AS r ON true
WHERE %(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[])
ORDER BY u.unknown > 0 DESC, u.last_update DESC
LIMIT %(limit)s;

-- name: ui_unconfirmed_by_remote
-- The effects not confirmed (pending, failed) per remote system, over every key the reader
-- may read: the overview's totals (outbound_ledger_unconfirmed_idx: confirmed rows are not
-- read). A key's DAG is its job_runs row's, looked up by primary key once per key.
SELECT u.remote_system, sum(u.pending)::bigint AS pending, sum(u.failed)::bigint AS failed,
       count(*) AS run_keys, max(u.last_update) AS last_update
FROM (
    SELECT l.job_name, l.run_key, l.remote_system,
           count(*) FILTER (WHERE l.status = 'pending') AS pending,
           count(*) FILTER (WHERE l.status = 'failed') AS failed,
           max(l.updated_at) AS last_update
    FROM {schema}.outbound_ledger AS l
    WHERE l.status <> 'succeeded'
    GROUP BY l.job_name, l.run_key, l.remote_system
) AS u
LEFT JOIN LATERAL (
    SELECT jr.dag_id FROM {schema}.job_runs AS jr
    WHERE jr.job_name = u.job_name AND jr.run_key = u.run_key
    LIMIT 1
) AS r ON true
WHERE %(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[])
GROUP BY u.remote_system
ORDER BY u.remote_system;

-- name: ui_dag_jobs
-- The jobs a DAG ran, by name: one probe of job_run_attempts_dag_job_idx per job (a loose
-- index scan), however many attempts the DAG made.
WITH RECURSIVE jobs (job_name) AS (
    (SELECT a.job_name FROM {schema}.job_run_attempts AS a
     WHERE a.dag_id = %(dag_id)s ORDER BY a.job_name LIMIT 1)
    UNION ALL
    SELECT (SELECT a.job_name FROM {schema}.job_run_attempts AS a
            WHERE a.dag_id = %(dag_id)s AND a.job_name > jobs.job_name
            ORDER BY a.job_name LIMIT 1)
    FROM jobs
    WHERE jobs.job_name IS NOT NULL
)
SELECT jobs.job_name FROM jobs WHERE jobs.job_name IS NOT NULL LIMIT %(limit)s;

-- name: ui_dag_keys
-- The newest run keys of some jobs (older than before_key when paging), and every
-- visible job_runs row of those jobs for those keys: per job a backward scan of the
-- primary key, then primary-key lookups.
WITH keys AS (
    SELECT DISTINCT k.run_key
    FROM unnest(%(jobs)s::text[]) AS j (job_name)
    CROSS JOIN LATERAL (
        SELECT r.run_key FROM {schema}.job_runs AS r
        WHERE r.job_name = j.job_name
          AND (%(before_key)s::text IS NULL OR r.run_key < %(before_key)s)
        ORDER BY r.run_key DESC
        LIMIT %(limit)s
    ) AS k
    ORDER BY k.run_key DESC
    LIMIT %(limit)s
),
held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT r.run_key, r.job_name, r.status, r.triggered_by, r.triggering_user, r.dag_id,
       r.run_id, r.task_id, r.attempt_count, r.started_at, r.completed_at, r.updated_at,
       r.details, r.lock_key IN (SELECT held.lock_key FROM held) AS locked
FROM keys
CROSS JOIN unnest(%(jobs)s::text[]) AS j (job_name)
JOIN LATERAL (
    SELECT * FROM {schema}.job_runs AS jr
    WHERE jr.job_name = j.job_name AND jr.run_key = keys.run_key
    LIMIT 1  -- a primary-key lookup per cell, never a hash join over job_runs
) AS r ON true
WHERE %(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[])
ORDER BY r.run_key DESC, r.job_name;

-- name: ui_jobs
-- Every job with a visible record: its newest run key and newest completed key. The job
-- names come one index probe each (a loose index scan): of job_runs' primary key for a
-- reader of every DAG; else of job_run_attempts_dag_job_idx, per DAG the reader may read
-- (the jobs those DAGs ran), so that no other DAG's rows are read to skip them. The keys
-- come from a backward scan of each job's primary-key range.
WITH RECURSIVE every_job (job_name) AS (
    (SELECT r.job_name FROM {schema}.job_runs AS r
     WHERE %(all_dags)s ORDER BY r.job_name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.job_name FROM {schema}.job_runs AS r
            WHERE r.job_name > every_job.job_name ORDER BY r.job_name LIMIT 1)
    FROM every_job
    WHERE every_job.job_name IS NOT NULL
),
dag_jobs (dag_id, job_name) AS (
    SELECT d.dag_id,
           (SELECT a.job_name FROM {schema}.job_run_attempts AS a
            WHERE a.dag_id = d.dag_id ORDER BY a.job_name LIMIT 1)
    FROM unnest(%(dag_ids)s::text[]) AS d (dag_id)
    WHERE NOT %(all_dags)s
    UNION ALL
    SELECT dag_jobs.dag_id,
           (SELECT a.job_name FROM {schema}.job_run_attempts AS a
            WHERE a.dag_id = dag_jobs.dag_id AND a.job_name > dag_jobs.job_name
            ORDER BY a.job_name LIMIT 1)
    FROM dag_jobs
    WHERE dag_jobs.job_name IS NOT NULL
),
jobs (job_name) AS (
    SELECT every_job.job_name FROM every_job WHERE every_job.job_name IS NOT NULL
    UNION
    SELECT dag_jobs.job_name FROM dag_jobs WHERE dag_jobs.job_name IS NOT NULL
)
SELECT jobs.job_name, newest.run_key AS newest_key, newest.status AS newest_status,
       newest.dag_id, done.run_key AS completed_key, done.completed_at
FROM jobs
CROSS JOIN LATERAL (
    SELECT r.run_key, r.status, r.dag_id FROM {schema}.job_runs AS r
    WHERE r.job_name = jobs.job_name AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
    ORDER BY r.run_key DESC LIMIT 1
) AS newest
LEFT JOIN LATERAL (
    SELECT r.run_key, r.completed_at FROM {schema}.job_runs AS r
    WHERE r.job_name = jobs.job_name AND r.status = 'completed'
      AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
    ORDER BY r.run_key DESC LIMIT 1
) AS done ON true
ORDER BY jobs.job_name
LIMIT %(limit)s;

-- name: ui_open_by_job
-- How many runs of each job are failed, running now and interrupted (job_runs_status_idx:
-- only the runs not completed are read).
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT r.job_name,
       count(*) FILTER (WHERE r.status = 'failed') AS failed,
       count(*) FILTER (WHERE r.status = 'started'
                        AND r.lock_key IN (SELECT held.lock_key FROM held)) AS running,
       count(*) FILTER (WHERE r.status = 'started'
                        AND r.lock_key NOT IN (SELECT held.lock_key FROM held)) AS interrupted
FROM {schema}.job_runs AS r
WHERE r.status IN ('started', 'failed')
  AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
GROUP BY r.job_name;

-- name: ui_job_bounds
-- The first and the newest visible run key of one job (two primary-key probes).
SELECT (SELECT r.run_key FROM {schema}.job_runs AS r
        WHERE r.job_name = %(job)s AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
        ORDER BY r.run_key LIMIT 1) AS first_key,
       (SELECT r.run_key FROM {schema}.job_runs AS r
        WHERE r.job_name = %(job)s AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
        ORDER BY r.run_key DESC LIMIT 1) AS last_key;

-- name: ui_job_segment_bounds
-- The first and the newest visible run key of one segment of a job: its keys that start
-- with the segment's labels (eu|), a range of the primary key.
SELECT (SELECT r.run_key FROM {schema}.job_runs AS r
        WHERE r.job_name = %(job)s AND starts_with(r.run_key, %(prefix)s)
          AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
        ORDER BY r.run_key LIMIT 1) AS first_key,
       (SELECT r.run_key FROM {schema}.job_runs AS r
        WHERE r.job_name = %(job)s AND starts_with(r.run_key, %(prefix)s)
          AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
        ORDER BY r.run_key DESC LIMIT 1) AS last_key;

-- name: ui_job_segments
-- The segments (labels before the period) of one job's visible keys, at most 50.
SELECT DISTINCT left(r.run_key, length(r.run_key) - strpos(reverse(r.run_key), '|') + 1)
       AS prefix
FROM {schema}.job_runs AS r
WHERE r.job_name = %(job)s AND strpos(r.run_key, '|') > 0
  AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
ORDER BY 1
LIMIT 50;

-- name: ui_job_calendar
-- The visible job_runs rows of one job from from_key to to_key (a range of its primary key),
-- each with whether its run lock is held now.
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT r.run_key, r.status, r.dag_id, r.run_id, r.attempt_count, r.updated_at, r.details,
       r.lock_key IN (SELECT held.lock_key FROM held) AS locked
FROM {schema}.job_runs AS r
WHERE r.job_name = %(job)s AND r.run_key >= %(from_key)s AND r.run_key <= %(to_key)s
  AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
ORDER BY r.run_key
LIMIT %(limit)s;

-- name: ui_run_attempts
-- What one DAG run's tasks did (job_run_attempts_dag_run_idx), each with its key's
-- current record when that is visible.
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT a.attempt_id, a.job_name, a.run_key, a.outcome, a.task_id, a.map_index, a.try_number,
       a.triggered_by, a.triggering_user, a.ti_id, a.run_type, a.clear_number, a.dag_version_id,
       a.hostname, a.pid, a.force, a.dry_run, a.started_at, a.finished_at, a.error, a.details,
       a.details->>'partition_key' AS partition_key, r.status AS key_status, r.dag_id AS key_dag_id, r.run_id AS key_run_id,
       r.updated_at AS key_updated_at, r.lock_key IN (SELECT held.lock_key FROM held) AS key_locked
FROM {schema}.job_run_attempts AS a
LEFT JOIN {schema}.job_runs AS r
    ON r.job_name = a.job_name AND r.run_key = a.run_key
   AND (%(all_dags)s OR r.dag_id = ANY(%(dag_ids)s::text[]))
WHERE a.dag_id = %(dag_id)s AND a.run_id = %(run_id)s
  AND (%(task_id)s::text IS NULL OR a.task_id = %(task_id)s)
ORDER BY a.task_id, a.map_index NULLS FIRST, a.attempt_id
LIMIT %(limit)s;

-- name: ui_key_attempts
-- The newest attempts of one key that the reader may see (an attempt recorded outside
-- Airflow, e.g. the CLI's reset, belongs to the key), and how many it may not.
WITH attempts AS (
    SELECT a.*, (%(all_dags)s OR a.dag_id IS NULL OR a.dag_id = ANY(%(dag_ids)s::text[])) AS visible
    FROM {schema}.job_run_attempts AS a
    WHERE a.job_name = %(job)s AND a.run_key = %(run_key)s
)
SELECT a.attempt_id, a.outcome, a.triggered_by, a.triggering_user, a.dag_id, a.run_id,
       a.task_id, a.map_index, a.try_number, a.ti_id, a.run_type, a.clear_number,
       a.dag_version_id, a.hostname, a.pid, a.lock_backend_pid, a.force, a.dry_run,
       a.started_at, a.finished_at, a.error, a.details,
       a.details->>'partition_key' AS partition_key, count(*) OVER () AS visible_total,
       (SELECT count(*) FROM attempts AS h WHERE NOT h.visible) AS hidden_total
FROM attempts AS a
WHERE a.visible
ORDER BY a.attempt_id DESC
LIMIT %(limit)s;

-- name: ui_key_lease
-- The lease of one key (the lease mode, migration 14), live or expired (an expired lease
-- stays until the key's next run takes it over): the worker, its token, since and until when,
-- and the running attempt it belongs to (when the reader may see that attempt's DAG).
SELECT l.token, l.holder, l.acquired_at, l.renewed_at, l.expires_at,
       l.expires_at > clock_timestamp() AS live,
       att.attempt_id, att.hostname AS worker_host, att.pid AS worker_pid,
       att.started_at AS attempt_started_at, att.dag_id, att.run_id, att.task_id
FROM {schema}.run_leases AS l
LEFT JOIN LATERAL (
    SELECT attempt_id, hostname, pid, started_at, dag_id, run_id, task_id
    FROM {schema}.job_run_attempts
    WHERE lock_key = l.lock_key AND outcome = 'running' AND details->>'lease' = 'lease:' || l.token
      AND (%(all_dags)s OR dag_id = ANY(%(dag_ids)s::text[]))
    ORDER BY attempt_id DESC
    LIMIT 1
) AS att ON true
WHERE l.lock_key = %(lock_key)s;

-- name: job_known
SELECT EXISTS (SELECT 1 FROM {schema}.job_runs WHERE job_name = %(job)s)
    OR EXISTS (SELECT 1 FROM {schema}.job_run_attempts WHERE job_name = %(job)s) AS known;

-- name: known_jobs
SELECT DISTINCT job_name FROM {schema}.job_runs ORDER BY job_name LIMIT 50;

-- name: runs_of_keys
-- The job_runs rows of some run keys of one job (the CLI's gaps, the watch DAG); each key
-- found by the primary key.
SELECT run_key, status, attempt_count, updated_at, details->>'last_error' AS last_error
FROM {schema}.job_runs
WHERE job_name = %(job)s AND run_key = ANY(%(keys)s::text[]);

-- name: segmented_keys_of_job
-- The run keys of one job that have segments (eu|2026-10-01): gaps per segment takes the
-- segments from them. A range of the primary key's index: job_name, then every key.
SELECT run_key FROM {schema}.job_runs
WHERE job_name = %(job)s AND strpos(run_key, '|') > 0;

-- name: job_has_plain_keys
-- Whether one job has a run key without segments (gaps lists plain keys beside segments).
SELECT EXISTS (
    SELECT 1 FROM {schema}.job_runs WHERE job_name = %(job)s AND strpos(run_key, '|') = 0
) AS found;

-- name: stale_runs
-- Work that nobody is doing: attempts still 'running' whose lock nobody holds for them (the
-- advisory mode: their lock session no longer holds it; the lease mode: their lease, named
-- in details.lease, is gone or expired), and keys still 'started' with no live attempt and no
-- holder (a worker died and nothing took the key over yet); a key whose attempt deferred waits
-- for Airflow to resume it (migration 15). Running attempts come from the partial index of
-- migration 3. lease_expires_at: when an attempt's lease expired (NULL: the
-- lease is gone, or the attempt is of the advisory mode).
WITH held AS MATERIALIZED (SELECT lock_key, pid FROM {schema}.held_run_locks()),
leased AS MATERIALIZED (
    SELECT l.lock_key, 'lease:' || l.token AS holder, l.expires_at,
           l.expires_at > clock_timestamp() AS live
    FROM {schema}.run_leases AS l
)
SELECT a.job_name, a.run_key, r.status, a.attempt_id, a.hostname, a.pid, a.dag_id, a.run_id,
       a.started_at, statement_timestamp() - a.started_at AS age,
       CASE WHEN a.details ? 'lease' THEN 'lease' ELSE 'advisory' END AS lock_mode,
       (SELECT le.expires_at FROM leased AS le
        WHERE le.lock_key = a.lock_key AND le.holder = a.details->>'lease') AS lease_expires_at
FROM {schema}.job_run_attempts AS a
LEFT JOIN {schema}.job_runs AS r ON r.job_name = a.job_name AND r.run_key = a.run_key
WHERE a.outcome = 'running'
  AND (%(job)s::text IS NULL OR a.job_name = %(job)s)
  AND NOT EXISTS (
      SELECT 1 FROM held AS h WHERE h.lock_key = a.lock_key AND h.pid = a.lock_backend_pid
  )
  AND NOT EXISTS (
      SELECT 1 FROM leased AS le
      WHERE le.lock_key = a.lock_key AND le.live AND le.holder = a.details->>'lease'
  )
UNION ALL
SELECT r.job_name, r.run_key, r.status, NULL, NULL, NULL, r.dag_id, r.run_id, r.started_at,
       statement_timestamp() - r.started_at, NULL, NULL
FROM {schema}.job_runs AS r
WHERE r.status = 'started'
  AND (%(job)s::text IS NULL OR r.job_name = %(job)s)
  AND NOT EXISTS (SELECT 1 FROM held AS h WHERE h.lock_key = r.lock_key)
  AND NOT EXISTS (SELECT 1 FROM leased AS le WHERE le.lock_key = r.lock_key AND le.live)
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.job_run_attempts AS a
      WHERE a.attempt_id = r.current_attempt_id AND a.outcome IN ('running', 'deferred')
  )
ORDER BY started_at;

-- name: prune_attempts
-- One batch of the retention: attempts older than the cutoff of keys that are completed,
-- never the attempt that completed the key (job_runs.current_attempt_id), never one still
-- running, never a job_runs row. Keyset-paginated by attempt_id (ascending = oldest first).
WITH doomed AS (
    SELECT a.attempt_id
    FROM {schema}.job_run_attempts AS a
    JOIN {schema}.job_runs AS r ON r.job_name = a.job_name AND r.run_key = a.run_key
    WHERE a.attempt_id > %(after)s
      AND a.started_at < %(before)s
      AND r.status = 'completed'
      AND a.attempt_id <> r.current_attempt_id
      AND a.outcome <> 'running'
    ORDER BY a.attempt_id
    LIMIT %(batch)s
),
deleted AS (
    DELETE FROM {schema}.job_run_attempts AS a
    USING doomed AS d
    WHERE a.attempt_id = d.attempt_id AND NOT %(dry_run)s
    RETURNING a.attempt_id
)
SELECT count(*) AS selected, max(attempt_id) AS last_id, (SELECT count(*) FROM deleted) AS deleted
FROM doomed;

-- name: plan_states
-- The state of (job, run key) pairs a backfill would run, and whether each is locked now.
WITH held AS MATERIALIZED (
    SELECT h.lock_key FROM {schema}.held_run_locks() AS h
    UNION  -- a live lease holds its key too (the lease mode, migration 14)
    SELECT l.lock_key FROM {schema}.run_leases AS l WHERE l.expires_at > clock_timestamp()
)
SELECT p.job_name, p.run_key, r.status,
       EXISTS (SELECT 1 FROM held AS h WHERE h.lock_key = p.lock_key) AS locked
FROM unnest(%(jobs)s::text[], %(keys)s::text[], %(lock_keys)s::bigint[])
    AS p(job_name, run_key, lock_key)
LEFT JOIN {schema}.job_runs AS r ON r.job_name = p.job_name AND r.run_key = p.run_key;

-- name: missing_privileges
-- What the current role lacks to use the bookkeeping tables (schema.missing_privileges): read
-- from the catalogs, which every role may read, so it answers where the tables themselves
-- refuse the role. Runs only after a statement was refused for a missing privilege.
SELECT 'USAGE on schema ' || n.nspname AS missing
FROM pg_catalog.pg_namespace AS n
WHERE n.nspname = %(schema)s AND NOT has_schema_privilege(n.oid, 'USAGE')
UNION ALL
SELECT p.privilege || ' on table ' || c.relname
FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
CROSS JOIN (VALUES ('SELECT'), ('INSERT'), ('UPDATE'), ('DELETE')) AS p (privilege)
WHERE n.nspname = %(schema)s
  AND c.relkind IN ('r', 'p')
  AND NOT has_table_privilege(c.oid, p.privilege)
ORDER BY 1;

-- name: adopt_states
-- `adopt`: the job_runs status of (job, run key) pairs, for those that have a record.
SELECT r.job_name, r.run_key, r.status
FROM unnest(%(job_names)s::text[], %(run_keys)s::text[]) AS p(job_name, run_key)
JOIN {schema}.job_runs AS r ON r.job_name = p.job_name AND r.run_key = p.run_key;

-- name: adopt_lock
-- `adopt --apply`, first statement of a key's transaction: the key's run lock for the rest of
-- the transaction, if nobody holds it (a run in progress keeps its key: adopt leaves it alone).
SELECT pg_try_advisory_xact_lock(%(lock_key)s) AS acquired;

-- name: adopt_run
-- `adopt --apply`, under the key's run lock: a key without any record becomes completed,
-- triggered_by 'adopted', with one completed attempt; both name the Airflow run adopted
-- (details.adopted_from), and the zone its key was made in (key_zone: the zone rule). A key
-- recorded meanwhile returns no row and is left as it is.
-- A new statement after the lock: its snapshot sees every run that released the lock.
WITH attempt AS (
    INSERT INTO {schema}.job_run_attempts (
        job_name, run_key, lock_key, outcome, triggered_by, dag_id, run_id, task_id,
        hostname, pid, started_at, finished_at, details
    )
    SELECT %(job_name)s, %(run_key)s, %(lock_key)s, 'completed', 'adopted', %(dag_id)s,
           %(run_id)s, %(task_id)s, %(hostname)s, %(pid)s, statement_timestamp(),
           statement_timestamp(), %(details)s
    WHERE NOT EXISTS (
        SELECT 1 FROM {schema}.job_runs WHERE job_name = %(job_name)s AND run_key = %(run_key)s
    )
    RETURNING attempt_id
)
INSERT INTO {schema}.job_runs (
    job_name, run_key, lock_key, status, triggered_by, dag_id, run_id, task_id,
    attempt_count, current_attempt_id, started_at, completed_at, updated_at, details, key_zone
)
SELECT %(job_name)s, %(run_key)s, %(lock_key)s, 'completed', 'adopted', %(dag_id)s,
       %(run_id)s, %(task_id)s, 1, attempt.attempt_id, statement_timestamp(),
       statement_timestamp(), statement_timestamp(), %(details)s, %(key_zone)s
FROM attempt
RETURNING job_name;

-- name: set_datestyle
-- The DateStyle of one of the provider's own connections (run_context.autocommit_connection):
-- ISO while the provider uses it when the server's setting is another (psycopg reads no
-- timestamptz in any other), then the connection's own again. A session setting, which
-- PgBouncer keeps for its client (DateStyle is among the parameters it tracks).
SELECT set_config('DateStyle', %(datestyle)s, false);

-- name: attempt_outcome
-- The outcome of one attempt (NULL while it runs): read after its completion's connection was
-- lost with the COMMIT sent, to tell whether that COMMIT landed.
SELECT outcome FROM {schema}.job_run_attempts WHERE attempt_id = %(attempt_id)s;
