"""Contention: N worker processes call ``run_idempotently`` on ONE key at the same moment.

One wins the advisory lock and holds it (its work waits until every loser has reported);
each of the others must decide "locked by another execution" (RunLockedError, with the
holder described and a ``lock_held`` attempt row recorded) quickly. Decision time is
measured in each loser from the common start signal to the exception.

Four rounds, each on a fresh key:

* ``connect in call``: ``connect=lambda: psycopg.connect(dsn)``, as the Airflow operator
  does: all N backends are forked by Postgres at the same moment;
* ``fresh session``: each process opened its session before the start signal;
* ``warm session``: the session of the previous round, used once before (a pool);
* ``floor``: connect and ``pg_try_advisory_lock`` only, nothing recorded: the reference
  for what N simultaneous new sessions cost on this machine.

Each process is a fresh interpreter (multiprocessing "spawn"), so ``ensure_schema``'s
per-process check runs inside the timed call, as in a fresh Airflow task process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

import psycopg

from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.schema import ensure_schema
from bench.common import BenchResult, Size, at_most, database, median, say
from devtools.postgres import PostgresServer

TITLE = "Contention: many workers on one key"
JOB = "bench.contention"
TARGET_MS = 100.0


MODES = ("connect in call", "fresh session", "warm session", "floor: connect + try lock")
FLOOR = MODES[-1]
WARM_KEY = "warm-up"


def _worker(dsn: str, ready: Any, starts: Any, releases: Any, results: Any) -> None:
    import logging

    from airflow_idempotency import RunLockedError, run_idempotently
    from airflow_idempotency.run_context import RunEnvironment

    quiet = logging.getLogger("bench.contention.worker")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    environment = RunEnvironment(logger=quiet)

    def hold_until(event: Any) -> Any:
        def hold(_run: Any) -> dict[str, int]:
            event.wait(120)
            return {}

        return hold

    conn: psycopg.Connection | None = None
    for index, mode in enumerate(MODES):
        if mode == "fresh session":
            conn = psycopg.connect(dsn)
        elif mode == "warm session":
            # One decision on a key the parent holds: warms this process (ensure_schema's
            # check, the SQL files) and the backend's catalog caches and plans.
            assert conn is not None
            session = conn
            with contextlib.suppress(RunLockedError):
                run_idempotently(
                    connect=_session_first(dsn, session),
                    job_name=JOB,
                    run_key=WARM_KEY,
                    work=hold_until(releases[index]),
                    environment=environment,
                )
            conn = psycopg.connect(dsn) if session.closed else session

        connect = _session_first(dsn, conn)

        ready.wait()
        starts[index].wait()
        t0 = time.perf_counter()
        woke = time.time()
        if mode == FLOOR:
            _floor_round(dsn, f"round-{index}", releases[index], results, index, t0, woke)
            ready.wait()
            continue
        try:
            run_idempotently(
                connect=connect,
                job_name=JOB,
                run_key=f"round-{index}",
                work=hold_until(releases[index]),
                environment=environment,
            )
            results.put({"round": index, "outcome": "won", "woke": woke})
        except RunLockedError as exc:
            ms = (time.perf_counter() - t0) * 1000
            results.put(
                {"round": index, "outcome": "locked", "ms": ms, "woke": woke, "h": bool(exc.holder)}
            )
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            results.put({"round": index, "outcome": "error", "error": error, "woke": woke})
        ready.wait()  # the round is over for everybody before the next one is set up
        if conn is not None and conn.closed:
            conn = psycopg.connect(dsn)
    if conn is not None:
        conn.close()


def _session_first(dsn: str, session: psycopg.Connection | None) -> Callable[[], Any]:
    """A connection factory whose first call lends ``session`` (the lock connection: the
    one that decides); later calls (the work connection of a winner) open new ones."""
    lent = session is None

    def connect() -> Any:
        nonlocal lent
        if lent:
            return psycopg.connect(dsn)
        lent = True
        assert session is not None
        return contextlib.nullcontext(session)

    return connect


def _floor_round(
    dsn: str, key: str, release: Any, results: Any, index: int, t0: float, woke: float
) -> None:
    """The least any loser must do: open a session and try the lock (no records, no holder)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (run_lock_key(JOB, key),)).fetchone()
        if row and row[0]:
            results.put({"round": index, "outcome": "won", "woke": woke})
            release.wait(120)
            return
    ms = (time.perf_counter() - t0) * 1000
    results.put({"round": index, "outcome": "locked", "ms": ms, "woke": woke, "h": False})


def _rounds(dsn: str, workers: int) -> list[list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(workers + 1)
    starts = [ctx.Event() for _ in MODES]
    releases = [ctx.Event() for _ in MODES]
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(dsn, ready, starts, releases, results))
        for _ in range(workers)
    ]
    out: list[list[dict[str, Any]]] = [[] for _ in MODES]
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (run_lock_key(JOB, WARM_KEY),))
        for p in procs:
            p.start()
        try:
            for index, _mode in enumerate(MODES):
                ready.wait(300)  # every process imported and (pre-)connected
                time.sleep(0.5)  # let the set-up storm settle before the common start
                t0 = time.monotonic()
                starts[index].set()
                got = out[index]
                while len([r for r in got if r["outcome"] != "won"]) < workers - 1:
                    try:
                        got.append(results.get(timeout=max(0.1, t0 + 60 - time.monotonic())))
                    except queue.Empty:
                        break
                releases[index].set()
                while len(got) < workers:
                    try:
                        got.append(results.get(timeout=30))
                    except queue.Empty:
                        raise RuntimeError(
                            f"round {MODES[index]!r}: {len(got)} of {workers} workers reported "
                            f"after {time.monotonic() - t0:.0f} s: {got}"
                        ) from None
                say(f"contention: round {MODES[index]!r} over in {time.monotonic() - t0:.1f} s")
                ready.wait(120)
        except BaseException:
            ready.abort()  # wake every worker up: they exit with BrokenBarrierError
            raise
        finally:
            for event in (*starts, *releases):
                event.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return out


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("contention", TITLE)
    n = size.contention_workers
    with database(server, "bench_contention") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
        rounds = _rounds(dsn, n)
        for mode, outcomes in zip(MODES, rounds, strict=True):
            won = [o for o in outcomes if o["outcome"] == "won"]
            lost = [o for o in outcomes if o["outcome"] == "locked"]
            errors = [o["error"] for o in outcomes if o["outcome"] == "error"]
            if len(won) != 1 or len(lost) != n - 1 or errors:
                raise RuntimeError(
                    f"{mode}: {len(won)} won, {len(lost)} lost of {n}; errors {errors[:3]}"
                )
            ms = [o["ms"] for o in lost]
            spread = (max(o["woke"] for o in outcomes) - min(o["woke"] for o in outcomes)) * 1000
            floor = mode == FLOOR
            result.add(
                f"{mode}: {n - 1} losers, max" + ("" if floor else " decision"),
                max(ms),
                "ms",
                "" if floor else f"<= {TARGET_MS:g} ms",
                None if floor else at_most(max(ms), TARGET_MS),
                f"wake-up spread {spread:.0f} ms"
                + ("; reference, not a decision" if floor else ""),
            )
            result.add(f"{mode}: median" + ("" if floor else " decision"), median(ms), "ms")
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT outcome, count(*) FROM idempotency.job_run_attempts GROUP BY 1 ORDER BY 1"
            ).fetchall()
        result.notes.append(
            f"{n} processes, four rounds on fresh keys, each started together by one "
            "multiprocessing Event once every process was ready; decision time is measured in "
            "each loser from its own wake-up to RunLockedError. Each loser checks the schema "
            "version (once per process), tries the lock and sets up its session in one "
            "statement, names the holder (pg_locks + pg_stat_activity + the holder's attempt "
            "row, one statement), records a lock_held attempt (a durable commit), restores "
            "its session and raises. `connect in call` is what an Airflow task does (a new "
            "process, a new session: Postgres forks N backends at once); `fresh session` "
            "connected before the signal but never used its session, so the backend's catalog "
            "caches are cold and the process's first call still reads the SQL files; `warm "
            "session` reuses the session of the previous round, as a pool would. `floor` is "
            "the least a loser can do with a new session: connect and try the lock, nothing "
            "else (last, so its processes are warm: if anything it flatters the floor). "
            f"Attempt rows afterwards: {dict(rows)}."
        )
        result.notes.append(
            "**What limits it.** The losers are CPU-bound, not lock-bound: with a new session "
            "each, N backends are forked, authenticated and warm their catalog caches at the "
            "same moment on two cores, which the `floor` round shows costs most of the 100 ms "
            "budget by itself (connect + one statement, nothing recorded). The contract adds "
            "the statements above on those cold backends (~10 ms wall for a single "
            "connect-in-call loser measured alone, of which ~4 ms is the connection) and the "
            "client CPU of a fresh process, so the last of N-1 losers waits for roughly "
            "(N-1) x that work / cores. A loser whose session is warm (a pool: the `warm "
            "session` round) decides well within the target; a new but unused session (`fresh "
            "session`) still warms its backend inside the decision and lands around the "
            "target, on either side of it from run to run. Already done to shorten the "
            "path: one statement for lock + session set-up, one for the holder and its "
            "attempt, one query for the schema version, the migration files no longer read "
            "when the schema is current, a partial index so naming the holder never scans "
            "old attempts. Left: describing the holder and the durable lock_held row are what "
            "make the refusal useful and auditable, so they stay."
        )
    return result
