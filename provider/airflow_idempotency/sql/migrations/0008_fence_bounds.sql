-- Version 8: the fence bounded, and its holder named exactly (issue 30). Replaces migration 6's
-- functions by overloads with more arguments (the old ones stay, for a worker of the previous
-- version during a rolling upgrade); docs/fence.md says what each guarantees.
--
-- 1. The holder of a run lock is its lock TRANSACTION, not only its backend pid: a pid is reused
--    by the operating system, and a successor whose lock session got the pid of a dead one
--    would pass a check that compares pids. held_run_locks() now also gives the lock's
--    virtual transaction id (pg_locks.virtualtransaction, "procnumber/local xid"): PostgreSQL
--    keeps counting local transaction ids per slot across backends, so (pid, vxid) names one
--    lock transaction. Every fencing check of this version compares both.
-- 2. No fence wait without a bound. fence_enter() tries the fence key before it queues: a
--    takeover queued for the key means the run lock has already changed hands, so the enter
--    re-checks the run lock and fails at once (IF001) instead of queueing behind the takeover
--    (which would wait for this attempt's own open transaction: a cycle through the worker's
--    Python that PostgreSQL's deadlock detector cannot see). Any wait left is bounded by
--    p_wait_ms (lock_timeout, for the wait only: the work's own statements keep theirs).
--    fence_take_over() tries first too, then waits at most p_wait_ms, and its timeout names the
--    sessions it waited for (pid, application_name, state) and what to do (SQLSTATE IF002).
--    It sets lock_timeout for the rest of the start's transaction (the provider's own).
-- 3. The commit-time check is armed when the transaction begins, as well as before COMMIT: a
--    transaction ended inside the block (a COMMIT of the work's own, a psycopg transaction
--    around the fenced one) is checked at its real COMMIT. A PREPARE TRANSACTION of a fenced
--    transaction is refused (IF003): its COMMIT PREPARED would run no check at all.

DROP FUNCTION IF EXISTS held_run_locks();

-- Built on functions only: see migration 4 (the lock transaction calls it for the whole run).
CREATE FUNCTION held_run_locks()
RETURNS TABLE (lock_key bigint, pid integer, holder text)
LANGUAGE sql
STABLE
AS $$
    SELECT (l.classid::bigint << 32) | l.objid::bigint, l.pid, l.virtualtransaction
    FROM pg_catalog.pg_lock_status() AS l
    WHERE l.locktype = 'advisory'
      AND l.granted
      AND l.objsubid = 1
      AND l.database = (
          SELECT s.datid FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS s
      )
$$;

-- Whether the run lock p_lock_key is still held by the lock transaction (p_pid, p_holder); a
-- NULL p_holder (a worker of version 7) compares the pid alone.
CREATE OR REPLACE FUNCTION run_lock_held_by(p_lock_key bigint, p_pid integer, p_holder text)
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT EXISTS (
        SELECT 1 FROM held_run_locks() AS h
        WHERE h.lock_key = p_lock_key AND h.pid = p_pid
          AND (p_holder IS NULL OR h.holder = p_holder)
    )
$$;

-- The sessions that hold or wait for the fence key of p_lock_key in p_mode (other than this
-- one), for an error message: pid, application_name, state and since when, or a prepared
-- transaction (which has no session: see pg_prepared_xacts).
CREATE OR REPLACE FUNCTION fence_key_sessions(p_lock_key bigint, p_mode text)
RETURNS text
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT coalesce(string_agg(
        CASE WHEN l.pid IS NULL
             THEN format('a prepared transaction (%s; see pg_prepared_xacts)',
                         l.virtualtransaction)
             ELSE format('backend pid %s (application_name %L, %s since %s)', l.pid,
                         coalesce(a.application_name, ''), coalesce(a.state, 'state hidden'),
                         coalesce(a.xact_start::text, 'an unknown time'))
        END, '; ' ORDER BY l.pid), 'a session that ended meanwhile')
    FROM fence_key(p_lock_key) AS k
    JOIN pg_catalog.pg_lock_status() AS l
      ON l.locktype = 'advisory' AND l.objsubid = 2
     AND l.classid = k.hi::oid AND l.objid = k.lo::oid
     AND l.database = (
         SELECT s.datid FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS s
     )
    -- pg_stat_get_activity(NULL) is every backend: a prepared transaction has no pid
    LEFT JOIN LATERAL (
        SELECT s.application_name, s.state, s.xact_start
        FROM pg_catalog.pg_stat_get_activity(l.pid) AS s WHERE l.pid IS NOT NULL
    ) AS a ON true
    WHERE l.mode = p_mode AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
$$;

ALTER TABLE fence_arms ADD COLUMN IF NOT EXISTS lock_holder text;

-- Arms the commit-time check for the current transaction, when it may write.
CREATE OR REPLACE FUNCTION fence_arm(
    p_lock_key bigint, p_lock_backend_pid integer, p_lock_holder text, p_attempt_id bigint
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_setting('transaction_read_only') = 'off' THEN
        INSERT INTO fence_arms (lock_key, lock_backend_pid, lock_holder, attempt_id)
        VALUES (p_lock_key, p_lock_backend_pid, p_lock_holder, p_attempt_id);
    END IF;
END
$$;

-- The first statement of a fenced transaction (the fence lock SHARED for the rest of it, the
-- live check of the run lock, the commit-time check armed). lock_timeout is set for the wait
-- only: the SET clause restores the caller's value when the function returns.
CREATE OR REPLACE FUNCTION fence_enter(
    p_lock_key bigint, p_lock_backend_pid integer, p_lock_holder text, p_attempt_id bigint,
    p_wait_ms integer
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
SET lock_timeout = 0
AS $$
DECLARE
    k record;
BEGIN
    SELECT * INTO k FROM fence_key(p_lock_key);
    IF NOT pg_try_advisory_xact_lock_shared(k.hi, k.lo) THEN
        -- Someone holds or awaits the key EXCLUSIVE: a successor's start, which holds the run
        -- lock. Queueing behind it would wait for this attempt's own open transactions.
        IF run_lock_held_by(p_lock_key, p_lock_backend_pid, p_lock_holder) THEN
            PERFORM set_config('lock_timeout', p_wait_ms::text, true);
            BEGIN
                PERFORM pg_advisory_xact_lock_shared(k.hi, k.lo);
            EXCEPTION WHEN lock_not_available THEN
                RAISE EXCEPTION 'the fence of run lock % was not free within % ms: held by %',
                    p_lock_key, p_wait_ms, fence_key_sessions(p_lock_key, 'ExclusiveLock')
                    USING ERRCODE = 'IF002',
                          HINT = 'nothing was written; a retry converges';
            END;
        END IF;
    END IF;
    IF NOT run_lock_held_by(p_lock_key, p_lock_backend_pid, p_lock_holder) THEN
        RAISE EXCEPTION 'run lock % is no longer held by the session of attempt % (backend %)',
            p_lock_key, p_attempt_id, p_lock_backend_pid
            USING ERRCODE = 'IF001',
                  HINT = 'this attempt lost its lock: it may not write; a rerun converges';
    END IF;
    PERFORM fence_arm(p_lock_key, p_lock_backend_pid, p_lock_holder, p_attempt_id);
END
$$;

-- At COMMIT (and at PREPARE TRANSACTION, which fires deferred triggers too): the run lock must
-- still be held by the attempt's lock transaction. A PREPARE is refused outright: the check
-- cannot run at COMMIT PREPARED, which may come after the lock is lost. current_query() is the
-- statement the client sent (PREPARE TRANSACTION is a top-level statement, never a function's).
CREATE OR REPLACE FUNCTION fence_check_at_commit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_query() ~* '\mprepare\s+transaction\M' THEN
        RAISE EXCEPTION 'a fenced transaction of attempt % may not be prepared (two-phase commit)',
            NEW.attempt_id
            USING ERRCODE = 'IF003',
                  HINT = 'its COMMIT PREPARED could land after the run lock is lost; commit it '
                         'directly';
    END IF;
    IF NOT run_lock_held_by(NEW.lock_key, NEW.lock_backend_pid, NEW.lock_holder) THEN
        RAISE EXCEPTION 'run lock % was lost before this transaction of attempt % could commit',
            NEW.lock_key, NEW.attempt_id
            USING ERRCODE = 'IF001',
                  HINT = 'the transaction was rolled back; a rerun converges';
    END IF;
    RETURN NULL;
END
$$;

-- The first statement of an attempt's start: the fence key EXCLUSIVE (so that every fenced
-- transaction of an earlier attempt has ended), waiting at most p_wait_ms; the arms of earlier
-- attempts forgotten. lock_timeout stays p_wait_ms for the rest of the start's transaction.
CREATE OR REPLACE FUNCTION fence_take_over(p_lock_key bigint, p_wait_ms integer)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    k record;
    blockers text;
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms::text, true);
    SELECT * INTO k FROM fence_key(p_lock_key);
    IF NOT pg_try_advisory_xact_lock(k.hi, k.lo) THEN
        blockers := fence_key_sessions(p_lock_key, 'ShareLock');
        BEGIN
            PERFORM pg_advisory_xact_lock(k.hi, k.lo);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'waited % ms for the open transactions of the previous attempt of '
                            'run lock % to end: %', p_wait_ms, p_lock_key,
                            fence_key_sessions(p_lock_key, 'ShareLock')
                USING ERRCODE = 'IF002',
                      DETAIL = 'when the wait began: ' || blockers,
                      HINT = 'That attempt no longer holds the lock, so none of its transactions '
                             'can commit any more; each ends when its worker next talks to the '
                             'database or is cut off (the dead-peer bound). To go on at once, '
                             'end it: SELECT pg_terminate_backend(pid) (ROLLBACK PREPARED for '
                             'a prepared one). Nothing of this start was written; a retry '
                             'converges.';
        END;
    END IF;
    DELETE FROM fence_arms WHERE lock_key = p_lock_key;
END
$$;
