-- Version 4: the one place that reads pg_locks for run locks.
-- Every statement that asks who holds a run lock (the fencing checks, the completion fence,
-- the holder named to a waiting worker, the CLI's `locks`) goes through this function.
-- Postgres shows a bigint advisory key as classid (high 32 bits), objid (low 32 bits) and
-- objsubid = 1, for session- and transaction-level locks alike; shifting the high half back
-- wraps exactly into the signed key (lock_key in job_runs). Only this database's locks.
-- Built on functions only (pg_lock_status() is what the pg_locks view reads,
-- pg_stat_get_activity() gives this session's database): the lock transaction calls it and
-- then stays open for the whole run, and any table or view it read (pg_locks, pg_database)
-- would stay locked (AccessShareLock) all that time. A function takes no lock.
CREATE OR REPLACE FUNCTION held_run_locks()
RETURNS TABLE (lock_key bigint, pid integer)
LANGUAGE sql
STABLE
AS $$
    SELECT (l.classid::bigint << 32) | l.objid::bigint, l.pid
    FROM pg_catalog.pg_lock_status() AS l
    WHERE l.locktype = 'advisory'
      AND l.granted
      AND l.objsubid = 1
      AND l.database = (
          SELECT s.datid FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS s
      )
$$;
