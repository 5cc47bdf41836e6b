"""The decision's cost on the wire (issue 32, goal 4: a cheaper decision).

Round trips are counted by the wire-protocol proxy of the decision benchmark
(bench/decision_child.py: a round trip is the client waiting for the server; pipelined
statements count once), through a pool of two connections, after two warm-up calls (the
schema check and the caches of the process).

- the advisory mode: a no-op decision in at most 2 round trips (BEGIN and run_decide() in one
  message, then COMMIT), a new key in at most 4;
- the lease mode (migration 0019): a no-op decision in ONE round trip (BEGIN,
  run_decide_lease() and COMMIT in one message: no lease taken, see docs/locks.md), a new key
  in at most 4 (the decision taking the lease; the start; the completion, which releases the
  lease at its COMMIT). Before 0018: 6 and 10;
- the lock transaction keeps no table lock while the work runs: run_decide() reads job_runs in a
  subtransaction it rolls back, so a migration's ALTER TABLE never waits behind a running job.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from airflow_idempotency import schema as schema_mod
from airflow_idempotency.leases import LockMode
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.records import RunOptions
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from bench.decision_bare import JOB as BARE_JOB
from bench.decision_bare import bare_new, bare_noop
from bench.decision_child import CountingProxy, _keepalive, labeller
from support.db import rows

JOB = "round-trips"
# The ceilings: goal 4's (a no-op in 2, a new key in 4), the lease mode's no-op lower still.
CEILINGS = {"advisory": {"new": 4, "noop": 2}, "lease": {"new": 4, "noop": 1}}
_serial = itertools.count()


@pytest.fixture
def counted(pg_dsn: str) -> Iterator[tuple[CountingProxy, ConnectionPool]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn)
    params = conninfo_to_dict(pg_dsn)
    proxy = CountingProxy(str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432))))
    dsn = make_conninfo(
        pg_dsn, host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable"
    )
    try:
        with ConnectionPool(dsn, min_size=2, max_size=2, open=True, name="counted") as pool:
            pool.wait()
            yield proxy, pool
    finally:
        proxy.close()


def _round_trips(
    proxy: CountingProxy, pool: ConnectionPool, mode: str, calls: int = 3
) -> dict[str, list[list[list[str]]]]:
    """Each call's round trips (statement names), for a new key and its no-op decision."""
    label = labeller()
    seen: dict[str, list[list[list[str]]]] = {"new": [], "noop": []}
    for i in range(-2, calls):  # two uncounted calls first
        key = f"{mode}-{next(_serial)}"
        for kind, expect in (("new", RunOutcome.COMPLETED), ("noop", RunOutcome.NOOP)):
            proxy.start()
            result = run_idempotently(
                connect=pool.connection,
                job_name=JOB,
                run_key=key,
                work=lambda run: None,
                lock_mode=LockMode(mode),
            )
            flights = proxy.stop()
            assert result.outcome is expect, (key, result)
            if i >= 0:
                seen[kind].append([[label(s) for s in flight] for flight in flights])
    return seen


@pytest.mark.parametrize("mode", ["advisory", "lease"])
def test_the_decision_takes_at_most_its_round_trips(
    counted: tuple[CountingProxy, ConnectionPool], mode: str
) -> None:
    proxy, pool = counted
    seen = _round_trips(proxy, pool, mode)
    for kind, ceiling in CEILINGS[mode].items():
        worst = max(seen[kind], key=len)
        assert len(worst) <= ceiling, f"{mode} {kind}: {len(worst)} round trips: {worst}"
    if mode == "advisory":
        # the no-op: one message for BEGIN and the decision, then the COMMIT that records it
        assert seen["noop"][0] == [["decide"], ["COMMIT"]], seen["noop"][0]
    else:
        # the no-op: BEGIN, the decision and COMMIT in one message; no lease, no release
        assert seen["noop"][0] == [["decide_lease"]], seen["noop"][0]


def test_the_counter_would_see_a_round_trip_more(
    counted: tuple[CountingProxy, ConnectionPool],
) -> None:
    """The counter is not blind: one statement more on the lock connection is one round trip
    more."""
    proxy, pool = counted
    with pool.connection() as conn:
        conn.autocommit = True
        proxy.start()
        conn.execute("SELECT 1").fetchone()
        conn.execute("SELECT 2").fetchone()
        assert len(proxy.stop()) == 2


def test_the_lock_transaction_keeps_no_table_lock_while_the_work_runs(pg_dsn: str) -> None:
    """run_decide() read job_runs (and job_run_attempts) in a subtransaction rolled back at
    once: the lock session holds the advisory lock and no table lock, so an ALTER TABLE of a
    migration does not wait behind the run."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn)
    held: list[Any] = []

    def work(run: RunContext) -> None:
        held.extend(
            rows(
                pg_dsn,
                "SELECT l.locktype, c.relname, l.mode FROM pg_locks AS l "
                "LEFT JOIN pg_class AS c ON c.oid = l.relation "
                "WHERE l.locktype = 'relation' AND l.pid IN ("
                "  SELECT h.pid FROM idempotency.held_run_locks() AS h WHERE h.lock_key = %s"
                ") ORDER BY c.relname",
                (run_lock_key(JOB, "no-table-lock"),),
            )
        )

    for rerun in (False, True):  # a new key, then a forced rerun of the completed key
        held.clear()
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name=JOB,
            run_key="no-table-lock",
            work=work,
            options=RunOptions(force=rerun),
            lock_mode="advisory",
        )
        assert held == [], held
    assert rows(
        pg_dsn,
        "SELECT count(*) FROM idempotency.job_run_attempts WHERE run_key = 'no-table-lock' "
        "AND outcome = 'completed'",
    ) == [(2,)]


@pytest.mark.parametrize("mode", ["advisory", "lease"])
def test_a_keys_statements_sent_bare_are_the_providers_own(
    counted: tuple[CountingProxy, ConnectionPool], mode: str
) -> None:
    """The decision benchmark's "provider's own CPU per new key" is the call's CPU less that of
    its statements sent bare (bench/decision_bare.py): fair only while the bare side sends what
    the provider sends, message for message, round trip for round trip, on as many pooled
    connections, however many calls ran on them before (psycopg prepares a statement run
    ``prepare_threshold`` times on a connection; the provider turns that off, adv33a)."""
    proxy, pool = counted
    label = labeller()
    bare = bare_new("lease_" if mode == "lease" else "")
    noop = bare_noop("lease_" if mode == "lease" else "")
    assert bare is not None and noop is not None
    keepalive = _keepalive(pool)
    taken = [0]

    @contextlib.contextmanager
    def connect() -> Iterator[psycopg.Connection[Any]]:
        taken[0] += 1
        with pool.connection() as conn:
            yield conn

    def sent(call: Callable[[], object]) -> tuple[list[list[str]], list[list[str]], int]:
        """The round trips ``call`` sent (statement names), the keys of the JSON objects the
        decision's message spells out (the session's, the attempt's), the connections taken."""
        taken[0] = 0
        proxy.start()
        call()
        flights = proxy.stop()
        spelled = [
            sorted(json.loads(literal))
            for flight in flights
            for text in flight
            for literal in re.findall(r"'(\{[^']*\})'", text)
        ]
        return [[label(s) for s in flight] for flight in flights], spelled, taken[0]

    def provider_run(key: str) -> object:
        """The provider's own call for ``key`` (a new key, then its no-op)."""
        return run_idempotently(
            connect=connect,
            job_name=BARE_JOB,
            run_key=key,
            work=lambda run: None,
            lock_mode=LockMode(mode),
        )

    for i in range(-2, 8):  # two uncounted first (the schema's check); past prepare_threshold
        key = f"bare-{mode}-{next(_serial)}"
        provider = sent(functools.partial(provider_run, key))
        bare_side = sent(functools.partial(bare, connect, f"{key}-bare", keepalive))
        assert i < 0 or bare_side == provider, (
            f"call {i}: the provider sent {provider}, bare {bare_side}"
        )
        # the no-op's too (bare_noop, the same completed key)
        provider = sent(functools.partial(provider_run, key))
        bare_side = sent(functools.partial(noop, connect, key))
        assert i < 0 or bare_side == provider, (
            f"no-op {i}: the provider sent {provider}, bare {bare_side}"
        )
