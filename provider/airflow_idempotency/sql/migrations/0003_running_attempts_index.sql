-- Version 3: find the attempt that holds a run lock without scanning every attempt ever made.
-- A worker that finds a key locked asks which attempt of which worker holds it
-- (run_lock_holder, and the CLI's `locks`): outcome = 'running' AND lock_key = ... AND
-- lock_backend_pid = .... Only attempts still running are indexed, so the index stays as
-- small as the number of runs in flight, while job_run_attempts grows by a few rows per task.
CREATE INDEX IF NOT EXISTS job_run_attempts_running_idx
    ON job_run_attempts (lock_key, lock_backend_pid)
    WHERE outcome = 'running';
