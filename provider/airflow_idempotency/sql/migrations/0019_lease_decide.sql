-- Version 19: the lease mode's decision in one call, and its completion and release in one
-- transaction (issue 32, goal 4: a cheaper decision; the lease mode of migration 14).
--
-- run_decide_lease() is the lease mode's run_decide() (migration 16): sent with its BEGIN and
-- its COMMIT as ONE simple-protocol message (sql: decide_lease; lease_run.decide_lease), it
-- does in one transaction what lease_acquire, the read of job_runs, the no-op's record and
-- the no-op's release did in six round trips:
--
-- 1. the key's zone (migration 9), as run_decide: any other zone found, it stops there
--    (decision 'zone': nothing tried, nothing written);
-- 2. the key's advisory run lock tried for the length of this transaction, as lease_acquire
--    does (decision 'shared' when this session already held it: a session-level lock left on a
--    pooled server connection; 'locked' when another session holds it: a run of the advisory
--    mode, or another worker deciding at this very moment); then a live lease of another worker
--    refuses the key ('locked'); every lock wait of the transaction is bounded (lock_timeout);
-- 3. the key's job_runs row read (the transaction is short: no subtransaction as in
--    run_decide, whose lock transaction lasts the whole run);
-- 4. a completed key not forced: its 'noop' attempt recorded, and NO lease taken (decision
--    'noop'). Why that is as safe as the no-op under a lease: for the whole of this transaction
--    the session holds the key's advisory run lock, which every acquisition of a lease
--    (lease_acquire, this function) and every run of the advisory mode must take first, and no
--    lease of the key is live (checked after the lock was taken; a live lease is never
--    created without that lock): nobody else holds the key while the no-op reads the run and
--    records itself, exactly as when the no-op held a lease from before its read until after
--    its record. An expired lease is still its holder's until taken over (migration 18), but
--    a holder still running has recorded its start (the key is 'started', not completed),
--    unless it is a forced run not started yet, which this no-op then simply precedes; a key
--    found not completed takes the expired lease over (5.). The lease would fence nothing: a no-op
--    has no fenced transaction and no start. What no longer happens: a token drawn and a
--    run_leases row written and deleted for every no-op;
-- 5. any other key: the lease taken (a new token from run_lease_tokens, as lease_acquire:
--    only when the key has no lease or its lease expired) and the run record returned
--    (decision 'run'); the COMMIT sent with it makes the lease visible to the fence. The start
--    follows in a transaction of its own (records.start_attempt: its take-over waits for the
--    old attempt's open transactions, after the lease changed hands, as before).
--
-- lease_releases: the completion of the lease mode (lease_run.LeaseRun._complete_lease) now
-- releases its lease in its own transaction, at its COMMIT, after the fence's check there
-- (sql: lease_release_at_commit). Its row's deferred constraint trigger deletes the lease (if
-- it is still this token's) and its spent commit-time checks, as lease_release did just after
-- that COMMIT. Deferred triggers fire in the order their rows were written, and the completion
-- writes this row after fence_arm's: the fence's check at COMMIT (fence_check_at_commit, which
-- must find the lease still held) runs first, then the release. So the completion and the
-- release land at one instant, as the advisory mode's COMMIT of its lock transaction does, and
-- a completion refused at COMMIT releases nothing. UNLOGGED, and empty between transactions
-- (each row is deleted by its own trigger).

CREATE UNLOGGED TABLE IF NOT EXISTS lease_releases (
    lock_key     bigint NOT NULL,
    token        bigint NOT NULL,
    lock_holder  text   NOT NULL
);

CREATE OR REPLACE FUNCTION lease_release_on_commit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM fence_arms WHERE lock_key = NEW.lock_key AND lock_holder = NEW.lock_holder;
    DELETE FROM run_leases WHERE lock_key = NEW.lock_key AND token = NEW.token;
    DELETE FROM lease_releases WHERE lock_key = NEW.lock_key AND token = NEW.token;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS lease_release_on_commit ON lease_releases;
CREATE CONSTRAINT TRIGGER lease_release_on_commit
    AFTER INSERT ON lease_releases
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION lease_release_on_commit();

CREATE OR REPLACE FUNCTION run_decide_lease(
    p_lock_key bigint, p_job_name text, p_run_key text, p_force boolean, p_key_zone text,
    p_lease jsonb, p_attempt jsonb,
    OUT decision text, OUT token bigint, OUT noop_attempt_id bigint,
    OUT zone_conflicts jsonb, OUT run_found boolean,
    OUT status text, OUT triggered_by text, OUT triggering_user text, OUT dag_id text,
    OUT run_id text, OUT task_id text, OUT attempt_count integer,
    OUT current_attempt_id bigint, OUT started_at timestamptz, OUT completed_at timestamptz,
    OUT updated_at timestamptz, OUT details jsonb, OUT completed_counts jsonb
)
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    PERFORM set_config('lock_timeout', p_lease ->> 'lock_wait_ms', true);
    run_found := false;
    IF p_key_zone IS NOT NULL THEN
        SELECT jsonb_agg(jsonb_build_object('key_zone', z.key_zone, 'run_key', z.run_key,
                                            'keys', z.keys) ORDER BY z.keys DESC, z.key_zone)
        INTO zone_conflicts
        FROM (
            SELECT j.key_zone, max(j.run_key) AS run_key, count(*) AS keys
            FROM job_runs AS j
            WHERE j.job_name = p_job_name AND j.key_zone IS NOT NULL
              AND j.key_zone <> p_key_zone
            GROUP BY j.key_zone
        ) AS z;
        IF zone_conflicts IS NOT NULL THEN
            decision := 'zone';
            RETURN;
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM held_run_locks() AS h
               WHERE h.lock_key = p_lock_key AND h.pid = pg_catalog.pg_backend_pid()) THEN
        decision := 'shared';
        RETURN;
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock(p_lock_key) THEN
        decision := 'locked';
        RETURN;
    END IF;
    IF fence_live_lease(p_lock_key) THEN
        decision := 'locked';
        RETURN;
    END IF;
    SELECT j.status, j.triggered_by, j.triggering_user, j.dag_id, j.run_id, j.task_id,
           j.attempt_count, j.current_attempt_id, j.started_at, j.completed_at,
           j.updated_at, j.details,
           (SELECT a.details -> 'counts' FROM job_run_attempts AS a
            WHERE a.attempt_id = j.current_attempt_id AND j.status = 'completed') AS completed_counts
    INTO r
    FROM job_runs AS j
    WHERE j.job_name = p_job_name AND j.run_key = p_run_key;
    IF r.status IS NOT NULL THEN
        run_found := true;
        status := r.status; triggered_by := r.triggered_by;
        triggering_user := r.triggering_user; dag_id := r.dag_id; run_id := r.run_id;
        task_id := r.task_id; attempt_count := r.attempt_count;
        current_attempt_id := r.current_attempt_id; started_at := r.started_at;
        completed_at := r.completed_at; updated_at := r.updated_at; details := r.details;
        completed_counts := r.completed_counts;
    END IF;
    IF r.status IS NOT DISTINCT FROM 'completed' AND NOT p_force THEN
        INSERT INTO job_run_attempts (
            job_name, run_key, lock_key, outcome, triggered_by, triggering_user,
            dag_id, run_id, task_id, try_number, map_index, hostname, pid, lock_backend_pid,
            force, dry_run, started_at, finished_at, error, details,
            ti_id, run_type, clear_number, dag_version_id
        )
        SELECT p_job_name, p_run_key, p_lock_key, 'noop', a.triggered_by, a.triggering_user,
               a.dag_id, a.run_id, a.task_id, a.try_number, a.map_index, a.hostname, a.pid,
               NULL, p_force, a.dry_run, statement_timestamp(), statement_timestamp(), NULL,
               coalesce(a.trigger_details, '{}'::jsonb)
                   || jsonb_build_object('completed_at', r.completed_at),
               a.ti_id, a.run_type, a.clear_number, a.dag_version_id
        FROM jsonb_to_record(p_attempt) AS a(
            triggered_by text, triggering_user text, dag_id text, run_id text, task_id text,
            try_number integer, map_index integer, hostname text, pid integer, dry_run boolean,
            trigger_details jsonb, ti_id uuid, run_type text, clear_number integer,
            dag_version_id uuid
        )
        RETURNING attempt_id INTO noop_attempt_id;
        decision := 'noop';
        RETURN;
    END IF;
    -- lease_acquire's upsert: a new token, only when the key has no lease or it expired
    INSERT INTO run_leases AS l (lock_key, holder, acquired_at, renewed_at, expires_at)
    VALUES (p_lock_key, p_lease ->> 'holder', clock_timestamp(), clock_timestamp(),
            clock_timestamp() + make_interval(secs => (p_lease ->> 'ttl')::double precision))
    ON CONFLICT (lock_key) DO UPDATE
    SET token = EXCLUDED.token, holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at,
        renewed_at = EXCLUDED.renewed_at, expires_at = EXCLUDED.expires_at
    WHERE l.expires_at <= clock_timestamp()
    RETURNING l.token INTO token;
    decision := CASE WHEN token IS NULL THEN 'locked' ELSE 'run' END;
END
$$;
