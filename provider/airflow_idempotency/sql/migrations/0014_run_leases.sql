-- Version 14: the lease lock mode (issue 32). A run may hold its key as a LEASE, a row of
-- run_leases renewed by its worker's heartbeat, instead of an advisory lock held by a
-- transaction kept open for the whole run: no server connection is pinned for the run's length
-- (behind a transaction pooler, N runs no longer need N + 1 server connections).
--
-- - run_leases: one row per key held (or held until it expired). A lease is taken only when the
--   key has no row or its row expired (clock_timestamp(): the server's clock, the only one that
--   counts), in one short transaction that also tries the key's advisory run lock, so that a run
--   of the advisory mode never holds the key at the same time (lease_acquire in queries.sql).
--   Every acquisition draws a new token from run_lease_tokens: tokens increase on every
--   takeover and are never reused (a released row is deleted; its token is not drawn again), so a
--   token names one acquisition as a virtual transaction id names one lock transaction.
-- - The fence is the same protocol (migrations 6, 8, 10, 12, 13): every fence function asks
--   run_lock_held_by(lock_key, pid, holder). A holder 'lease:<token>' now names a lease: held
--   while the key's row has that token and has not expired. Any other holder is answered from
--   held_run_locks() exactly as before, without reading run_leases (plpgsql plans a branch when
--   it first runs it: a fenced transaction of the advisory mode takes no lock on run_leases).
--   Under READ COMMITTED each check reads the row live (a new snapshot per statement). A
--   REPEATABLE READ or SERIALIZABLE transaction reads it through its snapshot, i.e. as it was
--   when the transaction began: a lease is only ever extended by its holder or taken over after
--   it expired, so that answer can be "lost" too early (the transaction outlived the expiry it
--   saw), never "held" too late.
-- - A start of the advisory mode (the trigger of migration 13) is also refused while another
--   worker's lease of the key is live: the key then belongs to that lease.

CREATE SEQUENCE IF NOT EXISTS run_lease_tokens AS bigint;

CREATE TABLE IF NOT EXISTS run_leases (
    lock_key     bigint      PRIMARY KEY,
    token        bigint      NOT NULL DEFAULT nextval('run_lease_tokens'),
    holder       text        NOT NULL,   -- the worker: host and pid, for the refusal message
    acquired_at  timestamptz NOT NULL,
    renewed_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);

-- Whether the run lock p_lock_key is still held by (p_pid, p_holder): a lease (p_holder
-- 'lease:<token>': the key's lease has that token and has not expired), or the lock
-- transaction (p_pid, p_holder) as in migration 8; a NULL p_holder (a worker of version 7)
-- compares the pid alone.
CREATE OR REPLACE FUNCTION run_lock_held_by(p_lock_key bigint, p_pid integer, p_holder text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_holder LIKE 'lease:%' THEN
        RETURN EXISTS (
            SELECT 1 FROM run_leases AS l
            WHERE l.lock_key = p_lock_key
              AND l.token = substr(p_holder, 7)::bigint
              AND l.expires_at > clock_timestamp()
        );
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM held_run_locks() AS h
        WHERE h.lock_key = p_lock_key AND h.pid = p_pid
          AND (p_holder IS NULL OR h.holder = p_holder)
    );
END
$$;

-- Whether the key has a live lease: a start of the advisory mode is refused then.
CREATE OR REPLACE FUNCTION fence_live_lease(p_lock_key bigint)
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT EXISTS (
        SELECT 1 FROM run_leases AS l
        WHERE l.lock_key = p_lock_key AND l.expires_at > clock_timestamp()
    )
$$;

-- Migration 13's check of a start, and a start of the advisory mode refused while another
-- worker's lease of the key is live. A start of the lease mode records no lock session
-- (lock_backend_pid NULL): its four-argument fence_take_over checked its lease already.
CREATE OR REPLACE FUNCTION fence_check_start()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NEW.lock_backend_pid IS NOT NULL AND fence_holds_take_over(NEW.lock_key) THEN
        IF NOT run_lock_held_by(NEW.lock_key, NEW.lock_backend_pid, NULL) THEN
            RAISE EXCEPTION 'run lock % is no longer held by the session that took it (backend %): '
                            'this attempt may not start', NEW.lock_key, NEW.lock_backend_pid
                USING ERRCODE = 'IF001',
                      HINT = 'the lock session ended before the start was recorded; nothing was '
                             'written; a rerun converges';
        END IF;
        IF fence_live_lease(NEW.lock_key) THEN
            RAISE EXCEPTION 'run lock % is held by a lease of another worker (lock_mode lease): '
                            'this attempt may not start', NEW.lock_key
                USING ERRCODE = 'IF001',
                      HINT = 'workers of this job database disagree on lock_mode; nothing was '
                             'written; a rerun converges once the lease is released or expired';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
