"""The Run keys view: what the plugin adds to a task process, and each page's latency.

1. **Plugin load in a task process.** Each sample is a fresh interpreter that imports what
   an Airflow 3 task process has loaded before it integrates plugins (the task runner),
   then times ``airflow.sdk.plugins_manager.integrate_macros_plugins()``: entry-point
   discovery, import and instantiation of every plugin. The two variants alternate, with
   and without this provider's ``airflow.plugins`` entry point (filtered out of the same
   discovery call); the difference is what the plugin adds. (A child's whole wall time,
   ~3 s of imports, varies by far more than that between runs: not a usable figure.)
2. **Pages.** A job database seeded at size (run keys, attempts, ledger rows, a few locks
   held), an Airflow home with DAGs in its metadata DB and the auth manager initialised as
   the api-server does. Each page and its JSON twin is requested through the app in-process (httpx's ASGI
   transport on an event loop: no sockets, no uvicorn) and, interleaved, its **bare
   SELECTs** are timed:
   the same statements (RecordsReader) on a connection already open, with no connection
   set-up, authentication, authorization or rendering. The difference is the app's own
   cost per page.
   The same pages on **Airflow 2.11** (when ``.venv-airflow2`` exists): the webserver's
   Flask app in-process (its test client), signed in through FAB's login form, each page
   (the framed document) and its JSON twin timed the same way.
3. **Connections.** A new connection per request (``psycopg.connect`` and the schema check,
   what the app does) against a checkout from a psycopg_pool pool.
4. **Migration 5** on the seeded tables: the time its indexes take to build (writes to
   those tables wait meanwhile).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.airflow2 import airflow2_python
from bench.common import (
    BenchResult,
    Size,
    at_most,
    bytecode_env,
    database,
    median,
    percentile,
    run_child,
    say,
)
from devtools import airflow_env
from devtools.postgres import PostgresServer

TITLE = "Run keys view: plugin load in a task process, page latency (p95) vs bare SELECTs"
DIST = "airflow-provider-idempotency"
PLUGIN_ADDED_LIMIT_MS = 5.0
PAGE_P95_LIMIT_MS = 200.0  # issue 12: each page and JSON endpoint, server time, p95

# size name -> (plugin samples per variant, jobs, keys per job, DAGs, requests per page,
# attempts per key, ledger rows per key). Full is issue 12's size: 20 jobs x 3 years of
# daily keys (21,920 job_runs), ~200,000 attempts, ~1,000,000 ledger rows.
UI_SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (2, 4, 30, 6, 8, 3, 3),
    "small": (10, 10, 1_000, 20, 40, 9, 10),
    "full": (30, 20, 1_096, 50, 120, 9, 46),
}
LOCKS_HELD = 3


# ---------------------------------------------------------------- 1. plugin load (child)


def child_plugin_load(with_plugin: bool) -> dict[str, Any]:
    """In a fresh interpreter: import the task runner, then time the plugin integration."""
    t_start = time.perf_counter()
    import airflow.sdk.execution_time.task_runner  # noqa: F401  (what a task process has)
    from airflow.sdk import plugins_manager
    from airflow.sdk._shared import module_loading

    discover = module_loading.entry_points_with_dist

    def entry_points_with_dist(group: str) -> Any:
        for entry_point, dist in discover(group):
            if with_plugin or dist.metadata["Name"] != DIST:
                yield entry_point, dist

    module_loading.entry_points_with_dist = entry_points_with_dist
    t0 = time.perf_counter()
    plugins_manager.integrate_macros_plugins()
    ms = (time.perf_counter() - t0) * 1000
    names = sorted(str(p.name) for p in plugins_manager._get_plugins()[0])
    return {"ms": ms, "plugins": names, "before_ms": (t0 - t_start) * 1000}


def _plugin_load(result: BenchResult, samples: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="bench-ui-home-"))
    env_before = dict(os.environ)
    try:
        airflow_env.configure(home)  # the children inherit it
        os.environ.update(bytecode_env(home))  # as an installed wheel has it: bytecode
        timings: dict[bool, list[float]] = {True: [], False: []}
        for with_plugin in (True, False):  # warm-up: writes the bytecode
            run_child("bench.ui:child_plugin_load", {"with_plugin": with_plugin})
        order = [True, False, False, True] * ((samples + 1) // 2)
        for with_plugin in order[: samples * 2]:
            out = run_child("bench.ui:child_plugin_load", {"with_plugin": with_plugin})
            if ("idempotency" in out["plugins"]) != with_plugin:
                raise RuntimeError(f"plugin filter did not work: {out['plugins']}")
            timings[with_plugin].append(out["ms"])
    finally:
        os.environ.clear()
        os.environ.update(env_before)
        shutil.rmtree(home, ignore_errors=True)
    added = median(timings[True]) - median(timings[False])
    result.add("plugin integration without the plugin, median", median(timings[False]), "ms")
    result.add("plugin integration with the plugin, median", median(timings[True]), "ms")
    result.add(
        "plugin load: added to a task process, median",
        added,
        "ms",
        f"<= {PLUGIN_ADDED_LIMIT_MS:g} ms",
        at_most(added, PLUGIN_ADDED_LIMIT_MS),
        f"{samples} fresh processes per variant, alternating",
    )
    result.add(
        "plugin load: added, p95",
        percentile(timings[True], 95) - percentile(timings[False], 95),
        "ms",
    )


# ---------------------------------------------------------------- 2. pages


def seed(
    dsn: str, jobs: int, keys: int, dags: int, attempts: int = 3, effects: int = 3
) -> list[tuple[int, str]]:
    """Run keys of ``jobs`` jobs (job_<j> belongs to dag_<j mod dags>), their attempts and
    ledger rows, one failed key in 50, one unconfirmed effect in each failed key. Returns the
    (lock key, job) of a few keys marked running, whose locks the caller holds."""
    from airflow_idempotency.schema import ensure_schema

    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
        conn.execute(
            """
            INSERT INTO idempotency.job_runs (job_name, run_key, lock_key, status, triggered_by,
                dag_id, run_id, task_id, attempt_count, started_at, updated_at, completed_at,
                details)
            SELECT 'job_' || j, to_char(date '2010-01-01' + k, 'YYYY-MM-DD'), j * 1000000 + k,
                   CASE WHEN k %% 50 = 0 THEN 'failed' ELSE 'completed' END, 'scheduled',
                   'dag_' || (j %% %(dags)s), 'scheduled__' || k, 'task_' || j, 1,
                   now() - (%(keys)s - k) * interval '1 day', now(), now(),
                   jsonb_build_object('rows', k)
            FROM generate_series(1, %(jobs)s) AS j, generate_series(1, %(keys)s) AS k
            """,
            {"jobs": jobs, "keys": keys, "dags": dags},
        )
        conn.execute(
            """
            INSERT INTO idempotency.job_run_attempts (job_name, run_key, lock_key, outcome,
                triggered_by, dag_id, run_id, task_id, try_number, hostname, pid, started_at,
                finished_at)
            SELECT r.job_name, r.run_key, r.lock_key,
                   CASE WHEN a = 1 THEN r.status ELSE 'noop' END, 'scheduled', r.dag_id,
                   r.run_id, r.task_id, a, 'worker-1', 4242, r.started_at, r.started_at
            FROM idempotency.job_runs AS r, generate_series(1, %(n)s) AS a
            """,
            {"n": attempts},
        )
        conn.execute(
            """
            INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,
                run_key, request_fingerprint, status, call_count)
            SELECT 'accounting', r.job_name || ':' || r.run_key || ':' || e, r.job_name,
                   r.run_key, md5(r.job_name || r.run_key || e),
                   CASE WHEN e = 1 AND r.status = 'failed' THEN 'pending' ELSE 'succeeded' END, 1
            FROM idempotency.job_runs AS r, generate_series(1, %(n)s) AS e
            """,
            {"n": effects},
        )
        running = conn.execute(
            """
            UPDATE idempotency.job_runs SET status = 'started', completed_at = NULL
            WHERE (job_name, run_key) IN (
                SELECT job_name, max(run_key) FROM idempotency.job_runs
                WHERE job_name IN (SELECT 'job_' || j FROM generate_series(1, %(n)s) AS j)
                GROUP BY job_name)
            RETURNING lock_key, job_name, run_key
            """,
            {"n": LOCKS_HELD},
        ).fetchall()
        conn.execute("VACUUM ANALYZE")
    return [(int(lock_key), f"{job}|{key}") for lock_key, job, key in running]


def hold_locks(dsn: str, running: list[tuple[int, str]]) -> psycopg.Connection:
    """Hold the run locks of the running keys in one open transaction, and record running
    attempts for them, as workers in flight do."""
    holder = psycopg.connect(dsn, autocommit=True)
    pid = holder.info.backend_pid
    holder.execute("BEGIN")
    for lock_key, _ in running:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key,))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _lock_key, name in running:
            job, key = name.split("|")
            conn.execute(
                "INSERT INTO idempotency.job_run_attempts (job_name, run_key, lock_key, outcome,"
                " triggered_by, dag_id, run_id, task_id, hostname, pid, lock_backend_pid)"
                " SELECT job_name, run_key, lock_key, 'running', 'scheduled', dag_id, run_id,"
                " task_id, 'worker-2', 77, %s FROM idempotency.job_runs"
                " WHERE job_name = %s AND run_key = %s",
                (pid, job, key),
            )
    return holder


def denied_dags(dags: int) -> int:
    """How many DAGs (dag_0, dag_1, ...) the per-DAG user may not read: a fifth."""
    return max(1, dags // 5)


def child_pages(dsn: str, jobs: int, dags: int, requests: int, keys: int) -> dict[str, Any]:
    """In a fresh interpreter with an Airflow home: time each page and its bare SELECTs."""
    import json

    home = Path(tempfile.mkdtemp(prefix="bench-ui-pages-"))
    airflow_env.configure(home)
    from devtools.airflow_stack import migrated_db_template

    shutil.copyfile(migrated_db_template(), home / "airflow.db")
    (home / "passwords.json").write_text(json.dumps({"admin": "admin", "restricted": "x"}))
    os.environ.update(
        {
            "AIRFLOW__CORE__AUTH_MANAGER": "bench.ui.RestrictedAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,restricted:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            **airflow_env.connection_env(dsn),
            "BENCH_UI_DAGS": str(dags),
        }
    )
    try:
        return _measure_pages(dsn, jobs, dags, requests, keys)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _register_dags(count: int) -> None:
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.providers.common.compat.sdk import DAG, BaseOperator

    DagBundlesManager().sync_bundles_to_db()  # type: ignore[no-untyped-call]
    bag = DagBag(dag_folder=os.devnull, collect_dags=False)
    for i in range(count):
        with DAG(f"dag_{i}", schedule=None) as dag:
            BaseOperator(task_id="t")
        bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


def _measure_pages(dsn: str, jobs: int, dags: int, requests: int, keys: int) -> dict[str, Any]:
    import asyncio
    import logging

    logging.disable(logging.WARNING)
    from airflow.api_fastapi.app import init_auth_manager

    _register_dags(dags)
    init_auth_manager()
    return asyncio.run(_pages_loop(dsn, jobs, dags, requests, keys))


async def _pages_loop(dsn: str, jobs: int, dags: int, requests: int, keys: int) -> dict[str, Any]:
    """The requests go to the app through httpx's ASGI transport on this event loop (as
    uvicorn calls it, without sockets); a trivial route of a bare FastAPI app measures what
    that path costs by itself."""
    import httpx
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi import FastAPI
    from psycopg_pool import ConnectionPool

    from airflow_idempotency.hook import IdempotencyHook
    from airflow_idempotency.schema import require_readable
    from airflow_idempotency.ui.app import Settings, create_app
    from airflow_idempotency.ui.reads import RecordsReader, Visibility

    manager = get_auth_manager()
    tokens = {
        name: manager.generate_jwt(SimpleAuthManagerUser(username=name, role=role))
        for name, role in (("admin", "admin"), ("restricted", "viewer"))
    }
    bare_app = FastAPI()

    @bare_app.get("/trivial")
    def trivial() -> dict[str, int]:
        return {"ok": 1}

    pages = _page_table(jobs, dags, keys, frame="", api="/api")
    page_ms: dict[str, list[float]] = {name: [] for name in pages}
    bare_ms: dict[str, list[float]] = {name: [] for name in pages}
    harness_ms: list[float] = []
    connect_ms: list[float] = []
    pool_ms: list[float] = []
    kwargs = IdempotencyHook().connection_kwargs()
    app_transport = httpx.ASGITransport(app=create_app(Settings()))
    bare_transport = httpx.ASGITransport(app=bare_app)
    async with (
        httpx.AsyncClient(transport=app_transport, base_url="http://ui") as client,
        httpx.AsyncClient(transport=bare_transport, base_url="http://bare") as bare_client,
    ):
        with (
            psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn,
            ConnectionPool(dsn, min_size=1, max_size=1, kwargs={"autocommit": True}) as pool,
        ):
            reader = RecordsReader(conn, "idempotency", Visibility(True))
            for i in range(-3, requests):  # 3 warm-up rounds
                for name, (user, path, params, bare) in pages.items():
                    t0 = time.perf_counter()
                    response = await client.get(
                        path, params=params, cookies={"_token": tokens[user]}
                    )
                    t1 = time.perf_counter()
                    if response.status_code != 200:
                        raise RuntimeError(f"{name}: {response.status_code} {response.text[:500]}")
                    bare(reader)
                    t2 = time.perf_counter()
                    if i >= 0:
                        page_ms[name].append((t1 - t0) * 1000)
                        bare_ms[name].append((t2 - t1) * 1000)
                t0 = time.perf_counter()
                await bare_client.get("/trivial")
                t1 = time.perf_counter()
                with psycopg.connect(**kwargs, autocommit=True, prepare_threshold=None) as fresh:
                    require_readable(fresh, "idempotency")
                t2 = time.perf_counter()
                with pool.connection() as pooled:
                    require_readable(pooled, "idempotency")
                t3 = time.perf_counter()
                if i >= 0:
                    harness_ms.append((t1 - t0) * 1000)
                    connect_ms.append((t2 - t1) * 1000)
                    pool_ms.append((t3 - t2) * 1000)
    return {
        "page_ms": page_ms,
        "bare_ms": bare_ms,
        "harness_ms": harness_ms,
        "connect_ms": connect_ms,
        "pool_ms": pool_ms,
    }


# ---------------------------------------------------------------- 2b. pages on Airflow 2.11

AIRFLOW2_LIMITED_ROLE = "BenchLimited"


def child_pages_airflow2(
    dsn: str, jobs: int, dags: int, requests: int, keys: int
) -> dict[str, Any]:
    """In a fresh Airflow 2.11 interpreter: the webserver's app in-process (Flask's test
    client: no sockets, no gunicorn), signed in through FAB's login form as an admin and as
    a user whose role may read four fifths of the DAGs; each page and its JSON twin timed,
    interleaved with its bare SELECTs."""
    import logging
    import subprocess

    home = Path(tempfile.mkdtemp(prefix="bench-ui-pages2-"))
    airflow_env.configure(home, airflow2=True)
    os.environ.update(
        {
            "AIRFLOW__WEBSERVER__SECRET_KEY": "bench-ui",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            **airflow_env.connection_env(dsn),
        }
    )
    try:
        subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        logging.disable(logging.WARNING)
        return _measure_pages_airflow2(dsn, jobs, dags, requests, keys)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _measure_pages_airflow2(
    dsn: str, jobs: int, dags: int, requests: int, keys: int
) -> dict[str, Any]:
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from airflow.www.app import create_app

    with create_session() as session:
        for i in range(dags):
            dag = DagModel(dag_id=f"dag_{i}", fileloc=f"/dags/dag_{i}.py", is_active=True)  # type: ignore[no-untyped-call]
            session.add(dag)
    app = create_app(testing=True)
    app.config["WTF_CSRF_ENABLED"] = False
    security = app.appbuilder.sm
    limited = security.add_role(AIRFLOW2_LIMITED_ROLE)
    for permission in security.find_role("Viewer").permissions:
        if permission.resource.name != "DAGs":
            security.add_permission_to_role(limited, permission)
    for i in range(denied_dags(dags), dags):
        security.add_permission_to_role(
            limited, security.create_permission("can_read", f"DAG:dag_{i}")
        )
    clients = {}
    for name, role in (("admin", "Admin"), ("restricted", AIRFLOW2_LIMITED_ROLE)):
        security.add_user(
            name, name, "bench", f"{name}@example.com", security.find_role(role), name
        )
        client = app.test_client()
        answer = client.post("/login/", data={"username": name, "password": name})
        if answer.status_code != 302:
            raise RuntimeError(f"login of {name}: {answer.status_code}")
        clients[name] = client
    pages = _page_table(jobs, dags, keys, frame="/runkeys/page", api="/runkeys/api")
    page_ms: dict[str, list[float]] = {name: [] for name in pages}
    bare_ms: dict[str, list[float]] = {name: [] for name in pages}
    from airflow_idempotency.ui.reads import RecordsReader, Visibility

    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        reader = RecordsReader(conn, "idempotency", Visibility(True))
        for i in range(-3, requests):
            for name, (user, path, params, bare) in pages.items():
                t0 = time.perf_counter()
                response = clients[user].get(path, query_string=params)
                t1 = time.perf_counter()
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: {response.status_code} {response.data[:500]!r}")
                bare(reader)
                t2 = time.perf_counter()
                if i >= 0:
                    page_ms[name].append((t1 - t0) * 1000)
                    bare_ms[name].append((t2 - t1) * 1000)
    return {"page_ms": page_ms, "bare_ms": bare_ms}


def _page_table(
    jobs: int, dags: int, keys: int, *, frame: str, api: str
) -> dict[str, tuple[str, str, dict[str, str], Any]]:
    """page name -> (user, path, query, the page's bare reads), each page and its JSON twin
    (``frame`` + the page's path; ``api`` + the twin's)."""
    import datetime as dt

    from airflow_idempotency.ui.reads import RecordsReader, RunFilters, Visibility

    some = Visibility(False, frozenset(f"dag_{i}" for i in range(denied_dags(dags), dags)))
    job = f"job_{jobs - 1}"  # a job whose keys are not held; its DAG is dag_<job mod dags>
    dag = f"dag_{(jobs - 1) % dags}"
    mid_key = (dt.date(2010, 1, 1) + dt.timedelta(days=keys // 2)).isoformat()
    mid_run = f"scheduled__{keys // 2}"
    first_key = (dt.date(2010, 1, 1) + dt.timedelta(days=1)).isoformat()
    span_end = (dt.date(2010, 1, 1) + dt.timedelta(days=min(keys, 1_096))).isoformat()
    span = {"from": first_key[:8] + "01", "to": span_end}
    # page name -> (user, path, params, the page's bare reads)
    pages: dict[str, tuple[str, str, dict[str, str], Any]] = {
        "overview (admin)": ("admin", "/", {}, lambda r: r.overview(RunFilters())),
        "overview (per-DAG user)": (
            "restricted",
            "/",
            {},
            lambda r: RecordsReader(r.conn, r.schema, some).overview(RunFilters()),
        ),
        "run keys of one job": (
            "admin",
            "/",
            {"job": job},
            lambda r: r.overview(RunFilters(job=job)),
        ),
        "DAG tab": ("admin", f"/dags/{dag}", {}, lambda r: r.dag_keys(dag)),
        "DAG run tab": (
            "admin",
            f"/dags/{dag}/runs/{mid_run}",
            {},
            lambda r: r.run_attempts(dag, mid_run),
        ),
        "key page": (
            "admin",
            "/keys",
            {"job": job, "run_key": mid_key},
            lambda r: r.key(job, mid_key),
        ),
        "calendar, a year (per-DAG user)": (
            "restricted",
            "/calendar",
            {"job": job},
            lambda r: RecordsReader(r.conn, r.schema, some).calendar(job),
        ),
        "calendar, 3 years": (
            "admin",
            "/calendar",
            {"job": job, **span},
            lambda r: r.calendar(job, span["from"], span["to"]),
        ),
        "locks held now": ("admin", "/locks", {}, lambda r: r.locks()),
    }
    # Each page's JSON twin, with the same bare SELECTs.
    twins = {
        f"{name}, JSON": (user, api + ("/overview" if path == "/" else path), params, bare)
        for name, (user, path, params, bare) in pages.items()
    }
    framed = {
        name: (user, frame + path, params, bare)
        for name, (user, path, params, bare) in pages.items()
    }
    return {**framed, **twins}


def _migration_5_seconds(dsn: str) -> float:
    from airflow_idempotency._sql import migrations

    body = next(sql for version, _name, sql in migrations() if version == 5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for index in (
            "job_runs_run_key_idx",
            "job_run_attempts_dag_job_idx",
            "job_run_attempts_dag_run_idx",
            "outbound_ledger_unconfirmed_idx",
        ):
            conn.execute(f"DROP INDEX idempotency.{index}")
        with conn.transaction():
            conn.execute("SET LOCAL search_path = idempotency")
            t0 = time.perf_counter()
            conn.execute(body.encode())
            return time.perf_counter() - t0


# ---------------------------------------------------------------- the benchmark


def __getattr__(name: str) -> Any:
    """``bench.ui.RestrictedAuthManager``, built on first use: Airflow is imported by the
    children only (the auth manager setting names it)."""
    if name != "RestrictedAuthManager":
        raise AttributeError(name)
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    denied = {f"dag_{i}" for i in range(denied_dags(int(os.environ["BENCH_UI_DAGS"])))}

    class RestrictedAuthManager(SimpleAuthManager):
        """SimpleAuthManager where user ``restricted`` may not read the first fifth of the DAGs."""

        def is_authorized_dag(
            self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None
        ) -> bool:
            if user.get_name() == "restricted" and details is not None and details.id in denied:
                return False
            return bool(
                super().is_authorized_dag(
                    method=method, user=user, access_entity=access_entity, details=details
                )
            )

    globals()[name] = RestrictedAuthManager
    return RestrictedAuthManager


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("ui", TITLE)
    samples, jobs, keys, dags, requests, attempts, effects = UI_SIZES[size.name]
    say(f"ui: plugin load, {samples} processes per variant ...")
    _plugin_load(result, samples)
    with database(server, "bench_ui") as dsn:
        say(f"ui: seeding {jobs * keys:,} run keys ...")
        t0 = time.perf_counter()
        running = seed(dsn, jobs, keys, dags, attempts, effects)
        seeded_s = time.perf_counter() - t0
        migration_s = _migration_5_seconds(dsn)
        holder = hold_locks(dsn, running)
        args = {"dsn": dsn, "jobs": jobs, "dags": dags, "requests": requests, "keys": keys}
        try:
            say(f"ui: pages, {requests} requests each ...")
            out = run_child("bench.ui:child_pages", args)
            # Not at the tiny size (the suite's smoke test: a 2.11 webserver app takes half a
            # minute to build), unless BENCH_UI_AIRFLOW2=1 asks for it.
            wanted = size.name != "tiny" or os.environ.get("BENCH_UI_AIRFLOW2") == "1"
            python2 = airflow2_python() if wanted else None
            if python2 is not None:
                say(f"ui: pages on Airflow 2.11, {requests} requests each ...")
                out2 = run_child("bench.ui:child_pages_airflow2", args, python=python2)
            else:
                say("ui: Airflow 2.11 pages skipped (tiny size, or no .venv-airflow2)")
                out2 = None
        finally:
            holder.close()
    rows_note = (
        f"{jobs * keys:,} run keys ({jobs} jobs x {keys:,} days), {jobs * keys * attempts:,} "
        f"attempts, {jobs * keys * effects:,} ledger rows, {dags} DAGs, {LOCKS_HELD} locks held"
    )
    for name, samples_ms in out["page_ms"].items():
        bare = out["bare_ms"][name]
        p95, bare_p95 = percentile(samples_ms, 95), percentile(bare, 95)
        result.add(
            f"{name}: page p95",
            p95,
            "ms",
            f"<= {PAGE_P95_LIMIT_MS:g} ms",
            at_most(p95, PAGE_P95_LIMIT_MS),
            f"median {median(samples_ms):.1f} ms",
        )
        result.add(
            f"{name}: bare SELECTs p95", bare_p95, "ms", note=f"median {median(bare):.2f} ms"
        )
        result.add(
            f"{name}: app's own cost, p95 page - p95 bare",
            p95 - bare_p95,
            "ms",
            note="connection, auth, rendering",
        )
    if out2 is not None:
        for name, samples_ms in out2["page_ms"].items():
            bare = out2["bare_ms"][name]
            p95, bare_p95 = percentile(samples_ms, 95), percentile(bare, 95)
            result.add(
                f"Airflow 2.11: {name}: page p95",
                p95,
                "ms",
                f"<= {PAGE_P95_LIMIT_MS:g} ms",
                at_most(p95, PAGE_P95_LIMIT_MS),
                f"median {median(samples_ms):.1f} ms; bare SELECTs p95 {bare_p95:.1f} ms",
            )
    result.add(
        "trivial route of a bare FastAPI app, p95",
        percentile(out["harness_ms"], 95),
        "ms",
        note="what the ASGI path costs by itself (in every page figure)",
    )
    connect, pooled = out["connect_ms"], out["pool_ms"]
    result.add(
        "new connection + schema check, p95",
        percentile(connect, 95),
        "ms",
        note=f"median {median(connect):.2f} ms; what each page pays",
    )
    result.add(
        "pool checkout + schema check, p95",
        percentile(pooled, 95),
        "ms",
        note=f"median {median(pooled):.2f} ms; psycopg_pool, for comparison",
    )
    result.add("migration 5 on the seeded tables", migration_s, "s", note=rows_note)
    result.notes.append(
        f"Data: {rows_note} (seeded in {seeded_s:.0f} s by SQL, then VACUUM ANALYZE). "
        f"{requests} requests per page after 3 warm-up rounds, the pages in turn, each "
        "followed by its bare SELECTs. A page's time includes a new connection to the job "
        "database and the schema check, Airflow's JWT check, the auth manager's DAG "
        "authorization (get_authorized_dag_ids over the metadata DB's DAGs), the reads in "
        "one read-only transaction, and rendering; the bare SELECTs are the same reads on an "
        "open connection. The per-DAG user may read "
        f"{dags - denied_dags(dags)} of {dags} DAGs (the ids go to Postgres as an array)."
    )
    result.notes.append(
        f"**Targets.** Each page and JSON endpoint must answer within "
        f"{PAGE_P95_LIMIT_MS:g} ms (p95) at this size (issue 12): that is the "
        "target. The app's own cost (page minus its bare SELECTs) is a figure, not a "
        "target. Measured apart on a quiet machine, for the overview: a new connection and "
        "the schema check ~7 ms (the `new connection` row), the same reads on a new backend "
        "~4 ms more than on a warm one (its catalog caches), the auth manager's DAG list "
        "~1 ms, Jinja rendering of its 90 rows ~7 ms; the rest is FastAPI's request "
        "handling and Airflow's JWT check, not broken down further, and everything about "
        "doubles while other suites load the machine. The overview is the slowest page "
        "because it reads the most: its bare SELECTs grow with the failed and interrupted "
        "keys and the keys with unconfirmed effects (counted and read through indexes, "
        "one heap row each; one key in 50 failed here, a pessimistic history)."
    )
    result.notes.append(
        "**A bounded pool.** Each page checks out a connection of the view's pool "
        "(psycopg_pool, at most `[idempotency] ui_pool_size` per api-server worker, idle ones "
        "closed after `ui_pool_max_idle`), so the page figures include a checkout and the "
        "schema check, not a new connection: the `new connection` row minus the `pool "
        "checkout` row is what the pool saves a page."
    )
    result.notes.append(
        "**Plugin load.** Airflow 3 integrates macro plugins in every task process before "
        "the task runs, which imports and instantiates every `airflow.plugins` entry point. "
        "The plugin module imports only its base class (common-compat's AirflowPlugin: the "
        "Task SDK's, already loaded in a task process) and its own constants; the app is "
        "built by the api-server on the "
        f"first request. {samples} fresh processes per variant, in ABBA order, with the "
        "bytecode written by a warm-up child of each variant (as an installed wheel has it)."
    )
    return result


if __name__ == "__main__":  # a quick look: python -m bench.ui tiny
    from bench.common import SIZES
    from devtools.postgres import find_server

    srv = find_server()
    try:
        res = run(SIZES[sys.argv[1] if len(sys.argv) > 1 else "tiny"], srv)
        for row in res.rows:
            print(f"{row.figure:70s} {row.shown():>10s} {row.unit} {row.verdict}")
    finally:
        srv.close()
