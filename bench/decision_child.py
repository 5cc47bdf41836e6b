"""Child of bench/decision.py: latency and exact round trips of one provider checkout.

Run as a script (``python bench/decision_child.py JSON``) by the interpreter of the
checkout under test (this one's .venv, .venv-airflow2, or an older checkout's .venv), so
that ``airflow_idempotency`` is that checkout's. Self-contained on purpose: it imports only
the standard library, psycopg, psycopg_pool and the provider, all of which every measured
checkout has.

Round trips are counted by a proxy that parses the PostgreSQL wire protocol between the
client and the server (:class:`CountingProxy`): a round trip starts when the client sends
while nothing it asked for is outstanding, and ends when the server's ReadyForQuery
answers the last Sync / Query the client sent. Pipelined statements sent before the reply
count once; every wait of the client for the server counts once.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import select
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

try:  # run as a script: its folder is sys.path[0] (module doc)
    from decision_bare import bare_new, bare_noop
except ImportError:  # imported as bench.decision_child (tests/integration: its proxy, labeller)
    from bench.decision_bare import bare_new, bare_noop

RESULT_PREFIX = "BENCH-RESULT "
JOB = "bench.decision"
PREPARE = "\x00prepare "  # marks a Parse of a named (server-side prepared) statement


@dataclass
class _Wire:
    """What the proxy tracks of one client connection."""

    outstanding: int = 0  # Syncs and Queries sent, not yet answered by a ReadyForQuery
    open: list[str] | None = None  # the statements of the round trip under way
    span: list[float] = field(default_factory=lambda: [0.0, 0.0])
    cbuf: bytes = b""
    sbuf: bytes = b""
    prepared: dict[bytes, bytes] = field(default_factory=dict)  # name -> text


class CountingProxy:
    """A TCP proxy to Postgres that counts the client's round trips and names the statements.

    Connections must not use SSL or GSS encryption (the DSN sets ``sslmode=disable``,
    ``gssencmode=disable``), so that the messages can be read.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.lock = threading.Lock()
        self.counting = False
        self.flights: list[list[str]] = []  # one list of statement texts per round trip
        self.spans: list[list[float]] = []  # [first send, ReadyForQuery] of each, perf_counter
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def start(self) -> None:
        with self.lock:
            self.flights = []
            self.spans = []
            self.counting = True

    def stop(self) -> list[list[str]]:
        with self.lock:
            self.counting = False
            return self.flights

    def server_ms(self) -> list[float]:
        """How long each counted round trip waited at the proxy for the server, in ms."""
        with self.lock:
            return [(end - start) * 1000 for start, end in self.spans if end]

    def close(self) -> None:
        self._stop = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        state = _Wire()
        started = False
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [])
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        if not started:  # the startup message has no type byte
                            started = True
                            (length,) = struct.unpack("!I", data[:4])
                            self._client(state, data[length:])
                        else:
                            self._client(state, data)
                        server.sendall(data)
                    else:
                        self._server(state, data)
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    @staticmethod
    def _messages(buf: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
        out = []
        while len(buf) >= 5:
            (length,) = struct.unpack("!I", buf[1:5])
            if len(buf) < 1 + length:
                break
            out.append((buf[:1], buf[5 : 1 + length]))
            buf = buf[1 + length :]
        return out, buf

    def _client(self, state: _Wire, data: bytes) -> None:
        messages, state.cbuf = self._messages(state.cbuf + data)
        with self.lock:
            for kind, body in messages:
                if kind == b"X":  # Terminate: the client closes, it waits for nothing
                    continue
                flight = state.open
                if flight is None:
                    flight = state.open = []
                    state.span = [time.perf_counter(), 0.0]
                    if self.counting:
                        self.flights.append(flight)
                        self.spans.append(state.span)
                if kind == b"Q":
                    flight.append(body.split(b"\x00", 1)[0].decode("utf-8", "replace"))
                elif kind == b"P":
                    name, text = body.split(b"\x00", 2)[:2]
                    if name:  # a named statement: later Binds name it, without the text
                        state.prepared[name] = text
                        flight.append(PREPARE + text.decode("utf-8", "replace"))
                    else:
                        flight.append(text.decode("utf-8", "replace"))
                elif kind == b"B":
                    name = body.split(b"\x00", 2)[1]
                    if name:
                        flight.append(state.prepared.get(name, b"?").decode("utf-8", "replace"))
                if kind in (b"Q", b"S"):
                    state.outstanding += 1

    def _server(self, state: _Wire, data: bytes) -> None:
        messages, state.sbuf = self._messages(state.sbuf + data)
        with self.lock:
            for kind, _ in messages:
                if kind == b"Z":
                    state.outstanding = max(0, state.outstanding - 1)
                    if state.outstanding == 0 and state.open is not None:
                        state.open = None
                        state.span[1] = time.perf_counter()


def _normal(text: str) -> str:
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return " ".join(" ".join(lines).split())


def labeller() -> Callable[[str], str]:
    """Name a statement by its ``-- name:`` in this checkout's queries.sql, else its first
    words (BEGIN, COMMIT, SAVEPOINT ...)."""
    from airflow_idempotency import _sql

    known: list[tuple[str, str]] = []
    try:  # this checkout's loader takes the file's name; older checkouts read queries.sql
        queries = _sql._queries("queries.sql")  # type: ignore[call-arg, unused-ignore]
    except TypeError:
        queries = _sql._queries()  # type: ignore[call-arg, unused-ignore]
    for name, body in queries.items():
        text = _normal(body.replace("{schema}", '"idempotency"'))
        prefix = re.split(r"%\(|%s", text, maxsplit=1)[0][:120]
        if len(prefix) >= 12:
            known.append((prefix, name))
    known.sort(key=lambda item: -len(item[0]))

    def label(statement: str) -> str:
        if statement.startswith(PREPARE):
            return "prepare " + label(statement[len(PREPARE) :])
        text = _normal(statement)
        for prefix, name in known:
            if text.startswith(prefix):
                return name
        return " ".join(text.split()[:2]) if text else "(empty)"

    return label


def _pct(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-pct * len(ordered) // 100))))
    return ordered[rank - 1]


def _distinct(seqs: list[list[list[str]]]) -> list[dict[str, Any]]:
    """The distinct round-trip sequences of a kind of call, most frequent first."""
    counts: dict[str, int] = {}
    for seq in seqs:
        key = json.dumps(seq)
        counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: -item[1])
    return [{"calls": n, "round_trips": json.loads(key)} for key, n in ordered]


THREADS = 8
SPAN_S = 1.5


def _loop(threads: int, seconds: float, step: Callable[[int, int], None]) -> float:
    """Calls of ``step(thread, i)`` per second, ``threads`` threads for ``seconds``. A step
    that raises fails the loop (a thread that died would count 0 calls, silently)."""
    done = [0] * threads
    failed: list[BaseException] = []
    stop = time.monotonic() + seconds

    def worker(t: int) -> None:
        i = 0
        try:
            while time.monotonic() < stop:
                step(t, i)
                i += 1
        except BaseException as exc:
            failed.append(exc)
        done[t] = i

    started = time.monotonic()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if failed:
        raise RuntimeError(f"{len(failed)} of {threads} threads failed: {failed[0]!r}") from failed[
            0
        ]
    return sum(done) / (time.monotonic() - started)


def _throughput(
    dsn: str, call: Callable[..., float], round_no: int, modes: tuple[str, ...]
) -> dict[str, float]:
    """No-op decisions per second through a pool of THREADS connections, THREADS threads,
    against a SELECT 1 loop on the same pool's connections (issue 32, goal 4), in each lock
    mode of ``modes`` ("" the advisory mode, "lease_" the lease mode) one after the other."""
    keys = {m: [f"r{round_no}-{m}tp-{t}" for t in range(THREADS)] for m in modes}
    with ConnectionPool(dsn, min_size=THREADS, max_size=THREADS, open=True, name="tp") as pool:
        pool.wait()
        for mode, mode_keys in keys.items():
            for key in mode_keys:
                call(pool.connection, key, _completed(), mode)

        def select_1(t: int, i: int) -> None:
            with pool.connection() as c:
                c.autocommit = True
                c.execute("SELECT 1").fetchone()

        def decision(mode: str) -> Callable[[int, int], None]:
            def step(t: int, i: int) -> None:
                # each thread its own completed key: two decisions of one key at once would
                # refuse one of them (lock_held), not measure a no-op
                call(pool.connection, keys[mode][t], _noop_outcome(), mode)

            return step

        def commit_1(t: int, i: int) -> None:
            # a no-op's physical floor: one round trip that commits one row durably
            with pool.connection() as c:
                c.autocommit = True
                c.execute("INSERT INTO public.bench_commit_probe DEFAULT VALUES")

        found = {
            "select_1_per_s": _loop(THREADS, SPAN_S, select_1),
            "commit_1_per_s": _loop(THREADS, SPAN_S, commit_1),
        }
        for mode in modes:
            found[f"{mode}noop_per_s"] = _loop(THREADS, SPAN_S, decision(mode))
    return found


def _completed() -> Any:
    from airflow_idempotency.runner import RunOutcome

    return RunOutcome.COMPLETED


def _noop_outcome() -> Any:
    from airflow_idempotency.runner import RunOutcome

    return RunOutcome.NOOP


def _keepalive(pool: ConnectionPool) -> dict[str, str]:
    """The dead-peer settings the provider sends for this pool's connections (the same for
    each: they are the DSN's), or none for a checkout without them."""
    try:
        from airflow_idempotency.locks import server_keepalive_settings
    except ImportError:
        return {}
    with pool.connection() as conn:
        return server_keepalive_settings(conn)


def measure(dsn: str, calls: int, counted: int, round_no: int) -> dict[str, Any]:
    from airflow_idempotency.runner import RunOutcome, run_idempotently
    from airflow_idempotency.schema import ensure_schema

    def noop(_run: object) -> None:
        return None

    # the lease mode (issue 32), when this checkout has it: its calls are kinds of their own
    lease = "lock_mode" in inspect.signature(run_idempotently).parameters
    modes = ("", "lease_") if lease else ("",)
    cpu: dict[str, list[float]] = {f"{m}{k}": [] for m in modes for k in ("new", "noop")}
    bare = {m: bare_noop(m) for m in modes}
    bare_cpu: dict[str, list[float]] = {f"{m}noop": [] for m in modes if bare[m]}
    bare_new_of = {m: bare_new(m) for m in modes}
    bare_cpu.update({f"{m}new": [] for m in modes if bare_new_of[m]})

    def call(connect: Callable[[], Any], key: str, expect: RunOutcome, mode: str = "") -> float:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        if mode:  # lock_mode only when asked: an older checkout has no such argument
            res = run_idempotently(
                connect=connect, job_name=JOB, run_key=key, work=noop, lock_mode="lease"
            )
        else:
            res = run_idempotently(connect=connect, job_name=JOB, run_key=key, work=noop)
        wall = (time.perf_counter_ns() - t0) / 1e6
        cpu[mode + ("new" if expect is RunOutcome.COMPLETED else "noop")].append(
            (time.thread_time_ns() - c0) / 1e6
        )
        if res.outcome is not expect:
            raise AssertionError(f"{key}: {res.outcome} instead of {expect}")
        return wall

    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
        conn.execute("CREATE TABLE IF NOT EXISTS public.bench_commit_probe (id bigserial)")
    samples: dict[str, list[float]] = {k: [] for k in (*cpu, "rtt", "commit")}
    warmup = min(30, max(3, calls // 4))
    with ConnectionPool(dsn, min_size=2, max_size=2, open=True, name="latency") as pool:
        keepalive = _keepalive(pool)
        for i in range(-warmup, calls):
            walls = {}
            for mode in modes:
                key = f"r{round_no}-{mode}lat-{i}"
                walls[f"{mode}new"] = call(pool.connection, key, RunOutcome.COMPLETED, mode)
                walls[f"{mode}noop"] = call(pool.connection, key, RunOutcome.NOOP, mode)
                bare_call = bare[mode]
                if bare_call is not None:  # the same statements again, for the completed key
                    bare_cpu[f"{mode}noop"].append(bare_call(pool.connection, key))
                new_call = bare_new_of[mode]
                if new_call is not None:  # a new key's statements, for a key of its own
                    bare_key = f"r{round_no}-{mode}bare-{i}"
                    bare_cpu[f"{mode}new"].append(new_call(pool.connection, bare_key, keepalive))
            with pool.connection() as c:
                c.autocommit = True
                t0 = time.perf_counter_ns()
                c.execute("SELECT 1").fetchone()
                rtt = (time.perf_counter_ns() - t0) / 1e6
                t0 = time.perf_counter_ns()  # a durable commit: one round trip and a WAL flush
                c.execute("INSERT INTO public.bench_commit_probe DEFAULT VALUES")
                commit = (time.perf_counter_ns() - t0) / 1e6
            if i >= 0:
                for kind, wall in walls.items():
                    samples[kind].append(wall)
                samples["rtt"].append(rtt)
                samples["commit"].append(commit)
            else:
                for values in (*cpu.values(), *bare_cpu.values()):
                    values.clear()
    cpu_samples = {kind: list(values) for kind, values in cpu.items()}
    throughput = _throughput(dsn, call, round_no, modes)

    params = conninfo_to_dict(dsn)
    proxy = CountingProxy(str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432))))
    proxied = make_conninfo(
        dsn, host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable"
    )
    label = labeller()
    trips: dict[str, list[int]] = {k: [] for k in (*cpu, "select_1", "pipeline_3")}
    shown: dict[str, list[list[list[str]]]] = {}
    server_ms: dict[str, dict[str, list[float]]] = {}
    try:
        with ConnectionPool(proxied, min_size=2, max_size=2, open=True, name="counted") as pool:
            pool.wait()
            for i in range(-2, counted):  # two uncounted calls first: schema check, caches
                calls_of = [
                    (f"{mode}{kind}", expect, mode)
                    for mode in modes
                    for kind, expect in (("new", RunOutcome.COMPLETED), ("noop", RunOutcome.NOOP))
                ]
                for kind, expect, mode in calls_of:
                    key = f"r{round_no}-{mode}rt-{i}"
                    proxy.start()
                    call(pool.connection, key, expect, mode)
                    flights = proxy.stop()
                    if i >= 0:
                        for flight, ms in zip(flights, proxy.server_ms(), strict=False):
                            server_ms.setdefault(kind, {}).setdefault(
                                " + ".join(label(s) for s in flight), []
                            ).append(ms)
                        trips[kind].append(len(flights))
                        named = [[label(s) for s in f] for f in flights]
                        # the most common sequence is shown; others are kept apart
                        seqs = shown.setdefault(kind, [])
                        seqs.append(named)
            # The counter's own check: one statement is one round trip, three pipelined
            # statements are one.
            with pool.connection() as c:
                c.autocommit = True
                proxy.start()
                c.execute("SELECT 1").fetchone()
                trips["select_1"].append(len(proxy.stop()))
                proxy.start()
                with c.pipeline():
                    for _ in range(3):
                        c.execute("SELECT 1")
                trips["pipeline_3"].append(len(proxy.stop()))
    finally:
        proxy.close()

    def stats(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "p99": _pct(values, 99)}

    return {
        "latency": {k: stats(v) for k, v in samples.items()},
        "samples": samples,
        "cpu": cpu_samples,
        "bare_cpu": bare_cpu,
        "throughput": throughput,
        "trips": trips,
        "server_ms": {
            kind: {trip: statistics.median(v) for trip, v in by.items()}
            for kind, by in server_ms.items()
        },
        "statements": {kind: _distinct(seqs) for kind, seqs in shown.items()},
        "python": sys.executable,
        "provider": os.path.dirname(sys.modules["airflow_idempotency"].__file__ or ""),
    }


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    result = measure(**args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
