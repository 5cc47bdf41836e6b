-- Version 17: the start trigger of migration 13 skips what the four-argument take-over already
-- checked (issue 32, goal 4: a cheaper decision).
--
-- Migration 13's trigger (fence_at_start) reads pg_locks twice for every start: whether the
-- start's transaction holds the key's fence EXCLUSIVELY (a start) and whether the row's lock
-- session still holds the run lock. For a worker of version 12 or newer both were answered a
-- moment earlier in the same transaction by fence_take_over(lock_key, wait_ms, pid, holder),
-- which took the fence key exclusively (held to the end of the transaction) and then checked
-- the lock transaction (pid AND virtual transaction id, migration 8). Measured: a start 1.12 ->
-- 1.56 ms with few locks, 6.0 -> 14.6 ms with 10,000 locks, for the trigger's reads alone.
--
-- So that take-over now marks its transaction once its check passed: the setting
-- airflow_idempotency.start_checked = '<lock key>/<lock backend pid>', transaction-local
-- (set_config(..., true): gone at COMMIT or ROLLBACK, never seen by a later transaction of a
-- pooled server connection). The trigger skips its two pg_locks reads when the mark names the
-- row's own key and lock session. A worker of version 11 or older sends the two-argument
-- take-over, which sets no mark: its start is checked by the trigger exactly as before. A start
-- of the advisory mode is still refused while another worker's lease of the key is live
-- (migration 14): that check reads run_leases, never pg_locks, and runs for every start, marked
-- or not.
--
-- The guarantee is unchanged (docs/fence.md): the check that makes a start land only before a
-- successor's start is the one under the exclusive fence key, and the mark is set only after it
-- passed, in the transaction that still holds that fence key.

CREATE OR REPLACE FUNCTION fence_take_over(
    p_lock_key bigint, p_wait_ms integer, p_lock_backend_pid integer, p_lock_holder text
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM fence_take_over(p_lock_key, p_wait_ms);
    IF NOT run_lock_held_by(p_lock_key, p_lock_backend_pid, p_lock_holder) THEN
        RAISE EXCEPTION 'run lock % is no longer held by the session that took it (backend %): '
                        'this attempt may not start', p_lock_key, p_lock_backend_pid
            USING ERRCODE = 'IF001',
                  HINT = 'the lock session ended before the start was recorded; nothing was '
                         'written; a rerun converges';
    END IF;
    PERFORM set_config('airflow_idempotency.start_checked',
                       p_lock_key::text || '/' || coalesce(p_lock_backend_pid::text, ''), true);
END
$$;

CREATE OR REPLACE FUNCTION fence_check_start()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NEW.lock_backend_pid IS NULL THEN
        RETURN NEW;  -- a start of the lease mode: its take-over checked its lease
    END IF;
    IF coalesce(current_setting('airflow_idempotency.start_checked', true), '')
           = NEW.lock_key::text || '/' || NEW.lock_backend_pid::text THEN
        NULL;  -- checked under the exclusive fence key by this transaction's take-over
    ELSIF fence_holds_take_over(NEW.lock_key) THEN
        IF NOT run_lock_held_by(NEW.lock_key, NEW.lock_backend_pid, NULL) THEN
            RAISE EXCEPTION 'run lock % is no longer held by the session that took it (backend %): '
                            'this attempt may not start', NEW.lock_key, NEW.lock_backend_pid
                USING ERRCODE = 'IF001',
                      HINT = 'the lock session ended before the start was recorded; nothing was '
                             'written; a rerun converges';
        END IF;
    ELSE
        RETURN NEW;  -- not a start (adopted history, records written by hand)
    END IF;
    IF fence_live_lease(NEW.lock_key) THEN
        RAISE EXCEPTION 'run lock % is held by a lease of another worker (lock_mode lease): '
                        'this attempt may not start', NEW.lock_key
            USING ERRCODE = 'IF001',
                  HINT = 'workers of this job database disagree on lock_mode; nothing was '
                         'written; a rerun converges once the lease is released or expired';
    END IF;
    RETURN NEW;
END
$$;
