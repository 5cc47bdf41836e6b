-- Runs once, when the postgres container initialises an empty data volume
-- (/docker-entrypoint-initdb.d). POSTGRES_DB already created `airflow` (the Airflow
-- metadata DB, owned by POSTGRES_USER=airflow). This adds the job database: the
-- provider's job_runs / outbound_ledger tables and the example invoices live there,
-- owned by their own role so the metadata DB and the job DB stay separable.
--
-- Keep in step with docker-compose.yaml: AIRFLOW_CONN_IDEMPOTENCY_DEFAULT,
-- AIRFLOW_CONN_JOBS_DB and ACCOUNTING_DSN all log in as jobs/jobspass to database jobs.
CREATE ROLE jobs LOGIN PASSWORD 'jobspass';
CREATE DATABASE jobs OWNER jobs;
