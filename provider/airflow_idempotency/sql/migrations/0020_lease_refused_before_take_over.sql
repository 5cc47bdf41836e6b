-- Version 20: a start of the advisory mode is refused at once while another worker's lease of
-- the key is live, BEFORE it queues for the key's fence key (issue 32, the lease mode's
-- adversary pass: a lock_mode switched to lease half-way through a rollout).
--
-- A worker still on the advisory mode takes the key's advisory run lock, which a lease does
-- not hold, and decides 'run'. Until now its start's four-argument take-over (migration 17)
-- then requested the key's fence key EXCLUSIVELY, and the live lease that refuses it was read
-- only afterwards, by the start trigger (fence_check_start, migrations 14 and 18). While the
-- lease holder had a fenced transaction open, that request waited the whole lock wait (the
-- bound of lock_wait_ms) and ended in IF002, a LockWaitError that names the wrong cause; and
-- every new fenced transaction of the lease holder (fence_enter: the fence key SHARED) queued
-- behind that exclusive request and stalled as long.
--
-- So the four-argument take-over of a holder that is not a lease ('lease:%': a start of the
-- lease mode, whose own lease is live) now reads fence_live_lease first and refuses with the
-- start trigger's error (IF001, the same opening words, the lease named), before it requests
-- anything. It cannot be let in by a lease taken after that read: every acquisition of a lease
-- tries the key's advisory run lock, which this start's lock transaction holds. A lease that
-- expired is not live: the start takes the key over as before (it waits for the old holder's
-- open transactions under the fence key, and the trigger deletes the expired lease).
--
-- The start trigger keeps its own check (migration 18): a worker of an older version sends the
-- one- or two-argument take-over, which does not read the lease. The model (tests/model/
-- fence.pml) is unaffected: its attempts are of one mode; two modes on one key are not modelled.

CREATE OR REPLACE FUNCTION fence_take_over(
    p_lock_key bigint, p_wait_ms integer, p_lock_backend_pid integer, p_lock_holder text
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    lease run_leases;
BEGIN
    IF coalesce(p_lock_holder, '') NOT LIKE 'lease:%' AND fence_live_lease(p_lock_key) THEN
        SELECT * INTO lease FROM run_leases AS l WHERE l.lock_key = p_lock_key;
        RAISE EXCEPTION 'run lock % is held by a lease of another worker (lock_mode lease: '
                        'token %, worker %, expires % unless renewed): this attempt of '
                        'lock_mode advisory may not start. Give every worker of this job '
                        'database the same lock_mode (the connection''s extra); a rerun '
                        'converges once the lease is released or expired',
                        p_lock_key, coalesce(lease.token::text, '?'),
                        coalesce(lease.holder, '?'), coalesce(lease.expires_at::text, '?')
            USING ERRCODE = 'IF001',
                  HINT = 'workers of this job database disagree on lock_mode; nothing was '
                         'written; a rerun converges once the lease is released or expired';
    END IF;
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
