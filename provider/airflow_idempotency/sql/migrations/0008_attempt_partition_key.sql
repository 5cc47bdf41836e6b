-- Version 8: the Airflow partition key each execution ran for (Airflow 3.2+ partitioned
-- runs; NULL for runs without one and on the lines without partitions). The run key is
-- derived from it (run_key.py); this keeps what Airflow called the run, for the Run keys
-- view's links to Airflow's pages and for the record. No index: read with the attempts.
ALTER TABLE job_run_attempts ADD COLUMN IF NOT EXISTS partition_key text;
