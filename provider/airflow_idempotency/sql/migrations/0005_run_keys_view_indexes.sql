-- Version 5: the indexes the Run keys view of the Airflow UI reads through (ui_* queries).
-- Each serves one page and stays small or grows like the table it indexes:
-- - the overview lists the newest run keys of every job, newest first, a page at a time;
-- - a DAG's tab finds the jobs a DAG ran (one index probe per job, never a scan of its
--   attempts) and a DAG run's tab the attempts that run made;
-- - pending and failed external effects are found without reading the confirmed ones,
--   which are nearly all of the ledger (a partial index: only unconfirmed rows are in it).
-- Plain CREATE INDEX (the migration runs in one transaction, where CONCURRENTLY cannot):
-- writes to each table wait while its index is built, once (BENCHMARKS.md has the time).
CREATE INDEX IF NOT EXISTS job_runs_run_key_idx
    ON job_runs (run_key, job_name);

CREATE INDEX IF NOT EXISTS job_run_attempts_dag_job_idx
    ON job_run_attempts (dag_id, job_name);

CREATE INDEX IF NOT EXISTS job_run_attempts_dag_run_idx
    ON job_run_attempts (dag_id, run_id);

CREATE INDEX IF NOT EXISTS outbound_ledger_unconfirmed_idx
    ON outbound_ledger (job_name, run_key)
    WHERE status <> 'succeeded';
