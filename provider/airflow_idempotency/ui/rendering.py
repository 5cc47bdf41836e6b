"""How the view's pages are rendered: templates (`ui/templates/`), filters, links, and JSON twins.

The Jinja templates, their filters, the links between pages, and the JSON encoding of the same
data (line-neutral).

The templates (``templates/``) are rendered by this module's own Jinja environment on both
Airflow lines; what differs between the lines is the :class:`Links` object a page gets
(Airflow's own URLs, the REST API the rerun posts to) and the layout around the content.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import functools
import html
import ipaddress
import json
import re
import uuid
from dataclasses import dataclass
from importlib.resources import files
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from markupsafe import Markup

from airflow_idempotency.ui import MOUNT, NAV_ROUTE

STATES = ("completed", "failed", "started")
"""The statuses the run-key list filters by."""


def _ts(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _duration(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None or end is None:
        return ""
    seconds = (end - start).total_seconds()
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _age(value: dt.timedelta | None) -> str:
    """``3 h 12 min``, ``4 min 05 s``, ``12 s``."""
    if value is None:
        return ""
    seconds = int(value.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def _details(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, default=str) if value else ""


def _counts(details: Any) -> str:
    """The numeric counts of a run's details, short: ``invoices_created=40 orders_seen=40``."""
    if not isinstance(details, dict):
        return ""
    return " ".join(
        f"{k}={v}"
        for k, v in sorted(details.items())
        if isinstance(v, int | float) and v is not True
    )


_AS_TEXT = (
    ipaddress.IPv4Address,
    ipaddress.IPv6Address,
    ipaddress.IPv4Interface,
    ipaddress.IPv6Interface,
    uuid.UUID,
)


def calendar_cells(cells: list[dict[str, Any] | None], key_url: str) -> Markup:
    """One row of a calendar's cells as HTML (``key_url`` + a key: its page).

    Written in Python, not in the template: a 3-year calendar has over a thousand cells,
    and the template's loop spent most of the page's time on them (BENCHMARKS.md). The
    keys are the calendar's own (well-formed periods), escaped all the same.
    """
    href = html.escape(key_url)
    out: list[str] = []
    append = out.append
    for cell in cells:
        if cell is None:
            append('<td class="off"></td>')
            continue
        raw = cell["run_key"]
        key = html.escape(raw)
        state = html.escape(cell["state"])
        if state == "none":
            append(
                f'<td class="cal-none" title="{key}: no record (outside the job&#x27;s keys)"></td>'
            )
            continue
        locked = cell.get("locked")
        title = f"{key}: {state}, locked now" if locked else f"{key}: {state}"
        if "attempt_count" in cell:
            title += f"; {cell['attempt_count']} attempt(s)"
            if cell.get("details"):
                title += "; " + html.escape(_counts(cell["details"]))
        link = key if _PLAIN_KEY.fullmatch(raw) else html.escape(quote(raw, safe=""))
        period = html.escape(str(cell.get("period") or raw))  # a segmented key's period part
        append(
            f'<td class="cal-{state}{" locked" if locked else ""}" data-key="{key}" '
            f'data-state="{state}" data-period="{period}" title="{title}">'
            f'<a href="{href}{link}"></a></td>'
        )
    return Markup("".join(out))


_PLAIN_KEY = re.compile(r"[0-9A-Za-z_.-]*")


def _json_default(value: Any) -> Any:
    """What ``json.dumps`` cannot encode itself, as FastAPI's jsonable_encoder would encode
    it (ISO timestamps, seconds for durations, addresses as text), without FastAPI (the
    2.11 webserver has none); records (dataclasses) one level at a time,
    never deep-copied (``dataclasses.asdict`` and jsonable_encoder took most of a
    calendar's time: BENCHMARKS.md)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):  # sum() of bigint is numeric in Postgres
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, _AS_TEXT):  # inet (a lock holder's client address), uuid
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json(data: dict[str, Any]) -> str:
    """A page's data as the JSON its twin under ``/api`` answers."""
    return json.dumps(data, default=_json_default, separators=(",", ":"))


@dataclass(frozen=True)
class Links:
    """URLs of this view's pages and of Airflow 3's, for one request (its root path)."""

    app_root: str
    airflow_root: str

    @classmethod
    def under(cls, root_path: str) -> Links:
        """The links of an app mounted at ``root_path`` (``[api] base_url``'s path + MOUNT)."""
        root = root_path.rstrip("/")
        airflow_root = root[: -len(MOUNT)] if root.endswith(MOUNT) else root
        return cls(root, airflow_root)

    def page(self, path: str, **params: Any) -> str:
        """A page of this view; a trailing ``_`` of a parameter's name is dropped (``from_``)."""
        query = urlencode(
            {k.removesuffix("_"): v for k, v in params.items() if v not in (None, "")}
        )
        return f"{self.app_root}{path}" + (f"?{query}" if query else "")

    def key(self, job_name: str, run_key: str) -> str:
        return self.page("/keys", job=job_name, run_key=run_key)

    def calendar(
        self,
        job_name: str,
        from_key: str | None = None,
        to_key: str | None = None,
        segment: str | None = None,
    ) -> str:
        return self.page("/calendar", job=job_name, from_=from_key, to_=to_key, segment=segment)

    def dag_tab(self, dag_id: str, **params: Any) -> str:
        return self.page(f"/dags/{quote(dag_id, safe='')}", **params)

    def run_tab(self, dag_id: str, run_id: str, **params: Any) -> str:
        return self.page(f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}", **params)

    # -- Airflow's own pages and API (what differs between the lines) -----------------------

    def airflow_dag(self, dag_id: str) -> str:
        return f"{self.airflow_root}/dags/{quote(dag_id, safe='')}"

    def airflow_run(self, dag_id: str, run_id: str) -> str:
        return f"{self.airflow_dag(dag_id)}/runs/{quote(run_id, safe='')}"

    def airflow_runs(self, dag_id: str) -> str:
        """The prefix of a DAG run's page: the rerun links ``<this><run id, URL-encoded>``."""
        return f"{self.airflow_dag(dag_id)}/runs/"

    def airflow_task(self, dag_id: str, run_id: str, task_id: str, map_index: int | None) -> str:
        url = f"{self.airflow_run(dag_id, run_id)}/tasks/{quote(task_id, safe='')}"
        return url if map_index is None else f"{url}/mapped/{map_index}"

    def airflow_partition(self, dag_id: str, partition_key: str) -> str:
        """Airflow's list of the DAG's runs of one partition (Airflow 3.2+)."""
        pattern = urlencode({"partition_key_pattern": partition_key})
        return f"{self.airflow_dag(dag_id)}/runs?{pattern}"

    def trigger_api(self, dag_id: str) -> str:
        """Where the rerun posts a new DAG run (Airflow's REST API)."""
        return f"{self.airflow_root}/api/v2/dags/{quote(dag_id, safe='')}/dagRuns"

    def rerun_attributes(self) -> Markup:
        """More attributes of a rerun form: Airflow 3's API takes ``"logical_date": null``."""
        return Markup(" data-no-logical-date")

    def body_attributes(self) -> Markup:
        """Attributes of a page's ``<body>`` for its script (how it is framed)."""
        return Markup("")


@dataclass(frozen=True)
class Airflow2Links(Links):
    """URLs of the view's pages and of Airflow 2.11's, for one request.

    The pages are shown in an iframe of the view's own page in Airflow's layout
    (``frame_root`` serves the documents, ``top_root`` the pages around them); Airflow's own
    pages are its grid view; the rerun posts to the stable REST API with the form's CSRF
    token (as Airflow 2's own pages send it to that API).
    """

    top_root: str = ""
    csrf_token: str = ""

    def airflow_dag(self, dag_id: str) -> str:
        return f"{self.airflow_root}/dags/{quote(dag_id, safe='')}/grid"

    def airflow_run(self, dag_id: str, run_id: str) -> str:
        return f"{self.airflow_runs(dag_id)}{quote(run_id, safe='')}"

    def airflow_runs(self, dag_id: str) -> str:
        return f"{self.airflow_dag(dag_id)}?dag_run_id="

    def airflow_task(self, dag_id: str, run_id: str, task_id: str, map_index: int | None) -> str:
        url = f"{self.airflow_run(dag_id, run_id)}&task_id={quote(task_id, safe='')}"
        return url if map_index is None else f"{url}&map_index={map_index}"

    def trigger_api(self, dag_id: str) -> str:
        return f"{self.airflow_root}/api/v1/dags/{quote(dag_id, safe='')}/dagRuns"

    def rerun_attributes(self) -> Markup:
        return Markup(' data-csrf="{}"').format(self.csrf_token)

    def body_attributes(self) -> Markup:
        return Markup(' data-top-root="{}" data-frame-root="{}"').format(
            self.top_root, self.app_root
        )


@functools.cache
def environment() -> jinja2.Environment:
    """The templates' environment (built once per process)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(files("airflow_idempotency.ui") / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(ts=_ts, details=_details, counts=_counts, age=_age)
    env.globals.update(
        duration=_duration, nav_route=NAV_ROUTE, states=STATES, calendar_cells=calendar_cells
    )
    return env


def render(template: str, **context: Any) -> str:
    """A page: ``template`` with ``context`` (``links`` and ``settings`` among it)."""
    return environment().get_template(template).render(**context)


__all__ = ["STATES", "Airflow2Links", "Links", "environment", "render", "to_json"]
