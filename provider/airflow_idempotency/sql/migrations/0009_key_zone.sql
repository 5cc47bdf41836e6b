-- Version 9: the zone a run key was made in. A day, week or month key names a period only
-- together with the timezone its bounds were read in ('2026-10-01' in Europe/Amsterdam
-- starts 2026-09-30 22:00 UTC); hour keys are UTC and keys of no period (labels, a
-- callable's) have none: NULL, as every row written before this version.
-- A run whose key was made in another zone than the job's earlier keys is refused before
-- anything is written (run_key.py: the zone rule; queries.sql: key_zone_conflict).
-- Adding a nullable column rewrites nothing; the partial index is small (one entry per
-- zoned row) and serves the conflict check of every run start.
ALTER TABLE job_runs ADD COLUMN IF NOT EXISTS key_zone text;

CREATE INDEX IF NOT EXISTS job_runs_key_zone_idx
    ON job_runs (job_name, key_zone) WHERE key_zone IS NOT NULL;
