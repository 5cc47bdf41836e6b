"""What a watch task fails on: the gaps and stale keys of jobs over a window of business dates.

The example's ``idempotency_watch`` DAG calls :func:`watch_problems` daily; a DAG of yours
can too (``from airflow_idempotency.watch import watch_problems``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable

from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.schema import DEFAULT_SCHEMA, validate_schema_name


def watch_problems(
    dag_ids: Iterable[str],
    jobs: Collection[str],
    first: dt.date,
    last: dt.date,
    *,
    as_of: dt.datetime,
    hook: IdempotencyHook | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> list[str]:
    """One line per gap and per stale key of ``jobs`` from ``first`` to ``last``.

    A job's due keys follow the schedules of the DAGs ``dag_ids`` that run it, as they
    stood at ``as_of`` (a weekday-only job's weekends are no gaps, nor is a day whose run
    has not started yet, segments included); a job none of them runs is due every day of
    the window. A key is a gap when it has no completed run; stale when its attempt still
    says running, or it says started, and nobody holds its lock. Reads only; ``hook``
    defaults to the ``idempotency_default`` connection.
    """
    from airflow_idempotency import compat, gaps, planning

    schema = validate_schema_name(schema)
    start = dt.datetime.combine(first, dt.time(), dt.timezone.utc) - dt.timedelta(days=1)
    due: dict[str, set[str]] = {}
    for dag_id in dag_ids:
        due.update(planning.due_keys(compat.load_dag(dag_id), start, as_of))
    watched = {job: due.get(job) for job in jobs}
    with (hook or IdempotencyHook()).new_connection() as conn:
        conn.autocommit = True
        return gaps.problems(conn, schema, watched, first.isoformat(), last.isoformat())
