-- Version 18: a lease is held until another run takes the key over, not until it expires
-- (issue 32, goal 1: a thousand runs through a pool of 20).
--
-- Until now a lease was lost when it expired, even when nobody wanted the key: a worker whose
-- heartbeat waited in a busy pooler's queue, or whose process was starved of CPU, for longer
-- than lease_ttl lost its run (LockLostError) and its work was left to a rerun. Measured: 1,000
-- runs through PgBouncer with a pool of 20 on two cores, 465 of them lost their leases that
-- way, with no second run of any key.
--
-- Expiry now only says when the key may be TAKEN OVER: the fencing token is what the fence
-- compares. Under READ COMMITTED (the provider's own transactions: the start, the completion,
-- the failure; and every work transaction left at the database's default of READ COMMITTED)
-- run_lock_held_by answers 'lease:<token>' from the live row: held while the key's lease has
-- that token, expired or not. A take-over draws a new token (lease_acquire), so an attempt
-- whose lease was taken over is refused at its next BEGIN and at its next COMMIT exactly as
-- before; the take-over's start is ordered after the old attempt's open transactions by the
-- fence key, as before. A heartbeat that comes back finds its token and renews (lease_renew).
--
-- A REPEATABLE READ or SERIALIZABLE transaction reads run_leases through its snapshot, which
-- may predate a take-over: for it the lease must also not have expired (the rule of migration
-- 14: "lost" too early, never "held" too late).
--
-- Whatever takes an expired lease's key over without drawing a token deletes the lease row, so
-- its holder can never commit again: a start of the advisory mode (this trigger, under the
-- exclusive fence key: the old holder's open transactions have ended), the CLI's reset, an
-- effect's resolution and adopt (sql: lease_live, under the key's advisory run lock).

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
              AND (l.expires_at > clock_timestamp()
                   OR current_setting('transaction_isolation') = 'read committed')
        );
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM held_run_locks() AS h
        WHERE h.lock_key = p_lock_key AND h.pid = p_pid
          AND (p_holder IS NULL OR h.holder = p_holder)
    );
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
    -- An expired lease of the key is taken over by this start: its holder is refused from now.
    DELETE FROM run_leases WHERE lock_key = NEW.lock_key;
    RETURN NEW;
END
$$;
