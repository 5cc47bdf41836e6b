-- Version 15: an attempt may end 'deferred' (a deferrable Airflow task under the cluster
-- policy: its execute raised TaskDeferred). The attempt ends there, its run stays 'started'
-- and its lock is released; Airflow resumes the task later, and the resumption runs as a new
-- attempt of the key (docs/policy.md, deferrable operators).
--
-- The new CHECK allows a superset of the old one, so every existing row satisfies it: it is
-- added NOT VALID (as migration 7 did), which skips the scan of job_run_attempts. A VALIDATE
-- CONSTRAINT would scan the whole table inside this migration's transaction, which already
-- holds ACCESS EXCLUSIVE on it (the DROP and ADD), blocking every worker's attempt rows for
-- the scan's length; new and updated rows are checked either way. The migrator bounds the
-- lock waits (lock_timeout, retried: migrator.py). No fence function is defined here.
ALTER TABLE job_run_attempts DROP CONSTRAINT IF EXISTS job_run_attempts_outcome_check;
ALTER TABLE job_run_attempts ADD CONSTRAINT job_run_attempts_outcome_check
    CHECK (outcome IN (
        'running', 'completed', 'failed', 'noop', 'lock_held', 'dry_run', 'lock_lost', 'reset',
        'deferred'
    )) NOT VALID;
