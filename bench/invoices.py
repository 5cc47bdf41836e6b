"""Invoice creation for one business date: the idempotent task vs the bare statement.

One template database is seeded with ``dags/invoicing/seed.py``'s ``seed_orders`` (N
orders shipped on one date), vacuumed and analysed, with the bookkeeping schema in place.
Each measurement gets its own copy of it (``CREATE DATABASE ... TEMPLATE``), a CHECKPOINT,
and a fresh interpreter that does the work and reports its own time and peak RSS:

* ``bare``: ``psycopg.connect`` and the ``create_invoices`` statement of
  ``dags/invoicing/queries.sql`` in one transaction;
* ``idempotent``: ``run_idempotently(work=invoicing.tasks.create_invoices)``, the very
  function the DAG's task runs (lock, run records, example-schema check, the same
  statement in a fenced transaction, completion).

Order bare, idempotent, idempotent, bare (ABBA), so that drift in the machine's load
weighs on both sides alike; the ratio is median over median.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg

from bench.common import (
    BenchResult,
    Size,
    at_most,
    checkpoint,
    median,
    run_child,
    say,
)
from devtools.postgres import PostgresServer

TITLE = "Invoice creation for one date"
DAY = "2026-10-01"
JOB = "finalize_invoices.create_invoices"
RSS_LIMIT_MB = 300.0
RATIO_LIMIT = 1.3


def child_bare(dsn: str, day: str) -> dict[str, Any]:
    from invoicing import queries

    t0 = time.perf_counter()
    with psycopg.connect(dsn) as conn, conn.transaction(), conn.cursor() as cur:
        cur.execute(queries()["create_invoices"], {"business_date": dt.date.fromisoformat(day)})
        row = cur.fetchone()
    assert row is not None
    return {"seconds": time.perf_counter() - t0, "orders_seen": row[0], "created": row[1]}


def child_idempotent(dsn: str, day: str) -> dict[str, Any]:
    from airflow_idempotency import run_idempotently
    from invoicing import tasks

    t0 = time.perf_counter()
    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn), job_name=JOB, run_key=day, work=tasks.create_invoices
    )
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "outcome": result.outcome.value,
        "orders_seen": result.counts["orders_seen"],
        "created": result.counts["invoices_created"],
    }


def seed_template(server: PostgresServer, orders: int) -> str:
    from airflow_idempotency.schema import ensure_schema
    from invoicing.seed import seed_orders

    name = server.create_database("bench_inv_tmpl")
    day = dt.date.fromisoformat(DAY)
    t0 = time.monotonic()
    with psycopg.connect(server.dsn(name), autocommit=True) as conn:
        seed_orders(conn, day, day, orders, 42)
        ensure_schema(conn)
        conn.execute("VACUUM (ANALYZE) orders")
    say(f"invoices: seeded {orders:,} orders in {time.monotonic() - t0:.0f} s")
    return name


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("invoices", TITLE)
    n = size.invoice_orders
    template = seed_template(server, n)
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], "idempotent": []}
    try:
        for kind in ("bare", "idempotent", "idempotent", "bare"):
            name = server.create_database("bench_inv", template)
            try:
                checkpoint(server)
                out = run_child(
                    f"bench.invoices:child_{kind}", {"dsn": server.dsn(name), "day": DAY}
                )
            finally:
                server.drop_database(name)
            if out["created"] != n or out["orders_seen"] != n:
                raise RuntimeError(f"{kind}: created {out['created']} of {n} invoices: {out}")
            say(f"invoices: {kind} {out['seconds']:.2f} s, peak RSS {out['peak_rss_mb']:.0f} MB")
            runs[kind].append(out)
    finally:
        server.drop_database(template)

    bare = median([r["seconds"] for r in runs["bare"]])
    idem = median([r["seconds"] for r in runs["idempotent"]])
    ratio = idem / bare
    rss = max(r["peak_rss_mb"] for r in runs["idempotent"])
    result.add(f"bare statement, {n:,} orders", bare, "s", note=_each(runs["bare"]))
    result.add(f"idempotent task, {n:,} orders", idem, "s", note=_each(runs["idempotent"]))
    result.add(
        "ratio idempotent / bare",
        ratio,
        "x",
        f"<= {RATIO_LIMIT:g}",
        at_most(ratio, RATIO_LIMIT),
        "same run, ABBA order, fresh identical DB copies",
    )
    result.add(
        "idempotent task: peak RSS",
        rss,
        "MB",
        f"<= {RSS_LIMIT_MB:g} MB",
        at_most(rss, RSS_LIMIT_MB),
        "ru_maxrss of the worker process",
    )
    result.add("bare statement: peak RSS", max(r["peak_rss_mb"] for r in runs["bare"]), "MB")
    result.add(
        "throughput, idempotent task", n / idem, "invoices/s", note="orders invoiced and marked"
    )
    result.notes.append(
        f"{n:,} orders of one date, seeded once with seed_orders (seed 42) into a template; "
        "each of the four runs works on its own fresh copy after a CHECKPOINT. Times are "
        "measured inside the worker process from just before connecting to just after the "
        "commit (the idempotent side also takes the lock, writes the run records and "
        "checks the example schema). The work is one set-based statement executed by "
        "Postgres, so the client's RSS stays flat whatever N; the time is Postgres "
        "inserting N invoices (three unique indexes) and updating N orders."
    )
    return result


def _each(runs: list[dict[str, Any]]) -> str:
    return "runs: " + ", ".join(f"{r['seconds']:.2f}" for r in runs) + " s"
