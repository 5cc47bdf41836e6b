-- Version 22: a key held by a live lease is refused by the advisory mode's decision too, even
-- when it is completed (docs/locks.md: the two modes refuse a key the other holds).
--
-- run_decide (migration 21) recorded a no-op for a completed key whatever run_leases held: a
-- forced rerun of the lease mode, between its decision (the lease taken) and its start (the
-- run taken over), held the key, yet an advisory run of it reported the completed run as a
-- no-op while the rerun recomputed it; run_decide_lease refuses the same key ('locked'). Its
-- decision is now 'leased' there (the caller names the lease's holder); everything else is
-- migration 21's, line for line. Found by an adversarial pass
-- (tests/integration/test_mixed_modes_adversary.py).

CREATE OR REPLACE FUNCTION run_decide(
    p_lock_key bigint, p_job_name text, p_run_key text, p_force boolean, p_key_zone text,
    p_session jsonb, p_attempt jsonb,
    OUT decision text, OUT backend_pid integer, OUT holder text, OUT noop_attempt_id bigint,
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
    already_held boolean;
    vxid text;
BEGIN
    backend_pid := pg_catalog.pg_backend_pid();
    run_found := false;
    IF p_key_zone IS NOT NULL THEN
        BEGIN
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
            RAISE SQLSTATE 'IF0R0';  -- roll the read back: its table lock goes with it
        EXCEPTION WHEN SQLSTATE 'IF0R0' THEN NULL;
        END;
        IF zone_conflicts IS NOT NULL THEN
            decision := 'zone';
            RETURN;
        END IF;
    END IF;
    -- one scan of pg_lock_status, for this backend: the key's run lock held already (the test
    -- of held_run_locks) and this transaction's virtual transaction id (the holder)
    SELECT coalesce(bool_or(l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                            AND ((l.classid::bigint << 32) | l.objid::bigint) = p_lock_key
                            AND l.database = (SELECT s.datid FROM pg_catalog.pg_stat_get_activity(
                                                  backend_pid) AS s)),
                    false),
           max(l.virtualtransaction) FILTER (WHERE l.locktype = 'virtualxid')
    INTO already_held, vxid
    FROM pg_catalog.pg_lock_status() AS l
    WHERE l.pid = backend_pid;
    IF already_held THEN
        decision := 'shared';
        RETURN;
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock(p_lock_key) THEN
        decision := 'locked';
        RETURN;
    END IF;
    holder := vxid;
    PERFORM set_config('lock_timeout', p_session ->> 'lock_wait_ms', true),
            set_config('application_name', p_session ->> 'application_name', true),
            set_config('idle_in_transaction_session_timeout', '0', true),
            CASE WHEN current_setting('server_version_num')::integer >= 170000
                 THEN set_config('transaction_timeout', '0', true) END,
            bound_dead_peer(p_session ->> 'keepalives_idle', p_session ->> 'keepalives_interval',
                            p_session ->> 'keepalives_count', p_session ->> 'tcp_user_timeout');
    BEGIN
        SELECT j.status, j.triggered_by, j.triggering_user, j.dag_id, j.run_id, j.task_id,
               j.attempt_count, j.current_attempt_id, j.started_at, j.completed_at,
               j.updated_at, j.details,
               (SELECT a.details -> 'counts' FROM job_run_attempts AS a
                WHERE a.attempt_id = j.current_attempt_id AND j.status = 'completed') AS completed_counts
        INTO r
        FROM job_runs AS j
        WHERE j.job_name = p_job_name AND j.run_key = p_run_key;
        RAISE SQLSTATE 'IF0R0';  -- roll the read back: its table locks go with it
    EXCEPTION WHEN SQLSTATE 'IF0R0' THEN NULL;
    END;
    IF r.status IS NOT NULL THEN
        run_found := true;
        status := r.status; triggered_by := r.triggered_by;
        triggering_user := r.triggering_user; dag_id := r.dag_id; run_id := r.run_id;
        task_id := r.task_id; attempt_count := r.attempt_count;
        current_attempt_id := r.current_attempt_id; started_at := r.started_at;
        completed_at := r.completed_at; updated_at := r.updated_at; details := r.details;
        completed_counts := r.completed_counts;
    END IF;
    IF r.status IS DISTINCT FROM 'completed' OR p_force THEN
        decision := 'run';
        RETURN;
    END IF;
    -- a completed key under another worker's live lease (the lease mode's forced rerun between
    -- its decision and its start): held, as run_decide_lease says of it, not a no-op
    IF fence_live_lease(p_lock_key) THEN
        decision := 'leased';
        RETURN;
    END IF;
    INSERT INTO job_run_attempts (
        job_name, run_key, lock_key, outcome, triggered_by, triggering_user,
        dag_id, run_id, task_id, try_number, map_index, hostname, pid, lock_backend_pid,
        force, dry_run, started_at, finished_at, error, details,
        ti_id, run_type, clear_number, dag_version_id
    )
    SELECT p_job_name, p_run_key, p_lock_key, 'noop', a.triggered_by, a.triggering_user,
           a.dag_id, a.run_id, a.task_id, a.try_number, a.map_index, a.hostname, a.pid,
           backend_pid, p_force, a.dry_run, statement_timestamp(), statement_timestamp(), NULL,
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
END
$$;
