-- The statements of schema migration (airflow_idempotency/migrator.py), apart from the
-- migrations themselves (sql/migrations/). {schema} is the bookkeeping schema, quoted.

-- name: applied_migrations
-- Which files the database applied, whatever release created the table: to_jsonb reads the
-- checksum column where it exists (earlier releases recorded the number and name only).
SELECT v.version, v.name, to_jsonb(v) ->> 'checksum' AS checksum
FROM {schema}.schema_version AS v
ORDER BY v.version

-- name: begin_migration
-- The first statement of each try: every lock wait of this transaction is bounded
-- (lock_timeout: an ALTER queued behind a long reader gives up and lets the statements queued
-- behind it go), a peer that vanishes mid-migration loses its session within the dead-peer
-- bound (idle_in_transaction_session_timeout, TCP keepalives), and only then is the migration
-- lock taken (the settings are applied first: the subquery is evaluated before the lock).
SELECT pg_catalog.pg_advisory_xact_lock(%(migration_key)s)
FROM (
    SELECT pg_catalog.set_config('lock_timeout', %(lock_timeout)s, true),
           pg_catalog.set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, true),
           pg_catalog.set_config('tcp_keepalives_idle', %(keepalives_idle)s, true),
           pg_catalog.set_config('tcp_keepalives_interval', %(keepalives_interval)s, true),
           pg_catalog.set_config('tcp_keepalives_count', %(keepalives_count)s, true),
           pg_catalog.set_config('tcp_user_timeout', %(tcp_user_timeout)s, true),
           pg_catalog.set_config('search_path', pg_catalog.quote_ident(%(schema)s), true)
    OFFSET 0
) AS settings

-- name: schema_exists
-- Asked before CREATE SCHEMA: CREATE SCHEMA IF NOT EXISTS checks CREATE on the database even
-- when the schema exists, and a schema a DBA created for this role is enough.
SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)

-- name: create_schema
CREATE SCHEMA {schema}

-- name: create_schema_version
CREATE TABLE IF NOT EXISTS {schema}.schema_version (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: add_checksum_column
-- Once per database, when a release that recorded numbers only had migrated it.
ALTER TABLE {schema}.schema_version ADD COLUMN IF NOT EXISTS checksum text

-- name: adopt_migration
-- A file applied by a release that recorded no checksum: its name matched, so it is taken to
-- be this release's file of that number (nothing is run again).
UPDATE {schema}.schema_version SET checksum = %(checksum)s
WHERE version = %(version)s AND checksum IS NULL

-- name: record_migration
INSERT INTO {schema}.schema_version (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s)

-- name: migration_blockers
-- The sessions that hold a lock a migration may wait for: any lock on a table, index or
-- sequence of the bookkeeping schema (every mode conflicts with the ACCESS EXCLUSIVE of an
-- ALTER), or the migration lock itself (another worker migrating). Named in the error (pid,
-- role, application_name, state, when its transaction and its last query began); never the
-- query text, which may hold data.
SELECT a.pid, a.usename, a.application_name, a.state, a.xact_start, a.query_start
FROM pg_catalog.pg_stat_activity AS a
WHERE a.pid <> pg_catalog.pg_backend_pid()
  AND a.pid IN (
      SELECT l.pid
      FROM pg_catalog.pg_locks AS l
      WHERE l.granted
        AND l.database = (
            SELECT d.oid FROM pg_catalog.pg_database AS d
            WHERE d.datname = pg_catalog.current_database()
        )
        AND (
            (l.locktype = 'relation' AND l.relation IN (
                SELECT c.oid FROM pg_catalog.pg_class AS c
                JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                WHERE n.nspname = %(schema)s
            ))
            OR (l.locktype = 'advisory' AND l.objsubid = 1
                AND ((l.classid::bigint << 32) | l.objid::bigint) = %(migration_key)s)
        )
  )
ORDER BY a.xact_start NULLS LAST, a.pid
LIMIT 5
