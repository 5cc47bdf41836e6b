"""Adopting history: the keys whose Airflow runs already succeeded, recorded as completed.

Before the contract (the cluster policy, or a rewrite around the operator) protects a DAG,
its history is in Airflow alone: the first run of an old date under the contract would
recompute it. :func:`plan` reads the DAG's successful runs between two days (Airflow's REST
API on 3.x, :class:`ApiRuns`; its metadata database on 2.11, :func:`metadata_runs`), maps
each to the run key of every protected task by the same rules as a run would
(:mod:`airflow_idempotency.airflow_task`), and says what adopting would do; :func:`apply`
records the new ones as completed, ``triggered_by = 'adopted'``, with the Airflow run they
came from in ``details.adopted_from`` and in one ``completed`` attempt. A key with any record
already, or whose run lock is held, is left as it is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from airflow_idempotency._sql import query, query_rows
from airflow_idempotency._transactions import bounded_transaction
from airflow_idempotency.exceptions import ConfigurationError, InvalidInputError
from airflow_idempotency.key_zone import check_key_zone
from airflow_idempotency.leases import lease_is_live
from airflow_idempotency.locks import run_lock_key

API_URL_ENV = "AIRFLOW_IDEMPOTENCY_API_URL"
API_TOKEN_ENV = "AIRFLOW_IDEMPOTENCY_API_TOKEN"
API_USER_ENV = "AIRFLOW_IDEMPOTENCY_API_USER"
API_PASSWORD_ENV = "AIRFLOW_IDEMPOTENCY_API_PASSWORD"
PAGE = 100
_EARLIEST = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class SucceededRun:
    """A DAG run Airflow records as succeeded."""

    run_id: str
    run_type: str
    logical_date: dt.datetime | None
    end_date: dt.datetime | None
    conf: dict[str, Any] = field(default_factory=dict)
    partition_key: str | None = None
    task_states: dict[str, str] | None = None
    """task_id -> the state of its task instance(s) in the run (:func:`task_states`): a
    succeeded run may hold a task that failed (a downstream ``all_done`` leaf succeeded) or
    none of a task added to the DAG later; ``None``: not read (every task taken)."""

    def as_details(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_type": self.run_type,
            "logical_date": self.logical_date.isoformat() if self.logical_date else None,
            "end_date": self.end_date.isoformat() if self.end_date else None,
            "partition_key": self.partition_key,
        }


def task_states(instances: Iterable[tuple[str, str | None]]) -> dict[str, str]:
    """task_id -> its state from ``(task_id, state)`` of a run's task instances: ``success``
    only when every instance (every map index) succeeded, else one that did not."""
    states: dict[str, str] = {}
    for task_id, state in instances:
        state = str(state or "none")
        if states.get(task_id, "success") == "success":
            states[task_id] = state
    return states


def _instant(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class ApiRuns:
    """Airflow 3's REST API: ``GET /api/v2/dags/{dag_id}/dagRuns`` (state success), page by
    page. Authenticated with ``AIRFLOW_IDEMPOTENCY_API_TOKEN``, or a token asked of
    ``/auth/token`` for ``AIRFLOW_IDEMPOTENCY_API_USER`` / ``..._PASSWORD``, or none."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._token = os.environ.get(API_TOKEN_ENV)

    def _call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if auth and (token := self._auth_token()):
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}{path}", data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            hint = (
                f" Set {API_TOKEN_ENV}, or {API_USER_ENV} and {API_PASSWORD_ENV}."
                if exc.code in (401, 403)
                else ""
            )
            raise InvalidInputError(
                f"Airflow's API answered {method} {path} with {exc.code}: {detail}.{hint}"
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise InvalidInputError(
                f"cannot reach Airflow's API at {self.base_url} ({exc}): pass --api-url "
                f"(or set {API_URL_ENV}) to the api-server's address"
            ) from exc

    def _auth_token(self) -> str | None:
        user = os.environ.get(API_USER_ENV)
        if self._token is None and user:
            body = {"username": user, "password": os.environ.get(API_PASSWORD_ENV, "")}
            self._token = str(self._call("POST", "/auth/token", body, auth=False)["access_token"])
        return self._token

    def succeeded(self, dag_id: str, first: dt.datetime, last: dt.datetime) -> list[SucceededRun]:
        """The DAG's succeeded runs whose logical date is in [first, last)."""
        runs: list[SucceededRun] = []
        while True:
            params = urllib.parse.urlencode(
                {
                    "state": "success",
                    "logical_date_gte": first.isoformat(),
                    "logical_date_lt": last.isoformat(),
                    "order_by": "logical_date",
                    "limit": PAGE,
                    "offset": len(runs),
                }
            )
            path = f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns?{params}"
            page = self._call("GET", path)["dag_runs"]
            runs += [_api_run(r) for r in page]
            if len(page) < PAGE:
                break
        return [
            dataclasses.replace(r, task_states=self.task_states(dag_id, r.run_id)) for r in runs
        ]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        """task_id -> state of the run's task instances
        (``GET /api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances``)."""
        found: list[tuple[str, str | None]] = []
        dag, run = (urllib.parse.quote(part, safe="") for part in (dag_id, run_id))
        while True:
            params = urllib.parse.urlencode({"limit": PAGE, "offset": len(found)})
            path = f"/api/v2/dags/{dag}/dagRuns/{run}/taskInstances?{params}"
            page = self._call("GET", path)["task_instances"]
            found += [(str(ti["task_id"]), ti.get("state")) for ti in page]
            if len(page) < PAGE:
                return task_states(found)


def _api_run(row: dict[str, Any]) -> SucceededRun:
    return SucceededRun(
        run_id=row["dag_run_id"],
        run_type=str(row.get("run_type") or "unknown"),
        logical_date=_instant(row.get("logical_date")),
        end_date=_instant(row.get("end_date")),
        conf=dict(row.get("conf") or {}),
        partition_key=row.get("partition_key"),
    )


def metadata_runs(dag_id: str, first: dt.datetime, last: dt.datetime) -> list[SucceededRun]:
    """Airflow 2.11's metadata database: the DAG's succeeded runs whose logical date is in
    [first, last), through its own models."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from sqlalchemy import select

    with create_session() as session:
        found = session.scalars(
            select(DagRun)
            .where(
                DagRun.dag_id == dag_id,
                DagRun.state == DagRunState.SUCCESS,
                DagRun.execution_date >= first,
                DagRun.execution_date < last,
            )
            .order_by(DagRun.execution_date)
        ).all()
        instances: dict[str, list[tuple[str, str | None]]] = {}
        if found:
            for ti in session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == dag_id,
                    TaskInstance.run_id.in_([r.run_id for r in found]),
                )
            ):
                state = None if ti.state is None else str(getattr(ti.state, "value", ti.state))
                instances.setdefault(ti.run_id, []).append((ti.task_id, state))
        return [
            SucceededRun(
                run_id=r.run_id,
                run_type=str(getattr(r.run_type, "value", r.run_type)),
                logical_date=r.execution_date,
                end_date=r.end_date,
                conf=dict(r.conf or {}),
                task_states=task_states(instances.get(r.run_id, [])),
            )
            for r in found
        ]


# -- the plan ---------------------------------------------------------------------------


@dataclass
class Adoption:
    """One (task, run) of the plan: its key, and what adopting does with it."""

    run: SucceededRun
    task_id: str
    job_name: str
    run_key: str | None
    would: str  # adopt | recorded | duplicate | refused
    status: str | None = None  # the key's job_runs status, if recorded
    reason: str = ""
    key_zone: str | None = None  # the zone the key was made in (the zone rule)

    def as_dict(self) -> dict[str, Any]:
        return {
            "logical_date": self.run.logical_date,
            "run_id": self.run.run_id,
            "task_id": self.task_id,
            "job_name": self.job_name,
            "run_key": self.run_key,
            "status": self.status,
            "would": self.would,
            "reason": self.reason,
        }


def protected_tasks(dag: Any) -> list[tuple[str, Any]]:
    """``(job_name, key of a run)`` makers of each task the contract protects: those the
    cluster policy covers, and the idempotent operators (their own job names and rules)."""
    from airflow_idempotency import airflow_task, policy
    from airflow_idempotency.operator import IdempotentRunOperator
    from airflow_idempotency.run_key import RunKeyRule

    found: list[tuple[str, Any]] = []
    for task in sorted(dag.tasks, key=lambda t: t.task_id):
        if isinstance(task, IdempotentRunOperator):
            found.append((task.effective_job_name, task))
        elif policy.protected(task):
            mapping = airflow_task.KeyMapping(RunKeyRule())
            found.append((f"{dag.dag_id}.{task.task_id}", _PolicyKeys(task, mapping)))
    if not found:
        raise InvalidInputError(
            f"DAG {dag.dag_id!r} has no task under the contract: tag it with one of "
            "[idempotency] policy_dag_tags (docs/policy.md) or use IdempotentRunOperator"
        )
    return found


@dataclass(frozen=True)
class _PolicyKeys:
    task: Any
    mapping: Any

    @property
    def task_id(self) -> str:
        return str(self.task.task_id)

    def explain_run_key(
        self,
        *,
        partition_key: str | None = None,
        partition_date: dt.datetime | None = None,
        **run: Any,
    ) -> Any:
        from airflow_idempotency import airflow_task

        partition = (partition_key, partition_date)
        return airflow_task.explained_run_key(
            self.mapping, self.task.dag, partition=partition, **run
        )


def plan(
    dag: Any, runs: Iterable[SucceededRun], conn: psycopg.Connection | None, schema: str
) -> list[Adoption]:
    """What adopting ``runs`` of ``dag`` would do, per protected task and run: ``adopt``
    (no record of the key yet), ``recorded`` (a record exists: left alone), ``duplicate``
    (an earlier row of this plan adopts the key: its latest run is the one recorded) or
    ``refused`` (no key: the reason)."""
    tasks = protected_tasks(dag)
    rows: list[Adoption] = []
    for run in sorted(runs, key=lambda r: r.end_date or _EARLIEST, reverse=True):
        for job_name, keys in tasks:
            rows.append(_adoption(run, job_name, keys))
    states = _states(conn, schema, [(a.job_name, a.run_key) for a in rows if a.run_key])
    seen: set[tuple[str, str]] = set()
    for row in rows:
        if row.run_key is None:
            continue
        pair = (row.job_name, row.run_key)
        row.status = states.get(pair)
        if row.status is not None:
            row.would = "recorded"
        elif pair in seen:
            row.would, row.reason = "duplicate", "a later successful run of this key is adopted"
        seen.add(pair)
    return sorted(rows, key=lambda a: (a.run.logical_date or _EARLIEST, a.task_id))


def _adoption(run: SucceededRun, job_name: str, keys: Any) -> Adoption:
    from airflow_idempotency import airflow_task

    if run.task_states is not None and run.task_states.get(keys.task_id) != "success":
        state = run.task_states.get(keys.task_id)
        why = f"its state is {state}" if state else "it has no task instance in the run"
        return Adoption(
            run,
            keys.task_id,
            job_name,
            None,
            "refused",
            reason=f"task {keys.task_id!r} did not succeed in run {run.run_id!r} ({why})",
        )
    try:
        if airflow_task.flag(run.conf, {}, "dry_run"):
            return Adoption(
                run,
                keys.task_id,
                job_name,
                None,
                "refused",
                reason=f"run {run.run_id!r} is a dry run (conf dry_run): under the contract "
                "it did not do the work; the date runs under the contract next time",
            )
        resolved = keys.explain_run_key(
            kind=run.run_type,
            logical_date=run.logical_date,
            conf=run.conf,
            partition_key=run.partition_key,
        )
    except InvalidInputError as exc:
        return Adoption(run, keys.task_id, job_name, None, "refused", reason=str(exc))
    return Adoption(run, keys.task_id, job_name, resolved.run_key, "adopt", key_zone=resolved.zone)


def _states(
    conn: psycopg.Connection | None, schema: str, pairs: list[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    if conn is None or not pairs:
        return {}
    params = {"job_names": [p[0] for p in pairs], "run_keys": [p[1] for p in pairs]}
    found = query_rows(conn, "adopt_states", schema, params)
    return {(r["job_name"], r["run_key"]): r["status"] for r in found}


def apply(conn: psycopg.Connection, schema: str, dag_id: str, rows: list[Adoption]) -> None:
    """Record every ``adopt`` row as completed, one transaction per key, with the zone its
    key was made in, under the key's run lock; a key recorded or locked meanwhile (by a
    run's lock session, or its live lease in the lease mode) is left alone (its row then says
    ``recorded`` or ``locked``), and so is one made in another zone than the job's recorded
    keys (``refused``: the zone rule, as a run would be refused).

    Each transaction runs READ COMMITTED whatever the database's default (``conn`` must be
    idle): what is read after the lock must be read in a snapshot taken after it, so that a
    run or a lease that released or took the key just before is seen."""
    previous = conn.isolation_level
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    try:
        for row in rows:
            if row.would == "adopt" and row.run_key is not None:
                _adopt(conn, schema, dag_id, row, row.run_key)
    finally:
        conn.isolation_level = previous


def _adopt(conn: psycopg.Connection, schema: str, dag_id: str, row: Adoption, run_key: str) -> None:
    """One key of :func:`apply`, in a transaction of its own under the key's run lock."""
    lock_key = run_lock_key(row.job_name, run_key)
    params = {
        "job_name": row.job_name,
        "run_key": run_key,
        "lock_key": lock_key,
        "dag_id": dag_id,
        "run_id": row.run.run_id,
        "task_id": row.task_id,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "details": Jsonb({"adopted_from": row.run.as_details()}),
        "key_zone": row.key_zone,
    }
    with bounded_transaction(conn, schema):
        (acquired,) = conn.execute(query("adopt_lock", schema), params).fetchone() or (False,)
        # Held, no lease can be taken (lease_acquire tries this lock): a lease live now,
        # read by a statement after the lock, is a run of the lease mode working on the key.
        if not acquired or lease_is_live(conn, row.job_name, run_key, schema=schema):
            row.would, row.reason = "locked", "another execution holds the key now"
            return
        try:
            check_key_zone(conn, schema, row.job_name, run_key, row.key_zone)
        except ConfigurationError as exc:
            row.would, row.reason = "refused", str(exc)
            return
        adopted = conn.execute(query("adopt_run", schema), params).fetchone()
    if adopted is None:
        row.would, row.reason = "recorded", "recorded meanwhile"
    else:
        row.would = "adopted"
