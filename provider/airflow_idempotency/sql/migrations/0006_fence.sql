-- Version 6: the fence. Every write an attempt commits through RunContext.transaction() or the
-- outbound ledger is ordered against a successor taking the key over, and refused at COMMIT once
-- the attempt's run lock is gone.
--
-- The fence key of a run key is its run lock key split into two int4 halves: the (int4, int4)
-- advisory-lock space (pg_locks.objsubid = 2), apart from every bigint key (objsubid = 1), so it
-- can never be mistaken for a run lock (held_run_locks() reads objsubid = 1 only).
-- - fence_enter(): the first statement of each fenced transaction. It takes the fence key SHARED
--   for the rest of the transaction, then checks that the attempt's lock session still holds the
--   run lock (pg_lock_status is read live, never through a snapshot, so this holds under any
--   isolation level).
-- - fence_arm(): the last statement before COMMIT (sent with it) of a read-write fenced
--   transaction: arms the check at COMMIT (below).
-- - fence_take_over(): the first statement of an attempt's start (records.start_attempt). It takes
--   the fence key EXCLUSIVE, so the start waits until every fenced transaction of the previous
--   attempt has ended (committed, rolled back, or its backend gone: TCP keepalives bound that).
-- Why this orders every commit before a successor: a transaction whose fence_enter saw the run
-- lock held by its attempt holds the fence key from then on; the successor can take the run lock
-- only after that, and its start then waits for the fence key.
--
-- fence_arms: one row per fenced read-write transaction (UNLOGGED: it holds nothing that must
-- survive a crash, and writes no WAL), whose DEFERRABLE INITIALLY DEFERRED constraint trigger runs
-- at COMMIT and fails the commit when the run lock is no longer held by the attempt's lock session:
-- a transaction that passed fence_enter and then waited (a stall, a network that heals late)
-- cannot commit once the lock is lost, even before anyone else takes the key. Deferred triggers
-- fire in the order their rows were written, and the arm is the transaction's last write, so
-- this check runs after the user's own deferred triggers. The table is never read by a fenced
-- transaction (nothing for SERIALIZABLE transactions to conflict on); rows are deleted by the
-- next start of the key and by its completion, both READ COMMITTED.
--
-- Functions that read this schema's objects are created with SET search_path FROM CURRENT (this
-- file runs with search_path = the bookkeeping schema), so they work whatever the caller's path.

CREATE UNLOGGED TABLE IF NOT EXISTS fence_arms (
    lock_key          bigint      NOT NULL,
    lock_backend_pid  integer     NOT NULL,
    attempt_id        bigint      NOT NULL,
    armed_at          timestamptz NOT NULL DEFAULT statement_timestamp()
);

CREATE INDEX IF NOT EXISTS fence_arms_lock_key_idx ON fence_arms (lock_key);

-- The server side of the dead-peer bound, for the rest of the current transaction (set_config
-- with is_local; a function without a SET clause of its own, so the settings outlive the call):
-- a backend whose client was cut off by the network ends within the bound instead of Linux's two
-- hours, and with it its locks, row locks and transaction. Called by the lock transaction, every
-- fenced transaction and every start. (On a unix socket the TCP settings do nothing.)
CREATE OR REPLACE FUNCTION bound_dead_peer(
    p_keepalives_idle text, p_keepalives_interval text, p_keepalives_count text,
    p_tcp_user_timeout text
)
RETURNS void
LANGUAGE sql
VOLATILE
AS $$
    SELECT set_config('tcp_keepalives_idle', p_keepalives_idle, true),
           set_config('tcp_keepalives_interval', p_keepalives_interval, true),
           set_config('tcp_keepalives_count', p_keepalives_count, true),
           set_config('tcp_user_timeout', p_tcp_user_timeout, true)
$$;

CREATE OR REPLACE FUNCTION fence_key(p_lock_key bigint, OUT hi integer, OUT lo integer)
LANGUAGE sql
IMMUTABLE
AS $$
    -- bigint::bit(32) keeps the low 32 bits; bit(32)::integer reads them as a signed int4
    SELECT (p_lock_key >> 32)::integer, p_lock_key::bit(32)::integer
$$;

CREATE OR REPLACE FUNCTION fence_enter(
    p_lock_key bigint, p_lock_backend_pid integer, p_attempt_id bigint
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(k.hi, k.lo) FROM fence_key(p_lock_key) AS k;
    IF NOT EXISTS (
        SELECT 1 FROM held_run_locks() AS h
        WHERE h.lock_key = p_lock_key AND h.pid = p_lock_backend_pid
    ) THEN
        RAISE EXCEPTION 'run lock % is no longer held by the session of attempt % (backend %)',
            p_lock_key, p_attempt_id, p_lock_backend_pid
            USING ERRCODE = 'IF001',
                  HINT = 'this attempt lost its lock: it may not write; a rerun converges';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fence_arm(
    p_lock_key bigint, p_lock_backend_pid integer, p_attempt_id bigint
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_setting('transaction_read_only') = 'off' THEN
        INSERT INTO fence_arms (lock_key, lock_backend_pid, attempt_id)
        VALUES (p_lock_key, p_lock_backend_pid, p_attempt_id);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fence_check_at_commit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM held_run_locks() AS h
        WHERE h.lock_key = NEW.lock_key AND h.pid = NEW.lock_backend_pid
    ) THEN
        RAISE EXCEPTION 'run lock % was lost before this transaction of attempt % could commit',
            NEW.lock_key, NEW.attempt_id
            USING ERRCODE = 'IF001',
                  HINT = 'the transaction was rolled back; a rerun converges';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER fence_at_commit
    AFTER INSERT ON fence_arms
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION fence_check_at_commit();

CREATE OR REPLACE FUNCTION fence_take_over(p_lock_key bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(k.hi, k.lo) FROM fence_key(p_lock_key) AS k;
    DELETE FROM fence_arms WHERE lock_key = p_lock_key;
END
$$;
