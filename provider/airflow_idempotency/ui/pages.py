"""What each page of the view shows: its query, and the data function that reads it.

Line-neutral: the Airflow 3 routes (:mod:`.routes`) and the Airflow 2.11 views
(:mod:`.fab`) call the same functions with the same query objects, and render their data
with the same templates (or answer it as JSON). A query object is a pydantic model: FastAPI
reads it from the query string (``Annotated[OverviewQuery, Query()]``), Flask validates
``request.args`` with it; each parameter, its alias and its limits are written once, here.

A data function gets the page's reader (one snapshot of the job database, for the user) and
the user's :class:`Access` to Airflow (may they trigger a DAG, is it paused), and returns the
template's context. What a user may not see raises :class:`PageError` (404).
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from airflow_idempotency.ui.reads import RecordsReader, RunFilters
from airflow_idempotency.ui.rendering import STATES

TEXT_LIMIT = 400
"""The longest value a query parameter may have (job names and run keys are shorter)."""


class PageError(Exception):
    """A page that cannot be shown for this request: ``status`` (400, 404) and why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def not_visible(what: str) -> PageError:
    return PageError(404, f"{what} is not recorded, or you may not read its DAG.")


class Access(Protocol):
    """What the signed-in user may do in Airflow, as the line's auth manager says."""

    def can_trigger(self, dag_id: str | None) -> bool:
        """Whether the user may create runs of ``dag_id``."""

    def dag_is_paused(self, dag_id: str) -> bool | None:
        """Whether the DAG is paused (a triggered run then waits); None if Airflow does not
        know it."""


class _Query(BaseModel):
    # populate_by_name: FastAPI 0.117 (Airflow 3.1's lock) hands a query model its values by
    # field name, not by alias (``from``, ``to``: they were lost); 0.136 (3.2, 3.3) by alias.
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


def _text(default: Any = None, **kwargs: Any) -> Any:
    return Field(default, max_length=TEXT_LIMIT, **kwargs)


def _key_part(**kwargs: Any) -> Any:
    return Field(min_length=1, max_length=TEXT_LIMIT, **kwargs)


class OverviewQuery(_Query):
    """The overview's filters of the run-key list, and where its page starts."""

    job: str | None = _text()
    status: str | None = _text()
    dag_id: str | None = _text()
    from_key: str | None = _text(alias="from")
    to_key: str | None = _text(alias="to")
    before_key: str | None = _text()
    before_job: str | None = _text()


class DagQuery(_Query):
    """A DAG's run keys: where the page starts."""

    before_key: str | None = _text()


class RunQuery(_Query):
    """A DAG run's attempts, of one task or all."""

    task_id: str | None = _text()


class CalendarQuery(_Query):
    """A job's calendar, by default its newest periods, or ``from`` .. ``to`` (run keys)."""

    job: str = _key_part()
    from_key: str | None = _text(alias="from")
    to_key: str | None = _text(alias="to")
    segment: str | None = _text()  # the labels of a segmented job's keys: eu (eu|2026-10-01)


class KeyQuery(_Query):
    """One run key of one job."""

    job: str = _key_part()
    run_key: str = _key_part()


# -- the data of each page (the template's context; the JSON twin answers it whole) --------


def overview(reader: RecordsReader, query: OverviewQuery) -> dict[str, Any]:
    if query.status is not None and query.status not in STATES:
        raise PageError(400, f"status must be one of {', '.join(STATES)}")
    filters = RunFilters(query.job, query.status, query.dag_id, query.from_key, query.to_key)
    before = (query.before_key, query.before_job) if query.before_key and query.before_job else None
    return {"filters": filters, "overview": reader.overview(filters, before)}


def dag(reader: RecordsReader, access: Access, dag_id: str, query: DagQuery) -> dict[str, Any]:
    return {
        "dag": reader.dag_keys(dag_id, query.before_key),
        "can_trigger": access.can_trigger(dag_id),
        "paused": access.dag_is_paused(dag_id),
        "before_key": query.before_key,
    }


def run(reader: RecordsReader, dag_id: str, run_id: str, query: RunQuery) -> dict[str, Any]:
    return {"run": reader.run_attempts(dag_id, run_id, query.task_id)}


def key(reader: RecordsReader, access: Access, query: KeyQuery) -> dict[str, Any]:
    detail = reader.key(query.job, query.run_key)
    if detail is None:
        raise not_visible(f"Run key {query.run_key!r} of job {query.job!r}")
    dag_id = detail.run["dag_id"] if detail.run else None
    return {
        "key": detail,
        "dag_id": dag_id,
        "can_trigger": access.can_trigger(dag_id),
        "paused": access.dag_is_paused(dag_id) if dag_id else None,
    }


def calendar(reader: RecordsReader, query: CalendarQuery) -> dict[str, Any]:
    found = reader.calendar(query.job, query.from_key, query.to_key, query.segment)
    if found is None:
        raise not_visible(f"Job {query.job!r}")
    return {"calendar": found}


def locks(reader: RecordsReader) -> dict[str, Any]:
    return {"locks": reader.locks()}


__all__ = [
    "Access",
    "CalendarQuery",
    "DagQuery",
    "KeyQuery",
    "OverviewQuery",
    "PageError",
    "RunQuery",
    "calendar",
    "dag",
    "key",
    "locks",
    "overview",
    "run",
]
