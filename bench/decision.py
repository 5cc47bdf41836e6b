"""The decision by line and by version: round trips counted exactly, and latency.

Each variant is one provider checkout run by its own interpreter
(bench/decision_child.py):

* ``3.3``: this checkout in the Airflow 3 environment (.venv, ``IDEMPOTENCY_AIRFLOW3_PYTHON``
  or the bench's own interpreter);
* ``2.11``: this checkout in the Airflow 2.11 environment (.venv-airflow2,
  ``IDEMPOTENCY_AIRFLOW2_PYTHON``; left out, with a note, when it is not set up);
* ``before``: an older checkout (``BENCH_BEFORE_CHECKOUT``: a worktree with its own .venv,
  e.g. ``git worktree add /tmp/bench-old b86ff48 && (cd /tmp/bench-old && python3 dev.py
  setup)``; left out when not set), to show what a change did to the round trips.

Rounds: each variant runs once per round in a fresh process, the order rotating from round
to round, so that every variant meets the same machine over the same minutes. In each
process: ``run_idempotently`` with no-op work on a pool of two connections (a new key, then
the same key again: the no-op decision, then a SELECT 1), then the same calls counted
through a proxy that reads the wire protocol. A checkout with the lease mode
(``lock_mode="lease"``, docs/locks.md) makes the same calls in that mode too, on keys of
their own: its rows (``lease: ...``) stand beside the advisory rows, whose names do not
change; its no-op must be one round trip (migration 0019). Each variant has its own
database (the versions' schemas differ).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULT_PREFIX, BenchResult, Size, at_most, database, median, percentile
from devtools.postgres import PostgresServer

TITLE = "The decision by Airflow line and before/after: round trips (counted) and latency"
CHILD = Path(__file__).resolve().parent / "decision_child.py"
BEFORE_ENV = "BENCH_BEFORE_CHECKOUT"
LIMIT_MS = 2.0  # the overhead benchmark's target, for the pool variants


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    python: str
    checkout: str


def variants() -> tuple[list[Variant], list[str]]:
    """The variants that can run here, and why any other is left out."""
    here = str(Path(__file__).resolve().parent.parent)
    found = [
        Variant(
            "3.3",
            "Airflow 3.3 env, this checkout",
            os.environ.get("IDEMPOTENCY_AIRFLOW3_PYTHON", sys.executable),
            here,
        )
    ]
    missing = []
    py2 = os.environ.get("IDEMPOTENCY_AIRFLOW2_PYTHON", "")
    if py2 and Path(py2).exists():
        found.append(Variant("2.11", "Airflow 2.11 env, this checkout", py2, here))
    else:
        missing.append("2.11 left out: no .venv-airflow2 (`python3 dev.py setup --airflow 2`)")
    before = os.environ.get(BEFORE_ENV, "")
    if before:
        py = Path(before) / ".venv" / "bin" / "python"
        if not py.exists():
            raise RuntimeError(f"{BEFORE_ENV}={before}: no {py} (run `python3 dev.py setup` there)")
        commit = subprocess.run(
            ["git", "-C", before, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        found.append(
            Variant("before", f"before: {commit or before}, Airflow 3 env", str(py), before)
        )
    else:
        missing.append(f"before/after left out: {BEFORE_ENV} not set (module doc)")
    return found, missing


def _child(variant: Variant, dsn: str, calls: int, counted: int, round_no: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    args = {"dsn": dsn, "calls": calls, "counted": counted, "round_no": round_no}
    proc = subprocess.run(
        [variant.python, str(CHILD), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=env,
        cwd="/",
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            if not Path(result["provider"]).is_relative_to(variant.checkout):
                raise RuntimeError(
                    f"{variant.name}: imported the provider from {result['provider']}"
                )
            return result
    raise RuntimeError(
        f"{variant.name} child exited {proc.returncode} without a result\n"
        f"--- stderr:\n{proc.stderr[-4000:]}"
    )


def _trips(values: list[int]) -> tuple[int, str]:
    """The count of the steady state (most frequent), and the spread if there is one."""
    counts = Counter(values)
    mode = counts.most_common(1)[0][0]
    other = {k: n for k, n in sorted(counts.items()) if k != mode}
    spread = (
        "every call"
        if not other
        else ", ".join(f"{n} call(s) {k}" for k, n in other.items()) + " (see notes)"
    )
    return mode, spread


def _sequence(steady: list[list[str]], server_ms: dict[str, float] | None = None) -> str:
    """``[BEGIN] 0.09 -> [acquire_run_lock] 0.35 -> ...``: each round trip's statements and,
    if known, the median time it waited for the server (ms, at the proxy)."""
    parts = []
    for trip in steady:
        text = " + ".join(trip)
        ms = (server_ms or {}).get(text)
        parts.append(f"[{text}]" + (f" {ms:.2f}" if ms is not None else ""))
    return " -> ".join(parts)


def _compare(steadies: dict[tuple[str, str], list[list[str]]]) -> str:
    """Which round trips only one of now and before has, for each kind of call."""
    parts = []
    for kind, label in (("new", "a new key"), ("noop", "the no-op decision")):
        now = [" + ".join(t) for t in steadies["3.3", kind]]
        before = [" + ".join(t) for t in steadies["before", kind]]
        only_now = [t for t in now if t not in before]
        only_before = [t for t in before if t not in now]
        verdict = (
            "no round trip more"
            if len(now) <= len(before)
            else f"{len(now) - len(before)} round trip(s) more"
        )
        parts.append(
            f"{label}: {len(now)} round trips now, {len(before)} before ({verdict}); only "
            f"now: {', '.join(f'[{t}]' for t in only_now) or 'none'}; only before: "
            f"{', '.join(f'[{t}]' for t in only_before) or 'none'}"
        )
    return (
        "**Now against before, round trip by round trip** (statement names from each "
        "checkout's queries.sql, so a statement that kept its name but changed its text "
        "counts as the same): " + "; ".join(parts).replace("_", "\\_") + "."
    )


FLOOR_FACTOR = 2.0  # issue 32, goal 4: each decision within 2x its physical floor
CPU_LIMIT_MS = 0.3  # the provider's own CPU per decision
THROUGHPUT_RATIO = 0.1  # no-op decisions per second through a pool / a SELECT 1 loop
ROUND_TRIPS = {"noop": 2, "new": 4}  # goal 4's round trips (the advisory mode)


def _goal_rows(
    result: BenchResult,
    v: Variant,
    rounds: list[dict[str, Any]],
    new_ms: float,
    noop_ms: float,
    limit: bool,
) -> None:
    """Issue 32's goal 4, measured in the same processes: each decision against its physical
    floor (a no-op: one round trip and one durable commit; a new key: two of each), this
    process's CPU per call, and no-op decisions per second through a pool against a SELECT 1
    loop on the same pool's connections."""
    commit = median([x for r in rounds for x in r["samples"]["commit"]])
    floors = {"noop": commit, "new": 2 * commit}  # a durable commit includes its round trip
    for kind, wall, label in (("noop", noop_ms, "no-op decision"), ("new", new_ms, "new key")):
        ratio = wall / floors[kind]
        result.add(
            f"{v.name}: {label} / its floor",
            ratio,
            "x",
            f"<= {FLOOR_FACTOR:g}x" if limit else "",
            at_most(ratio, FLOOR_FACTOR) if limit else None,
            f"floor {floors[kind]:.2f} ms: "
            f"{'one durable commit' if kind == 'noop' else 'two durable commits'} of a 1-row "
            f"INSERT ({commit:.2f} ms each, its round trip included)",
        )
    for kind, label in (("noop", "no-op decision"), ("new", "new key, whole call")):
        cpu = median([x for r in rounds for x in r["cpu"][kind]])
        result.add(
            f"{v.name}: client CPU per {label}, median",
            cpu,
            "ms",
            f"<= {CPU_LIMIT_MS:g} ms" if limit else "",
            at_most(cpu, CPU_LIMIT_MS) if limit else None,
            "this thread's CPU time (the provider, psycopg and the pool)",
        )
    _own_cpu_row(result, v, rounds, "", limit)
    _own_cpu_row(result, v, rounds, "", limit, "new")
    _throughput_row(result, v, rounds, "", limit)


_BARE = {
    ("", "noop"): "its message and COMMIT, the JSON row parsed",
    ("lease_", "noop"): "one message, the JSON row parsed",
    ("", "new"): "the decision's message; the start's BEGIN, then its statements and COMMIT "
    "pipelined; the completion and COMMIT pipelined",
    ("lease_", "new"): "the decision's message; the start's BEGIN, then its statements and "
    "COMMIT pipelined; the fenced completion pipelined",
}


def _own_cpu_row(
    result: BenchResult,
    v: Variant,
    rounds: list[dict[str, Any]],
    mode: str,
    limit: bool,
    kind: str = "noop",
) -> None:
    """The provider's own client CPU per ``kind`` of call (``noop``, ``new``) in ``mode``: the
    call's less that of its statements sent bare through the same pool, alternating with the
    calls in this thread (decision_bare: a no-op's for the same completed key, a new key's for
    a key of its own), so both pay the same sockets, psycopg and pool. Left out for a checkout
    that cannot be measured so."""
    bare = [x for r in rounds for x in r.get("bare_cpu", {}).get(f"{mode}{kind}", [])]
    if not bare:
        return
    call = median([x for r in rounds for x in r["cpu"][f"{mode}{kind}"]])
    own = call - median(bare)
    label = "no-op" if kind == "noop" else "new key"
    result.add(
        f"{v.name}: {'lease: ' if mode else ''}provider's own CPU per {label}, median",
        own,
        "ms",
        f"<= {CPU_LIMIT_MS:g} ms" if limit else "",
        at_most(own, CPU_LIMIT_MS) if limit else None,
        f"the call's {call:.3f} ms less {median(bare):.3f} ms for its statements sent bare "
        f"(pooled connections, {_BARE[mode, kind]}), measured alternately in this thread",
    )


def _throughput_row(
    result: BenchResult, v: Variant, rounds: list[dict[str, Any]], mode: str, limit: bool
) -> None:
    """No-op decisions per second through the pool in ``mode`` ("" the advisory mode,
    "lease_" the lease mode) against the SELECT 1 loop on the same pool's connections."""
    noops = median([r["throughput"][f"{mode}noop_per_s"] for r in rounds])
    select = median([r["throughput"]["select_1_per_s"] for r in rounds])
    commits = median([r["throughput"].get("commit_1_per_s", 0.0) for r in rounds])
    ratio = noops / select
    result.add(
        f"{v.name}: {'lease: ' if mode else ''}no-op/s through pool vs SELECT 1 loop",
        ratio,
        "x",
        f">= {THROUGHPUT_RATIO:g}" if limit else "",
        ratio >= THROUGHPUT_RATIO if limit else None,
        f"{noops:.0f} no-op decisions/s, {select:.0f} SELECT 1/s"
        + (" (the advisory row's loop)" if mode else "")
        + f"; a one-row durable INSERT loop {commits:.0f}/s (the no-op's floor: it commits its"
        " record); 8 threads, a pool of 8",
    )


LEASE_ROUND_TRIPS = {"noop": 1}  # the lease mode's no-op: one round trip (migration 0019)


def _lease_rows(result: BenchResult, v: Variant, rounds: list[dict[str, Any]], limit: bool) -> None:
    """The lease mode's decisions (``lock_mode="lease"``, docs/locks.md), beside the advisory
    rows and measured in the same processes: median, round trips, client CPU, ratio to the
    same floors (a no-op: one durable commit; a new key: two)."""
    commit = median([x for r in rounds for x in r["samples"]["commit"]])
    for kind, label, floor in (
        ("noop", "no-op decision", commit),
        ("new", "new key", 2 * commit),
    ):
        wall = [x for r in rounds for x in r["samples"][f"lease_{kind}"]]
        result.add(
            f"{v.name}: lease: {label}, pool, median",
            median(wall),
            "ms",
            note=f"p99 {percentile(wall, 99):.2f} ms; lock_mode='lease'",
        )
        trips, spread = _trips([x for r in rounds for x in r["trips"][f"lease_{kind}"]])
        most = LEASE_ROUND_TRIPS.get(kind)
        result.add(
            f"{v.name}: lease: round trips, {label}",
            trips,
            "",
            f"= {most}" if most and limit else "",
            trips == most if most and limit else None,
            spread,
        )
        cpu = median([x for r in rounds for x in r["cpu"][f"lease_{kind}"]])
        result.add(
            f"{v.name}: lease: client CPU per {label}, median",
            cpu,
            "ms",
            f"<= {CPU_LIMIT_MS:g} ms" if limit else "",
            at_most(cpu, CPU_LIMIT_MS) if limit else None,
            "this thread's CPU time (the provider, psycopg and the pool)",
        )
        _own_cpu_row(result, v, rounds, "lease_", limit, kind)
        ratio = median(wall) / floor
        result.add(
            f"{v.name}: lease: {label} / its floor",
            ratio,
            "x",
            f"<= {FLOOR_FACTOR:g}x" if limit else "",
            at_most(ratio, FLOOR_FACTOR) if limit else None,
            f"floor {floor:.2f} ms, as the advisory row's",
        )
    _throughput_row(result, v, rounds, "lease_", limit)


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("decision", TITLE)
    found, missing = variants()
    rounds = 1 if size.name == "tiny" else 3
    calls = max(10, size.overhead_runs // rounds)
    counted = 3 if size.name == "tiny" else 20
    out: dict[str, list[dict[str, Any]]] = {v.name: [] for v in found}
    with contextlib.ExitStack() as stack:
        dsns = [
            stack.enter_context(database(server, f"bench_decision_{v.name.replace('.', '')}"))
            for v in found
        ]
        for round_no in range(rounds):
            for j in range(len(found)):
                k = (j + round_no) % len(found)
                out[found[k].name].append(_child(found[k], dsns[k], calls, counted, round_no))

    def pooled(name: str, kind: str) -> list[float]:
        return [x for r in out[name] for x in r["samples"][kind]]

    def trips(name: str, kind: str) -> list[int]:
        return [x for r in out[name] for x in r["trips"][kind]]

    checks = {n: (trips(n, "select_1"), trips(n, "pipeline_3")) for n in out}
    for name, (one, three) in checks.items():
        if set(one) != {1} or set(three) != {1}:
            raise RuntimeError(f"{name}: the counter saw SELECT 1 as {one}, a pipeline as {three}")
    figures: dict[str, dict[str, float]] = {}
    for v in found:
        new, noop, rtt = (pooled(v.name, k) for k in ("new", "noop", "rtt"))
        new_trips, new_spread = _trips(trips(v.name, "new"))
        noop_trips, noop_spread = _trips(trips(v.name, "noop"))
        figures[v.name] = {
            "new": median(new),
            "noop": median(noop),
            "new_trips": new_trips,
            "noop_trips": noop_trips,
        }
        limit = v.name != "before"  # the target is this checkout's
        result.add(
            f"{v.name}: new key, pool, median",
            median(new),
            "ms",
            f"<= {LIMIT_MS:g} ms" if limit else "",
            at_most(median(new), LIMIT_MS) if limit else None,
            f"p99 {percentile(new, 99):.2f} ms; {v.label}",
        )
        result.add(
            f"{v.name}: no-op decision, pool, median",
            median(noop),
            "ms",
            f"<= {LIMIT_MS:g} ms" if limit else "",
            at_most(median(noop), LIMIT_MS) if limit else None,
            f"p99 {percentile(noop, 99):.2f} ms",
        )
        result.add(
            f"{v.name}: SELECT 1 round trip, median",
            median(rtt),
            "ms",
            note="the same processes' floor unit",
        )
        result.add(f"{v.name}: round trips, new key", new_trips, "", note=new_spread)
        result.add(f"{v.name}: round trips, no-op decision", noop_trips, "", note=noop_spread)
        if "commit" in out[v.name][0]["samples"]:  # this checkout's child (module doc)
            _goal_rows(result, v, out[v.name], median(new), median(noop), limit)
        if "lease_noop" in out[v.name][0]["samples"]:  # a checkout with the lease mode
            _lease_rows(result, v, out[v.name], limit)

    def ratio(a: str, b: str, kind: str, label: str) -> None:
        value = figures[a][kind] / figures[b][kind]
        result.add(label, value, "x", note="medians of the same rounds")

    if "2.11" in figures:
        ratio("2.11", "3.3", "new", "ratio 2.11 / 3.3, new key")
        ratio("2.11", "3.3", "noop", "ratio 2.11 / 3.3, no-op decision")
    if "before" in figures:
        for kind, label in (("new", "new key"), ("noop", "no-op decision")):
            ratio("3.3", "before", kind, f"ratio now / before, {label}")
            now, before = figures["3.3"][f"{kind}_trips"], figures["before"][f"{kind}_trips"]
            result.add(
                f"round trips now - before, {label}",
                now - before,
                "",
                "<= 0",
                now - before <= 0,
                f"{now:g} now, {before:g} before",
            )

    lines = [
        f"{rounds} round(s); in each, one fresh process per variant (order rotating), "
        f"{calls} new keys + {calls} no-op decisions (each in the advisory mode and, for a "
        f"checkout that has it, the lease mode) + {calls} SELECT 1 after a warm-up, "
        f"interleaved per iteration, on a pool of 2 connections; then {counted} of each "
        "counted through the wire-protocol proxy of bench/decision_child.py (a round trip = "
        "the client sends while nothing it asked for is outstanding, until the ReadyForQuery "
        "of its last Sync or Query; pipelined statements count once). The counter checks "
        "itself in every process: a SELECT 1 counts 1, three pipelined SELECTs count 1. "
        "Medians pool every round's samples.",
        "",
        "| variant | call | round trips (steady state) | statements, one [ ] per round trip, "
        "then its median wait for the server in ms (seen at the proxy) |",
        "|---|---|---:|---|",
    ]
    steadies: dict[tuple[str, str], list[list[str]]] = {}
    kinds = (
        ("new", "new key"),
        ("noop", "no-op decision"),
        ("lease_new", "lease: new key"),
        ("lease_noop", "lease: no-op decision"),
    )
    for v in found:
        for kind, label in kinds:
            if kind not in out[v.name][0]["statements"]:
                continue
            seqs: list[dict[str, Any]] = []
            for r in out[v.name]:
                seqs.extend(r["statements"].get(kind, []))
            merged: Counter[str] = Counter()
            for s in seqs:
                merged[json.dumps(s["round_trips"])] += s["calls"]
            steady = json.loads(merged.most_common(1)[0][0])
            steadies[v.name, kind] = steady
            waits: dict[str, list[float]] = {}
            for r in out[v.name]:
                for trip, ms in r["server_ms"].get(kind, {}).items():
                    waits.setdefault(trip, []).append(ms)
            server_ms = {trip: median(ms) for trip, ms in waits.items()}
            lines.append(
                f"| {v.label} | {label} | {len(steady)} | {_sequence(steady, server_ms)} |".replace(
                    "_", "\\_"
                )
            )
    others = []
    for v in found:
        for kind, _ in kinds:
            seen: Counter[str] = Counter()
            for r in out[v.name]:
                for s in r["statements"].get(kind, []):
                    seen[json.dumps(s["round_trips"])] += s["calls"]
            for key, n in seen.most_common()[1:]:
                others.append(f"{v.name} {kind}, {n} call(s): {_sequence(json.loads(key))}")
    result.notes.append("\n".join(lines))
    if "before" in figures:
        result.notes.append(_compare(steadies))
    if others:
        result.notes.append(
            "Calls off the steady state (a `prepare` round trip is psycopg preparing a "
            "server-side statement on its fifth execution on a connection, once per "
            "statement and connection): " + "; ".join(others).replace("_", "\\_") + "."
        )
    if missing:
        result.notes.append("Left out: " + "; ".join(missing) + ".")
    result.notes.append(
        "Load average is in the machine line at the top; "
        + "; ".join(
            f"{v.name} SELECT 1 median {statistics.median(pooled(v.name, 'rtt')):.3f} ms"
            for v in found
        )
        + " (the same floor for every variant means they met the same machine)."
    )
    return result
