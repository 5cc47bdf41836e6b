-- Version 16: the decision of a run in one call (issue 32, goal 4: a cheaper decision).
--
-- run_decide() is the first statement of a run's lock transaction (the advisory mode), sent
-- with its BEGIN in one round trip (run_steps.Run._decide). In that one call it does what the
-- lock statement, the read and the no-op's record did in three round trips:
--
-- 1. the key's zone (migration 9): the zones other than p_key_zone that the job's keys were
--    made in; any found, it stops there (decision 'zone': nothing tried, nothing written) and
--    the caller tells whether they are the same zone written another way (tzdata, in Python);
-- 2. what acquire_run_lock did (queries.sql): the key's run lock tried for the length of the
--    transaction (decision 'shared' when this session already held it: a session-level lock
--    left on a pooled server connection; 'locked' when another session holds it), the session
--    named, idle and transaction timeouts lifted, every lock wait bounded (lock_timeout), the
--    dead peer bounded; holder = the lock transaction's virtual transaction id (migration 8);
-- 3. the key's job_runs row, read in a subtransaction that is rolled back at once: the table
--    locks (AccessShareLock) the read took go with it, so a migration's ALTER TABLE never waits
--    behind a running job (the savepoint of the earlier read, run_steps.Run._read);
-- 4. a completed key not forced: its 'noop' attempt recorded (decision 'noop'; the caller's
--    COMMIT ends the lock transaction); any other key: decision 'run' (the caller starts it).
--
-- Every statement of the function takes its own snapshot (READ COMMITTED, VOLATILE): the read
-- sees every commit before the lock was taken.

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
    IF EXISTS (SELECT 1 FROM held_run_locks() AS h
               WHERE h.lock_key = p_lock_key AND h.pid = backend_pid) THEN
        decision := 'shared';
        RETURN;
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock(p_lock_key) THEN
        decision := 'locked';
        RETURN;
    END IF;
    SELECT l.virtualtransaction INTO holder FROM pg_catalog.pg_lock_status() AS l
    WHERE l.pid = backend_pid AND l.locktype = 'virtualxid' LIMIT 1;
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
