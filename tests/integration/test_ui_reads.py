"""The Run keys view's reads (Airflow-free): pages of run keys, and an index behind every
statement (migration 5), against a real PostgreSQL server."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from airflow_idempotency._sql import query
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.run_key import RunKeyRule
from airflow_idempotency.schema import ensure_schema
from airflow_idempotency.ui import calendar
from airflow_idempotency.ui.reads import RecordsReader, RunFilters, Visibility

EVERY_DAG = Visibility(all_dags=True)


def seed(dsn: str, jobs: int, keys: int, attempts_per_key: int = 2) -> None:
    """``jobs`` x ``keys`` job_runs rows (DAG ``dag_<job mod 3>``), their attempts and ledger rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
        conn.execute(
            """
            INSERT INTO idempotency.job_runs (job_name, run_key, lock_key, status, triggered_by,
                dag_id, run_id, task_id, attempt_count, started_at, updated_at, completed_at)
            SELECT 'job_' || j, to_char(date '2020-01-01' + k, 'YYYY-MM-DD'), j * 100000 + k,
                   CASE WHEN k %% 50 = 0 THEN 'failed' ELSE 'completed' END, 'scheduled',
                   'dag_' || (j %% 3), 'scheduled__' || k, 't' || j, 1, now(), now(), now()
            FROM generate_series(1, %(jobs)s) AS j, generate_series(1, %(keys)s) AS k
            """,
            {"jobs": jobs, "keys": keys},
        )
        conn.execute(
            """
            INSERT INTO idempotency.job_run_attempts (job_name, run_key, lock_key, outcome,
                triggered_by, dag_id, run_id, task_id, try_number, hostname, pid, finished_at)
            SELECT r.job_name, r.run_key, r.lock_key, CASE WHEN a = 1 THEN 'completed' ELSE 'noop' END,
                   'scheduled', r.dag_id, r.run_id, r.task_id, a, 'host', 1, now()
            FROM idempotency.job_runs AS r, generate_series(1, %(n)s) AS a
            """,
            {"n": attempts_per_key},
        )
        conn.execute(
            """
            INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,
                run_key, request_fingerprint, status)
            SELECT 'remote', r.job_name || ':' || r.run_key || ':' || e, r.job_name, r.run_key, 'f',
                   CASE WHEN e = 1 AND r.status = 'failed' THEN 'pending' ELSE 'succeeded' END
            FROM idempotency.job_runs AS r, generate_series(1, 3) AS e
            """
        )
        conn.execute("ANALYZE")


def test_run_keys_come_page_by_page_each_once(pg_dsn: str) -> None:
    """Paging through the run keys (newest first, then job) returns every row exactly once,
    with and without filters."""
    seed(pg_dsn, jobs=3, keys=7)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        reader = RecordsReader(conn, "idempotency", EVERY_DAG)
        for filters in (
            RunFilters(),
            RunFilters(dag_id="dag_1"),
            RunFilters(from_key="2020-01-04"),
        ):
            seen: list[tuple[str, str]] = []
            before = None
            while True:
                page, before = reader.runs(filters, before, limit=4)
                seen += [(r["run_key"], r["job_name"]) for r in page]
                if before is None:
                    break
            with conn.cursor() as cur:
                expected = cur.execute(
                    "SELECT run_key, job_name FROM idempotency.job_runs"
                    " WHERE (%(d)s::text IS NULL OR dag_id = %(d)s)"
                    " AND (%(f)s::text IS NULL OR run_key >= %(f)s) ORDER BY 1 DESC, 2 DESC",
                    {"d": filters.dag_id, "f": filters.from_key},
                ).fetchall()
            assert seen == [tuple(r) for r in expected], filters


def test_a_dag_sees_only_its_records(pg_dsn: str) -> None:
    """A reader authorized on one DAG gets only the rows recorded by it, in every statement."""
    seed(pg_dsn, jobs=3, keys=4)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        reader = RecordsReader(conn, "idempotency", Visibility(False, frozenset({"dag_1"})))
        overview = reader.overview(RunFilters())
        assert {r["dag_id"] for r in overview.runs} == {"dag_1"}
        assert {r["dag_id"] for r in overview.unconfirmed} <= {"dag_1"}
        assert reader.key("job_2", "2020-01-02") is None  # job_2 is dag_2's
        assert reader.key("job_1", "2020-01-02") is not None
        nobody = RecordsReader(conn, "idempotency", Visibility(False))
        assert nobody.runs(RunFilters())[0] == []


# Each statement with parameters as the pages send them.
STATEMENTS: dict[str, dict[str, Any]] = {
    "ui_runs": {
        "job": None,
        "status": None,
        "dag_id": None,
        "from_key": None,
        "to_key": None,
        "before_key": "2020-03-01",
        "before_job": "job_5",
        "limit": 51,
    },
    "ui_attention": {"limit": 20},
    "ui_locks": {},
    "ui_unconfirmed": {"limit": 20},
    "ui_unconfirmed_by_remote": {},
    "ui_dag_jobs": {"dag_id": "dag_1", "limit": 40},
    "ui_dag_keys": {"jobs": ["job_1", "job_4"], "before_key": None, "limit": 31},
    "ui_run_attempts": {"dag_id": "dag_1", "run_id": "scheduled__5", "task_id": None, "limit": 500},
    "ui_key_attempts": {"job": "job_1", "run_key": "2020-01-05", "limit": 200},
    "ui_key_lease": {"lock_key": 1},
    "ui_jobs": {"limit": 200},
    "ui_open_by_job": {},
    "ui_job_bounds": {"job": "job_1"},
    "ui_job_calendar": {
        "job": "job_1",
        "from_key": "2020-01-01",
        "to_key": "2020-12-31",
        "limit": 744,
    },
    "cli_ledger_summary": {"job": "job_1", "run_key": "2020-01-05", "all": True},
    "cli_ledger_problems": {"job": "job_1", "run_key": "2020-01-05", "limit": 50},
}
BIG_TABLES = ("job_runs", "job_run_attempts", "outbound_ledger")


def rows_read(plan: dict[str, Any]) -> dict[str, int]:
    """Rows each bookkeeping table gave a plan's scans, filtered out or not, over all loops."""
    found: dict[str, int] = {}
    relation = plan.get("Relation Name")
    if relation in BIG_TABLES:
        rows = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        rows += plan.get("Rows Removed by Index Recheck", 0)
        found[relation] = found.get(relation, 0) + int(rows * plan["Actual Loops"])
    for child in plan.get("Plans", []):
        for name, count in rows_read(child).items():
            found[name] = found.get(name, 0) + count
    return found


@pytest.mark.parametrize(
    "visibility", [EVERY_DAG, Visibility(False, frozenset({"dag_1", "dag_2"}))], ids=["all", "some"]
)
def test_every_statement_of_the_view_reads_through_an_index(
    pg_dsn: str, visibility: Visibility
) -> None:
    """No statement of the view reads a whole bookkeeping table: with 3,000 run keys, 6,000
    attempts and 9,000 ledger rows, each reads at most a few hundred rows (the indexes of
    migration 5; without them ui_runs, ui_dag_jobs, ui_run_attempts and ui_unconfirmed read
    thousands). BENCHMARKS.md has the timings at size."""
    seed(pg_dsn, jobs=10, keys=300)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name, params in STATEMENTS.items():
            ((plan,),) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + query(name, "idempotency"),
                {**visibility.params, **params},
            ).fetchall()
            read = rows_read(plan[0]["Plan"])
            assert sum(read.values()) <= 400, (name, read)


@pytest.mark.parametrize(
    ("newest", "window", "rows", "first_row", "columns"),
    [
        ("2026-10-05T03Z", ("2026-09-29T00Z", "2026-10-05T23Z"), 7, "2026-09-29", 24),
        ("2026-10-05", ("2025-11-01", "2026-10-31"), 12, "2025-11", 31),
        ("2026-W40", ("2024-W01", "2026-W53"), 3, "2024", 53),
        ("2026-10", ("2017-01", "2026-12"), 10, "2017", 12),
    ],
    ids=["hour", "day", "week", "month"],
)
def test_calendar_windows_are_whole_rows_of_each_period(
    newest: str, window: tuple[str, str], rows: int, first_row: str, columns: int
) -> None:
    """By default a calendar shows whole rows ending with the newest key's: a week of hours
    (rows of UTC days), a year of days (rows of months), 3 ISO years of weeks, 10 years of
    months; each row lists every period of its unit once, in order, and the next window
    starts right after this one."""
    period = RunKeyRule.for_key(newest).period
    shown = calendar.default_window(period, newest)
    assert (shown.from_key, shown.to_key) == window
    grid = shown.grid()
    assert len(grid) == rows and grid[0][0] == first_row
    assert all(len(keys) == columns == len(calendar.columns(period)) for _, keys in grid)
    keys = [k for _, row in grid for k in row if k is not None]
    assert keys == sorted(set(keys)) and (keys[0], keys[-1]) == window
    assert newest in keys
    later = shown.shifted(rows)
    assert later is not None
    following = RunKeyRule(period=period).keys_between(window[1], later.from_key)
    assert len(following) == 2  # nothing between this window's last period and the next's first


def test_calendar_rows_have_only_real_periods() -> None:
    """Rows of months stop at their last day, ISO years at week 52 or 53."""
    (feb,) = calendar.window("day", "2027-02-01", "2027-02-28").grid()
    assert feb[1][27] == "2027-02-28" and feb[1][28:] == [None, None, None]
    short, long_ = calendar.window("week", "2025-W01", "2026-W53").grid()
    assert short[1][-1] is None and long_[1][-1] == "2026-W53"
    with pytest.raises(InvalidInputError, match="not a real"):
        calendar.window("week", "2025-W53", "2025-W53")
