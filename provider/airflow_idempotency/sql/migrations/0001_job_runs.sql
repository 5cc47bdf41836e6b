-- Version 1: run records. Applied by schema.py inside one transaction, with
-- search_path set to the configured schema and an advisory transaction lock held.

CREATE TABLE IF NOT EXISTS job_runs (
    job_name            text        NOT NULL,
    run_key             text        NOT NULL,
    lock_key            bigint      NOT NULL,
    status              text        NOT NULL
        CONSTRAINT job_runs_status_check CHECK (status IN ('started', 'completed', 'failed')),
    triggered_by        text        NOT NULL,
    triggering_user     text,
    dag_id              text,
    run_id              text,
    task_id             text,
    attempt_count       integer     NOT NULL DEFAULT 0,
    current_attempt_id  bigint,
    started_at          timestamptz NOT NULL,
    completed_at        timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    details             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (job_name, run_key)
);

CREATE INDEX IF NOT EXISTS job_runs_status_idx ON job_runs (status, updated_at);

CREATE TABLE IF NOT EXISTS job_run_attempts (
    attempt_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_name          text        NOT NULL,
    run_key           text        NOT NULL,
    lock_key          bigint      NOT NULL,
    outcome           text        NOT NULL
        CONSTRAINT job_run_attempts_outcome_check CHECK (outcome IN (
            'running', 'completed', 'failed', 'noop', 'lock_held', 'dry_run', 'lock_lost', 'reset'
        )),
    triggered_by      text        NOT NULL,
    triggering_user   text,
    dag_id            text,
    run_id            text,
    task_id           text,
    try_number        integer,
    map_index         integer,
    hostname          text        NOT NULL,
    pid               integer     NOT NULL,
    lock_backend_pid  integer,
    force             boolean     NOT NULL DEFAULT false,
    dry_run           boolean     NOT NULL DEFAULT false,
    started_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    error             text,
    details           jsonb       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX IF NOT EXISTS job_run_attempts_key_idx
    ON job_run_attempts (job_name, run_key, attempt_id);
