-- Version 11: where each attempt came from in Airflow, beyond the DAG, run, task, try and map
-- index that version 1 records: the task instance's id (Airflow 3: ti.id, a UUID; Airflow 2
-- task instances have none, they are named by dag_id, task_id, run_id and map_index), the
-- DAG run's type as Airflow spells it (scheduled, manual, backfill, asset_triggered,
-- dataset_triggered, ...: triggered_by keeps the provider's own names), how many times the
-- run was cleared (dag_run.clear_number, both lines), and the DAG version the task ran
-- (Airflow 3: ti.dag_version_id). All nullable: rows written before this version, by a
-- script or the CLI, and values a line does not have, are NULL (provenance.py reads them).
-- Adding nullable columns without a default rewrites nothing.
ALTER TABLE job_run_attempts
    ADD COLUMN IF NOT EXISTS ti_id uuid,
    ADD COLUMN IF NOT EXISTS run_type text,
    ADD COLUMN IF NOT EXISTS clear_number integer,
    ADD COLUMN IF NOT EXISTS dag_version_id uuid;
