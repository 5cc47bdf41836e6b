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

from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from airflow_idempotency.ui.parameters import RequiredText, Text, parse_map_index
from airflow_idempotency.ui.reads import RecordsReader, RunFilters
from airflow_idempotency.ui.rendering import STATES


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
    # extra="forbid": a misspelt parameter (?jobs=) is refused, not silently ignored.
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _blank_is_absent(cls, data: Any) -> Any:
        # A form's empty field (the overview's Status "any", an empty Job) means "any".
        if isinstance(data, dict):
            optional = {n for n, f in cls.model_fields.items() if not f.is_required()}
            optional |= {f.alias for n, f in cls.model_fields.items() if n in optional and f.alias}
            return {k: v for k, v in data.items() if not (k in optional and v == "")}
        return data


def _status(value: str | None) -> str | None:
    if value is not None and value not in STATES:
        raise ValueError(f"must be one of {', '.join(STATES)} (or left out for any), not {value!r}")
    return value


class OverviewQuery(_Query):
    """The overview's filters of the run-key list, and where its page starts."""

    job: Text | None = None
    status: Annotated[
        Text | None, AfterValidator(_status), Field(json_schema_extra={"enum": [*STATES]})
    ] = None
    dag_id: Text | None = None
    from_key: Text | None = Field(None, alias="from")
    to_key: Text | None = Field(None, alias="to")
    before_key: Text | None = None
    before_job: Text | None = None

    @model_validator(mode="after")
    def _consistent(self) -> OverviewQuery:
        if self.from_key is not None and self.to_key is not None and self.from_key > self.to_key:
            raise ValueError(f"from={self.from_key!r} comes after to={self.to_key!r}: swap them")
        if (self.before_key is None) != (self.before_job is None):
            raise ValueError(
                "before_key and before_job go together (the next page's link sends both): "
                "send both or neither"
            )
        return self


class DagQuery(_Query):
    """A DAG's run keys: where the page starts."""

    before_key: Text | None = None


class RunQuery(_Query):
    """A DAG run's attempts, of one task or all."""

    task_id: Text | None = None


class CalendarQuery(_Query):
    """A job's calendar, by default its newest periods, or ``from`` .. ``to`` (run keys)."""

    job: RequiredText
    from_key: Text | None = Field(None, alias="from")
    to_key: Text | None = Field(None, alias="to")
    segment: Text | None = None  # the labels of a segmented job's keys: eu (eu|2026-10-01)


class KeyQuery(_Query):
    """One run key of one job."""

    job: RequiredText
    run_key: RequiredText


def _map_index(value: str | None) -> str | None:
    parse_map_index(value)  # a ValueError that says what to send
    return value


class TaskQuery(_Query):
    """A task instance, as the operator's "Run key" link names it (Airflow 2.11)."""

    dag_id: RequiredText
    run_id: RequiredText
    task_id: RequiredText
    map_index: Annotated[
        str | None,
        Field(json_schema_extra={"pattern": r"^(-1|0|[1-9][0-9]{0,9})?$"}),
        AfterValidator(_map_index),
    ] = None

    @property
    def wanted_map_index(self) -> int | None:
        """The map index to look for: None for any (a task that is not mapped)."""
        return parse_map_index(self.map_index)


# -- the data of each page (the template's context; the JSON twin answers it whole) --------


def overview(reader: RecordsReader, query: OverviewQuery) -> dict[str, Any]:
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
    "TaskQuery",
    "calendar",
    "dag",
    "key",
    "locks",
    "overview",
    "run",
]
