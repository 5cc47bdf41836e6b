-- Version 13: the start of a worker of version 11 or older is fenced by its own lock too
-- (issue 30; found by the adversary of migration 0012, tests/integration/
-- test_fence_start_adversary.py).
--
-- Migration 12 made a start refuse (IF001) unless its lock transaction still holds the run lock,
-- in the four-argument fence_take_over that workers of version 12 call. A worker of the
-- previous release still calls the two-argument function, which only waits for the key's
-- fence: during a rolling upgrade, such a worker whose lock session ended before its start
-- could commit that start after a new worker's successor had started, and take the run over
-- from it (the successor's completion refused, the key left not completed).
--
-- The check now lives where every worker's start passes, whatever it sends: a BEFORE INSERT
-- trigger on job_run_attempts. A row recorded as 'running' by a transaction that holds the
-- key's fence EXCLUSIVELY (a start: both versions of fence_take_over take it first) is refused
-- unless its lock session (lock_backend_pid) still holds the run lock. A successor's start takes
-- the same fence key exclusively, so it waits for this start's transaction: a start that
-- passed the check commits before any successor's start, exactly as in migration 12. Old
-- workers record no lock transaction id, so the holder is named by its pid alone (as for a
-- worker of version 7: see run_lock_held_by). Rows written without a start (adopted history,
-- records written by hand) are not starts and pass untouched.

CREATE OR REPLACE FUNCTION fence_holds_take_over(p_lock_key bigint)
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT EXISTS (
        SELECT 1
        FROM fence_key(p_lock_key) AS k
        JOIN pg_catalog.pg_lock_status() AS l
          ON l.locktype = 'advisory' AND l.objsubid = 2
         AND l.classid = k.hi::oid AND l.objid = k.lo::oid
        WHERE l.pid = pg_catalog.pg_backend_pid() AND l.mode = 'ExclusiveLock' AND l.granted
          AND l.database = (
              SELECT s.datid
              FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS s
          )
    )
$$;

CREATE OR REPLACE FUNCTION fence_check_start()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NEW.lock_backend_pid IS NOT NULL
       AND fence_holds_take_over(NEW.lock_key)
       AND NOT run_lock_held_by(NEW.lock_key, NEW.lock_backend_pid, NULL) THEN
        RAISE EXCEPTION 'run lock % is no longer held by the session that took it (backend %): '
                        'this attempt may not start', NEW.lock_key, NEW.lock_backend_pid
            USING ERRCODE = 'IF001',
                  HINT = 'the lock session ended before the start was recorded; nothing was '
                         'written; a rerun converges';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS fence_at_start ON job_run_attempts;
CREATE TRIGGER fence_at_start
    BEFORE INSERT ON job_run_attempts
    FOR EACH ROW
    WHEN (NEW.outcome = 'running')
    EXECUTE FUNCTION fence_check_start();
