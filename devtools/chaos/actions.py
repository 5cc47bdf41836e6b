"""Chaos's actions: what the scheduler and people do to the example DAGs, drawn from the seed.

Each step draws one action over a few business dates (a window of ``--dates`` that moves on by
one date every ``--new-date-every`` steps, so that first-time work keeps happening under the
faults). An action runs in its own thread, so actions overlap (at most ``--overlap`` at once).
A broken build's phase opens with the actions that expose it and uses its own weights.

``scheduled`` (a run at the exact fire time, as the scheduler creates it: the REST API with
that logical date), ``manual_key`` (the UI's Trigger with ``run_key``), ``manual_date`` (a
logical date, no run_key), ``backfill`` (REST ``POST /backfills`` of a range, reprocess none
or completed), ``clear_run``, ``clear_task`` (with downstream), ``force``, ``dry_run``,
``force_reconcile``, ``pasted_twice`` (both reconciliation DAGs at the same instant).

:meth:`Actions.converge` reruns every touched date until all its jobs completed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import threading
import time
from typing import Any
from urllib.parse import quote

from devtools import invariants
from devtools.chaos.phases import Event, Phase, say
from devtools.chaos.rig import RECONCILE_DAGS, TERMINAL, Rig
from devtools.invariants import FINALIZE, fire_time

ACTIONS: dict[str, int] = {  # kind -> weight
    "scheduled": 3,
    "manual_key": 3,
    "manual_date": 2,
    "backfill": 2,
    "clear_run": 2,
    "clear_task": 2,
    "force": 2,
    "dry_run": 1,
    "force_reconcile": 1,
    "pasted_twice": 1,
}
FINALIZE_TASKS = ("create_invoices", "rebuild_totals", "export_invoices", "reconcile_export")
RECONCILE_EXPORT_JOB = f"{FINALIZE}.{FINALIZE_TASKS[3]}"


class Actions:
    """Draws the actions of a phase and does them on the rig, each in a thread of its own."""

    def __init__(self, rig: Rig, args: argparse.Namespace) -> None:
        self.rig = rig
        self.args = args

    def plan(self, phase: Phase, step: int, kind: str | None = None) -> tuple[str, dict[str, Any]]:
        """Draw the next action (unless ``kind`` is given) and its parameters from the seed
        (nothing is done yet); a phase opens with its build's opening actions."""
        weights = phase.build.actions or ACTIONS
        drawn = phase.rng.choices(list(weights), weights=list(weights.values()))[0]
        if kind is None:
            opening = phase.build.opening
            kind = opening[step - 1] if step <= len(opening) else drawn
        window = phase.window(step, self.args.new_date_every)
        day = phase.rng.choice(window)
        params: dict[str, Any] = {"day": day}
        if kind == "manual_date":
            params["at"] = f"{phase.rng.randrange(1, 24):02d}:{phase.rng.randrange(60):02d}"
        elif kind == "backfill":
            i = window.index(day)
            params["last"] = window[min(len(window) - 1, i + phase.rng.randrange(3))]
            params["reprocess"] = phase.rng.choice(["none", "completed"])
        elif kind in ("clear_run", "clear_task"):
            params["pick"] = phase.rng.random()
            params["task"] = phase.rng.choice(FINALIZE_TASKS[:3])
        return kind, params

    def start(self, phase: Phase, step: int, kind: str | None = None) -> threading.Thread:
        """Plan the action of ``step`` and do it in a thread of its own (started)."""
        kind, params = self.plan(phase, step, kind)
        phase.actions[kind] += 1
        phase.touched.add(params["day"])
        if "last" in params:
            i, j = phase.dates.index(params["day"]), phase.dates.index(params["last"])
            phase.touched.update(phase.dates[i : j + 1])
        what = f"{params['day']}" if kind not in ("clear_run", "clear_task") else ""
        event = phase.log(Event(step, kind, what, time.monotonic()))

        def body() -> None:
            try:
                self.do(phase, event, kind, params)
            except Exception as exc:  # an action that could not be done is logged, not fatal
                event.result = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                event.ended = time.monotonic()
                say(event.line(phase.t0))
            with contextlib.suppress(Exception):
                phase.touched.update(self.run_keys_of(event))

        thread = threading.Thread(target=body, name=f"action-{step}", daemon=True)
        thread.start()
        return thread

    def do(self, phase: Phase, event: Event, kind: str, p: dict[str, Any]) -> None:
        day: dt.date = p["day"]
        key = day.isoformat()
        runs: list[tuple[str, str] | None] = []
        trigger = self.rig.trigger
        if kind == "scheduled":
            runs.append(trigger(FINALIZE, fire_time(day), {}))
        elif kind == "manual_key":
            runs.append(trigger(FINALIZE, None, {"run_key": key}))
        elif kind == "manual_date":
            runs.append(trigger(FINALIZE, fire_time(day, p["at"]), {}))
        elif kind == "force":
            runs.append(trigger(FINALIZE, None, {"run_key": key, "force": True}))
        elif kind == "dry_run":
            runs.append(trigger(FINALIZE, None, {"run_key": key, "dry_run": True}))
        elif kind == "force_reconcile":
            runs.append(trigger(FINALIZE, None, {"run_key": key, "force_reconcile": True}))
        elif kind == "pasted_twice":
            at = fire_time(day, "01:30")
            runs += [trigger(d, at, {}) for d in RECONCILE_DAGS]
        elif kind == "backfill":
            self.backfill(phase, event, day, p["last"], p["reprocess"])
            return
        elif kind in ("clear_run", "clear_task"):
            self.clear(phase, event, kind, p)
            return
        made = [r for r in runs if r is not None]
        event.run_ids = made
        refused = len(runs) - len(made)
        result = self.rig.wait_runs(phase, made, self.args.action_timeout) if made else ""
        event.result = result + (f" ({refused} refused by Airflow)" if refused else "")

    def backfill(
        self, phase: Phase, event: Event, first: dt.date, last: dt.date, reprocess: str
    ) -> None:
        from devtools.airflow_stack import StackError

        body = {
            "dag_id": FINALIZE,
            "from_date": fire_time(first),
            "to_date": fire_time(last),
            "run_backwards": False,
            "dag_run_conf": {},
            "reprocess_behavior": reprocess,
            "max_active_runs": 2,
        }
        event.what += f" {first}..{last} reprocess={reprocess}"
        try:
            made = self.rig.api("POST", "/api/v2/backfills", body)
        except StackError as exc:
            if "-> 409" in str(exc):
                event.result = "refused: another backfill is running"
                return
            raise
        backfill_id = int(made["id"])
        phase.backfills.append(backfill_id)
        stack = self.rig.stack
        event.run_ids = [(FINALIZE, r.run_id) for r in stack.backfill_runs(backfill_id)]
        event.result = (
            self.rig.wait_runs(phase, event.run_ids, self.args.action_timeout)
            if event.run_ids
            else "no runs"
        )
        stack.mark_backfill_complete(backfill_id)

    def clear(self, phase: Phase, event: Event, kind: str, p: dict[str, Any]) -> None:
        runs = [
            r["run_id"]
            for r in self.rig.stack.query(
                "SELECT run_id, state FROM dag_run WHERE dag_id = ? AND id > ? ORDER BY id",
                (FINALIZE, phase.base_run_id),
            )
            if r["state"] in TERMINAL
        ]
        if not runs:
            event.result = "nothing to clear"
            return
        run_id = runs[int(p["pick"] * len(runs))]
        quoted = quote(run_id, safe="")
        if kind == "clear_run":
            path = f"/api/v2/dags/{FINALIZE}/dagRuns/{quoted}/clear"
            self.rig.api("POST", path, {"dry_run": False})
            event.what += f" {run_id}"
        else:
            body = {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": [p["task"]],
                "include_downstream": True,
                "only_failed": False,
                "reset_dag_runs": True,
            }
            self.rig.api("POST", f"/api/v2/dags/{FINALIZE}/clearTaskInstances", body)
            event.what += f" {run_id} {p['task']}+downstream"
        event.run_ids = [(FINALIZE, run_id)]
        time.sleep(1)
        event.result = self.rig.wait_runs(phase, event.run_ids, self.args.action_timeout)

    def run_keys_of(self, event: Event) -> set[dt.date]:
        """The business dates the runs of ``event`` worked on (as their attempts recorded)."""
        found = set()
        for dag_id, run_id in event.run_ids:
            for (key,) in self.rig.db_rows(
                "SELECT DISTINCT run_key FROM idempotency.job_run_attempts"
                " WHERE dag_id = %s AND run_id = %s",
                (dag_id, run_id),
            ):
                with contextlib.suppress(ValueError):
                    found.add(dt.date.fromisoformat(key))
        return found

    def converge(self, phase: Phase) -> None:
        """Rerun every touched date until all its jobs completed (5 rounds at most)."""
        say(f"convergence: rerunning {len(phase.touched)} touched date(s) until completed")
        for round_ in range(1, 6):
            keys = sorted(phase.touched)
            status = {
                (j, k): s
                for j, k, s in self.rig.db_rows(
                    "SELECT job_name, run_key, status FROM idempotency.job_runs"
                )
            }
            todo = [
                d
                for d in keys
                if any(status.get((j, d.isoformat())) != "completed" for j in invariants.JOBS)
            ]
            # A forced reconcile that crashed left its key started (and its attempt running):
            # only another forced reconcile runs that job again, so convergence does one.
            reconcile = {
                d
                for d in keys
                if status.get((RECONCILE_EXPORT_JOB, d.isoformat())) not in (None, "completed")
            }
            todo = sorted(set(todo) | reconcile)
            if not todo:
                return
            runs = []
            for day in todo:
                event = phase.log(
                    Event(phase.steps, "converge", f"{day} round {round_}", time.monotonic())
                )
                conf: dict[str, Any] = {"run_key": day.isoformat()}
                if day in reconcile:
                    conf["force_reconcile"] = True
                made = [
                    self.rig.trigger(FINALIZE, None, conf),
                    self.rig.trigger(RECONCILE_DAGS[0], None, {"run_key": day.isoformat()}),
                ]
                event.run_ids = [m for m in made if m is not None]
                runs.append(event)
            for event in runs:
                event.result = self.rig.wait_runs(phase, event.run_ids, self.args.action_timeout)
                event.ended = time.monotonic()
