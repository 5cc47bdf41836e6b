"""The stack as callers use it (``AirflowStack``): start, stop, and Airflow's CLI and REST verbs.

For end-to-end tests and the demo: ``airflow backfill create`` and ``airflow dags trigger``
only make tasks run when a scheduler, an api-server (the task runner talks to its execution
API) and a dag-processor (Airflow 3 parses DAG files in a separate process, the scheduler
does not) are running. :func:`airflow_stack` starts them against an isolated
``AIRFLOW_HOME`` (SQLite metadata, LocalExecutor), each in its own session / process group
with its log in ``<home>/stack-logs/``, and kills the groups on exit.

``metadata_dsn`` puts the metadata in a PostgreSQL database instead (as in production), and
``celery_workers`` switches to the CeleryExecutor (Redis broker, Postgres result backend):
one ``airflow celery worker`` per name, each in its own UTS namespace with that hostname, so
that Airflow and the provider see separate hosts.

The caller's ``os.environ`` is never modified: the stack's environment is
:attr:`AirflowStack.env`, passed to every subprocess. :class:`AirflowStack` is one object for
its callers, built from two parts that each stand alone: its processes
(:class:`~devtools.airflow_stack.processes.StackProcesses`: start, kill, find, stop) and its
metadata database (:class:`~devtools.airflow_stack.metadata.MetadataDB`: runs, task instances,
backfills, read straight); this module adds Airflow's verbs, through its CLI (``backfill
create``, ``dags trigger``) and its REST API (pause, unpause, runs).

Usage::

    with airflow_stack(tmp_path / "home", Path("dags"), extra_env={"X": "1"}) as stack:
        stack.unpause("my_dag")
        runs = stack.backfill("my_dag", "2026-10-01", "2026-10-03")
        assert {r.state for r in runs} == {"success"}
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from devtools import airflow_env
from devtools.airflow_stack.environment import (
    celery_env,
    free_port,
    migrated_db_template,
    sqlalchemy_url,
    stack_env_defaults,
)
from devtools.airflow_stack.metadata import TERMINAL_RUN_STATES, MetadataDB, RunResult
from devtools.airflow_stack.processes import StackError, StackProcesses

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11


class AirflowStack(StackProcesses, MetadataDB):
    """Handles to a running stack: run CLI commands, trigger, backfill, read states.

    Its processes are those of :class:`StackProcesses`, its states are read by
    :class:`MetadataDB`; this class adds the start and Airflow's verbs.
    """

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        extra_env: dict[str, str] | None = None,
        port: int | None = None,
        *,
        dag_processor: bool = True,
        triggerer: bool = False,
        db_template: bool = True,
        metadata_dsn: str | None = None,
        celery_workers: Sequence[str] = (),
    ) -> None:
        if celery_workers and metadata_dsn is None:
            raise ValueError("celery_workers need a metadata_dsn (a PostgreSQL metadata DB)")
        home = home.resolve()
        self.db_template = db_template and metadata_dsn is None
        self.dags_folder = dags_folder.resolve()
        port = port or free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        components = ["api-server", "scheduler"]
        if dag_processor:
            components.append("dag-processor")
        if triggerer:
            components.append("triggerer")
        self.celery_workers = list(celery_workers)
        components += [f"celery-worker-{name}" for name in self.celery_workers]
        env = dict(os.environ)
        airflow_env.configure(home, env)
        env.update(stack_env_defaults(home, self.dags_folder, port))
        if metadata_dsn is not None:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sqlalchemy_url(metadata_dsn)
        if celery_workers:
            assert metadata_dsn is not None
            env.update(celery_env(metadata_dsn))
        env.update(extra_env or {})
        StackProcesses.__init__(self, home, env, port, components)
        MetadataDB.__init__(self, home / "airflow.db", metadata_dsn)
        self.started_at: datetime | None = None
        self.timings: dict[str, float] = {}

    # ---------------------------------------------------------------- life cycle

    def start(self, timeout: float = 120.0) -> None:
        """Migrate the DB, start the components, wait until the api-server and scheduler answer."""
        t0 = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.db_template and not self.db_path.exists():
            shutil.copyfile(migrated_db_template(), self.db_path)
        else:
            airflow_env.migrate(self.env)
        self.timings["db"] = time.monotonic() - t0
        self.started_at = datetime.now(timezone.utc)
        for name in self.components:
            self.start_component(name)
        self._wait(self._api_ready, timeout, "the api-server to answer /api/v2/monitor/health")
        self.timings["api_ready"] = time.monotonic() - t0
        self._wait(self._scheduler_ready, timeout, "the scheduler to heartbeat", "scheduler")
        self.timings["start"] = time.monotonic() - t0

    def restart_component(self, name: str, timeout: float = 180.0) -> None:
        """SIGKILL one component (with everything it started: a scheduler's task processes)
        and start it again with :attr:`env` as it is now; for the scheduler, wait until the
        new one heartbeats."""
        since = datetime.now(timezone.utc)
        super().restart_component(name)
        if name == "scheduler":
            what = "the restarted scheduler to heartbeat"
            self._wait(lambda: self._scheduler_ready(since), timeout, what, "scheduler")

    def health(self) -> dict[str, Any] | None:
        """``GET /api/v2/monitor/health`` as a dict, or None if the api-server does not answer."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/api/v2/monitor/health", timeout=2) as r:
                return dict(json.load(r))
        except (OSError, ValueError):
            return None

    def _api_ready(self) -> bool:
        return self.health() is not None

    def _scheduler_ready(self, since: datetime | None = None) -> bool:
        since = since or self.started_at
        assert since is not None
        beat = self.scheduler_heartbeat()
        return beat is not None and beat >= since

    # ---------------------------------------------------------------- CLI and API

    def airflow(
        self, *args: str, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``airflow *args`` against this stack's home; raise with its output if it fails."""
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise _cli_error(args, proc)
        return proc

    def airflow_retrying(
        self, *args: str, attempts: int = 5, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """:meth:`airflow`, run again while it fails with SQLite's "database is locked".

        SQLite lets one writer at a time; a transaction that read before writing fails at
        once (no busy wait) when another process committed in between. The scheduler, the
        dag-processor and the api-server write all the time, so CLI writes lose now and then.
        """
        for attempt in range(1, attempts + 1):
            proc = self.airflow(*args, check=False, timeout=timeout)
            locked = "database is locked" in proc.stderr + proc.stdout
            if proc.returncode == 0 or not locked or attempt == attempts:
                break
            time.sleep(0.5 * attempt)
        if proc.returncode != 0:
            raise _cli_error(args, proc, f" (attempt {attempt})")
        return proc

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call the REST API (``/api/v2/...``); the stack runs with all users admin."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                payload = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise StackError(f"{method} {path} -> {e.code}: {detail}") from e
        return json.loads(payload) if payload else None

    # ---------------------------------------------------------------- DAG actions

    def wait_for_dag(self, dag_id: str, timeout: float = 60.0, reserialize: bool = False) -> None:
        """Wait until ``dag_id`` is parsed and serialized; raise at once on an import error."""
        if reserialize:
            self.airflow("dags", "reserialize")

        def ready() -> bool:
            errors = self.import_errors()
            if errors:
                raise StackError(
                    "DAG import errors:\n" + "\n".join(f"{f}:\n{st}" for f, st in errors)
                )
            row = self._query_one(
                "SELECT 1 FROM serialized_dag s JOIN dag d ON d.dag_id = s.dag_id "
                "WHERE s.dag_id = ? AND NOT d.is_stale",
                (dag_id,),
            )
            return row is not None

        log = "dag-processor" if "dag-processor" in self.components else "scheduler"
        self._wait(ready, timeout, f"DAG {dag_id!r} to be serialized from {self.dags_folder}", log)

    def unpause(self, dag_id: str, timeout: float = 60.0) -> None:
        """Wait for the DAG to be serialized, then unpause it (REST API, ~0.1 s vs ~4 s CLI)."""
        self.wait_for_dag(dag_id, timeout)
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def pause(self, dag_id: str) -> None:
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": True})

    def wait_for_runs(
        self, dag_id: str, run_ids: Sequence[str], timeout: float = 120.0
    ) -> list[RunResult]:
        """Wait until every run in ``run_ids`` is success or failed; return them in order."""

        def done() -> list[RunResult] | None:
            runs = [self.dag_run(dag_id, r) for r in run_ids]
            if all(r is not None and r.state in TERMINAL_RUN_STATES for r in runs):
                return [r for r in runs if r is not None]
            return None

        return self._wait(
            done,
            timeout,
            f"runs of {dag_id} to finish",
            log="scheduler",
            describe=lambda: self.describe_runs(dag_id, run_ids),
        )

    def backfill(
        self,
        dag_id: str,
        from_date: date | datetime | str,
        to_date: date | datetime | str,
        reprocess_behavior: str = "none",
        max_active_runs: int | None = None,
        dag_run_conf: dict[str, Any] | None = None,
        timeout: float = 180.0,
        mark_complete: bool = True,
        pause_while_creating: bool = True,
    ) -> list[RunResult]:
        """``airflow backfill create`` and wait for its runs; return the runs it created/cleared.

        Dates skipped (already run, with ``reprocess_behavior="none"``) have no run: see
        :meth:`backfill_entries` of :attr:`last_backfill_id`. Only one backfill per DAG may
        be active, and the scheduler marks a backfill complete only every 30 s (hard-coded);
        with ``mark_complete`` (default) this method sets ``backfill.completed_at`` itself once
        all its runs are terminal (the scheduler's own criterion), so that the next backfill
        can start at once. Otherwise it waits for the scheduler to do it.

        ``pause_while_creating`` (default) pauses the DAG while the CLI creates the runs:
        when a write of ``backfill create`` hits SQLite's "database is locked", Airflow
        deletes the runs it had made, and a scheduler already working on them died with
        ObjectDeletedError (seen on a loaded machine). The scheduler ignores paused DAGs.
        """
        t0 = time.monotonic()
        before = self.latest_backfill_id(dag_id) or 0
        args = [
            "backfill", "create", "--dag-id", dag_id,
            "--from-date", _date_arg(from_date), "--to-date", _date_arg(to_date),
            "--reprocess-behavior", reprocess_behavior,
        ]  # fmt: skip
        if max_active_runs is not None:
            args += ["--max-active-runs", str(max_active_runs)]
        if dag_run_conf is not None:
            args += ["--dag-run-conf", json.dumps(dag_run_conf)]
        self._create_backfill(dag_id, args, before, t0 + timeout, pause_while_creating)
        backfill_id = self.latest_backfill_id(dag_id) or 0
        if backfill_id <= before:
            raise StackError(f"`airflow {' '.join(args)}` created no backfill")
        self.last_backfill_id = backfill_id
        # Normally one backfill; after a half-made one (see _create_backfill), its runs too.
        runs: dict[str, RunResult] = {}
        # Backfill ids are shared by every DAG: only this DAG's backfills in that range.
        made = self.query(
            "SELECT id FROM backfill WHERE dag_id = ? AND id > ? AND id <= ? ORDER BY id",
            (dag_id, before, backfill_id),
        )
        for (made_id,) in made:
            runs.update((r.run_id, r) for r in self.backfill_runs(made_id))
        run_ids = list(runs)
        remaining = max(1.0, timeout - (time.monotonic() - t0))
        self.wait_for_runs(dag_id, run_ids, remaining)
        if mark_complete:
            self.mark_backfill_complete(backfill_id)
        else:
            self._wait(
                lambda: (
                    self._query_one(
                        "SELECT 1 FROM backfill WHERE id = ? AND completed_at IS NOT NULL",
                        (backfill_id,),
                    )
                    is not None
                ),
                max(1.0, timeout - (time.monotonic() - t0)),
                f"the scheduler to mark backfill {backfill_id} complete",
                log="scheduler",
            )
        self.timings["last_backfill"] = time.monotonic() - t0
        fresh = [self.dag_run(dag_id, r) or runs[r] for r in run_ids]
        return sorted(fresh, key=lambda r: (r.logical_date is None, r.logical_date or 0))

    last_backfill_id: int | None = None

    def _create_backfill(
        self, dag_id: str, args: list[str], before: int, deadline: float, pause: bool
    ) -> None:
        """Run ``airflow backfill create`` until it succeeds, recovering from what a failed
        attempt leaves behind.

        A write of ``backfill create`` can fail with SQLite's "database is locked" after the
        backfill row and some of its runs were committed. Airflow then deletes that backfill
        (best effort): if the clean-up fails too, the half-made backfill stays active and
        every later attempt answers "Another backfill is running". A half-made backfill
        with runs is let finish (its runs need the DAG unpaused), closed, and the create is
        run again; the caller collects the runs of both. One with no runs is closed at once.
        Each failed attempt's output goes to ``stack-logs/backfill-create-<n>.log``.
        """
        attempt = 0
        while True:
            attempt += 1
            if pause:
                self.pause(dag_id)
            try:
                proc = self.airflow(*args, check=False)
            finally:
                if pause:
                    self.unpause(dag_id)
            if proc.returncode == 0:
                return
            text = proc.stdout + proc.stderr
            self.log_path(f"backfill-create-{attempt}").write_text(text, encoding="utf-8")
            half_made = self.half_made_backfill(dag_id, before)
            if time.monotonic() > deadline:
                raise _cli_error(args, proc, f" (attempt {attempt})")
            if half_made is not None:
                print(
                    f"[stack] `airflow backfill create` failed (attempt {attempt}, output in "
                    f"{self.log_path(f'backfill-create-{attempt}')}) and left backfill "
                    f"{half_made} half made: letting its runs finish, then creating again",
                    file=sys.stderr,
                    flush=True,
                )
                run_ids = [r.run_id for r in self.backfill_runs(half_made)]
                self.wait_for_runs(dag_id, run_ids, max(1.0, deadline - time.monotonic()))
                self.mark_backfill_complete(half_made)
            elif "Another backfill is running" in text:
                pass  # an earlier backfill is still active: wait for it
            elif "database is locked" not in text or attempt >= 8:
                raise _cli_error(args, proc, f" (attempt {attempt})")
            time.sleep(min(0.5 * attempt, 3.0))

    def trigger(
        self,
        dag_id: str,
        logical_date: date | datetime | str | None = None,
        conf: dict[str, Any] | None = None,
        run_id: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
    ) -> RunResult:
        """``airflow dags trigger`` (no logical date unless given); wait for a terminal state."""
        args = ["dags", "trigger", dag_id, "-o", "json"]
        if logical_date is not None:
            args += ["--logical-date", _date_arg(logical_date)]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        if run_id is not None:
            args += ["--run-id", run_id]
        out = self.airflow_retrying(*args).stdout
        if run_id is None:
            run_id = run_id_from_trigger_output(out)
        if not wait:
            run = self.dag_run(dag_id, run_id)
            if run is None:
                raise StackError(f"triggered run {run_id} of {dag_id} not found")
            return run
        return self.wait_for_runs(dag_id, [run_id], timeout)[0]


def _date_arg(value: date | datetime | str) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value


def _cli_error(
    args: Sequence[str], proc: subprocess.CompletedProcess[str], note: str = ""
) -> StackError:
    return StackError(
        f"`airflow {' '.join(args)}` exited {proc.returncode}{note}\n"
        f"--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-3000:]}"
    )


def run_id_from_trigger_output(out: str) -> str:
    """The run id from ``airflow dags trigger -o json`` output: log lines, then a JSON list
    with one dict whose key is ``dag_run_id`` (not ``run_id``)."""
    for line in reversed(out.splitlines()):
        if line.startswith("[{"):
            with suppress(ValueError):
                data = json.loads(line)
                return str(data[0].get("dag_run_id") or data[0]["run_id"])
    raise StackError(f"no run id in `airflow dags trigger` output:\n{out[-2000:]}")


class StackOptions(TypedDict, total=False):
    """The keyword options of :class:`AirflowStack`, passed through by :func:`airflow_stack`."""

    dag_processor: bool
    triggerer: bool
    db_template: bool
    metadata_dsn: str | None
    celery_workers: Sequence[str]


@contextmanager
def airflow_stack(
    home: Path,
    dags_folder: Path,
    extra_env: dict[str, str] | None = None,
    port: int | None = None,
    *,
    start_timeout: float = 120.0,
    **options: Unpack[StackOptions],
) -> Iterator[AirflowStack]:
    """Start a stack on ``home`` / ``dags_folder``; kill all its processes on exit.

    ``options``: those of :class:`AirflowStack`, every one of them.
    """
    stack = AirflowStack(home, dags_folder, extra_env, port, **options)
    try:
        stack.start(start_timeout)
        yield stack
    finally:
        stack.stop()
