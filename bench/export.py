"""Export of one date's invoices to the accounting service through the outbound ledger.

Set-up: one database with N orders of one date, invoiced by the bare statement; the
accounting service (``devtools.accounting``, a real uvicorn process on the same Postgres)
with ``latency_ms=5`` added to every POST.

Measured, each in a fresh worker process that reports its own time and peak RSS:

1. ``bare loop (before)``: C asyncio workers, one httpx.AsyncClient each, POSTing the same
   JSON payloads the export sends (built from the same invoices) under fresh keys;
2. ``ledger export``: ``run_idempotently(work=...)`` of ``invoicing.tasks.export_invoices``
   with ``concurrency=C``: it streams the invoices, claims each batch in the ledger, calls,
   records the outcomes, completes the run;
3. ``bare loop (after)``: as 1, new fresh keys; the ratio's baseline is 1 and 3 together,
   which brackets the export in time so that drift in load weighs on both sides;
4. ``bare loop, one shared AsyncClient`` (max_connections=C): the pattern the ledger used
   before this benchmark, for the record;
5. the rerun of the completed run key (a no-op decided before any export code runs);
6. a ``force=True`` rerun: the export runs again and the ledger skips every confirmed key
   without a single request (checked against the service's request counter).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from typing import Any

import httpx
import psycopg

from bench.common import (
    BenchResult,
    Size,
    at_least,
    at_most,
    database,
    run_child,
    say,
)
from devtools.postgres import PostgresServer

TITLE = "Export to the accounting service (latency_ms=5)"
DAY = "2026-10-01"
JOB = "finalize_invoices.export_invoices"
LATENCY_MS = 5
RSS_LIMIT_MB = 300.0
THROUGHPUT_SHARE = 0.80
RERUN_LIMIT_S = 2.0


def _payloads(dsn: str, limit: int, tag: str) -> list[tuple[str, dict[str, Any]]]:
    """The export's own requests (invoicing.tasks.invoice_request), under fresh keys."""
    from invoicing import queries
    from invoicing.tasks import invoice_request

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            queries()["invoices_to_export"], {"business_date": dt.date.fromisoformat(DAY)}
        ).fetchmany(limit)
    requests = [invoice_request(row) for row in rows]
    return [(f"bench-{tag}:{r['business_date']}:order_{r['order_id']}", r) for r in requests]


def child_bare_loop(
    dsn: str, url: str, requests: int, concurrency: int, shared: bool
) -> dict[str, Any]:
    from invoicing.tasks import EXPORT_PATH

    payloads = _payloads(dsn, requests, uuid.uuid4().hex[:8])

    async def main() -> tuple[float, int]:
        work = iter(payloads)
        failures = 0
        if shared:
            limits = httpx.Limits(
                max_connections=concurrency, max_keepalive_connections=concurrency
            )
            one = httpx.AsyncClient(base_url=url, timeout=10, limits=limits)
            clients = [one] * concurrency
        else:
            clients = [httpx.AsyncClient(base_url=url, timeout=10) for _ in range(concurrency)]

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal failures
            for key, body in work:
                response = await client.post(
                    EXPORT_PATH, json=body, headers={"Idempotency-Key": key}
                )
                failures += response.status_code != 201

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        seconds = time.perf_counter() - t0
        for client in set(clients):
            await client.aclose()
        return seconds, failures

    cpu0 = time.process_time()
    seconds, failures = asyncio.run(main())
    cpu = time.process_time() - cpu0
    return {"seconds": seconds, "requests": len(payloads), "failures": failures, "loop_cpu": cpu}


def child_export(
    dsn: str, url: str, concurrency: int, force: bool, batch_size: int | None = None
) -> dict[str, Any]:
    from airflow_idempotency import run_idempotently
    from airflow_idempotency.runner import RunOptions
    from invoicing import tasks

    def work(run: Any) -> dict[str, int]:
        options = {"batch_size": batch_size} if batch_size else {}
        return tasks.export_invoices(run, url, concurrency=concurrency, **options)

    t0 = time.perf_counter()
    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=DAY,
        work=work,
        options=RunOptions(force=force),
    )
    return {
        "seconds": time.perf_counter() - t0,
        "outcome": result.outcome.value,
        "counts": result.counts,
    }


def _prepare(dsn: str, n: int) -> None:
    from airflow_idempotency.schema import ensure_schema
    from invoicing import queries
    from invoicing.seed import seed_orders

    day = dt.date.fromisoformat(DAY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_orders(conn, day, day, n, 42)
        with conn.transaction():
            created = conn.execute(queries()["create_invoices"], {"business_date": day}).fetchone()
        ensure_schema(conn)
        conn.execute("VACUUM (ANALYZE)")
    assert created is not None and created[1] == n, created


def run(size: Size, server: PostgresServer) -> BenchResult:
    from devtools.accounting import run_accounting_service

    result = BenchResult("export", TITLE)
    n, c = size.export_invoices, size.export_concurrency
    with database(server, "bench_export") as dsn:
        _prepare(dsn, n)
        with run_accounting_service(dsn, latency_ms=LATENCY_MS) as service:
            url = service.url

            def bare(requests: int, shared: bool = False) -> dict[str, Any]:
                args = {"dsn": dsn, "url": url, "requests": requests, "concurrency": c}
                out = run_child("bench.export:child_bare_loop", {**args, "shared": shared})
                if out["failures"]:
                    raise RuntimeError(f"bare loop: {out['failures']} requests failed")
                kind = "shared client" if shared else "bare"
                rate = out["requests"] / out["seconds"]
                say(f"export: {kind} loop {out['requests']:,} requests, {rate:,.0f}/s")
                return out

            def export(force: bool) -> dict[str, Any]:
                out = run_child(
                    "bench.export:child_export",
                    {"dsn": dsn, "url": url, "concurrency": c, "force": force},
                )
                say(f"export: ledger (force={force}) {out['seconds']:.2f} s, {out['outcome']}")
                return out

            before = bare(size.export_bare_requests)
            first = export(force=False)
            after = bare(size.export_bare_requests)
            shared = bare(size.export_shared_requests, shared=True)
            requests_before_reruns = service.stats()["requests"]
            noop = export(force=False)
            forced = export(force=True)
            time.sleep(0.3)  # the service flushes its counters every 0.1 s
            requests_after_reruns = service.stats()["requests"]

    counts = first["counts"]
    if first["outcome"] != "completed" or counts.get("exports_sent") != n:
        raise RuntimeError(f"the export did not send {n} invoices: {first}")
    if noop["outcome"] != "noop":
        raise RuntimeError(f"the rerun of the completed key was not a no-op: {noop}")
    if forced["counts"].get("exports_skipped_existing") != n or forced["counts"].get(
        "exports_sent"
    ):
        raise RuntimeError(f"the forced rerun did not skip all {n} confirmed keys: {forced}")
    extra_requests = requests_after_reruns - requests_before_reruns

    ledger_rate = n / first["seconds"]
    bare_rate = (before["requests"] + after["requests"]) / (before["seconds"] + after["seconds"])
    share = ledger_rate / bare_rate
    result.add(
        f"bare loop, {c} clients (before | after)",
        bare_rate,
        "req/s",
        note=f"{before['requests'] / before['seconds']:,.0f} | "
        f"{after['requests'] / after['seconds']:,.0f} req/s",
    )
    result.add(
        f"ledger export of {n:,} invoices, concurrency {c}",
        ledger_rate,
        "req/s",
        note=f"{first['seconds']:.1f} s for the whole task",
    )
    result.add(
        "ratio ledger / bare loop",
        share,
        "x",
        f">= {THROUGHPUT_SHARE:g}",
        at_least(share, THROUGHPUT_SHARE),
        "bare loop runs just before and just after",
    )
    ledger_cpu = 1e6 * first["cpu_seconds"] / n
    bare_cpu = (
        1e6 * (before["loop_cpu"] + after["loop_cpu"]) / (before["requests"] + after["requests"])
    )
    result.add(
        "client CPU per request, ledger | bare",
        ledger_cpu,
        "µs",
        note=f"bare loop {bare_cpu:,.0f} µs; ratio bare/ledger {bare_cpu / ledger_cpu:.2f} "
        "(less sensitive to other load than the rates)",
    )
    result.add(
        f"bare loop, ONE shared AsyncClient (max_connections={c})",
        shared["requests"] / shared["seconds"],
        "req/s",
        note="reference: the single-client pattern",
    )
    result.add(
        "rerun of the completed key (no-op)",
        noop["seconds"],
        "s",
        f"<= {RERUN_LIMIT_S:g} s",
        at_most(noop["seconds"], RERUN_LIMIT_S),
        "decided before any export code runs",
    )
    result.add(
        f"force=True rerun: {n:,} confirmed keys skipped",
        forced["seconds"],
        "s",
        f"<= {RERUN_LIMIT_S:g} s",
        at_most(forced["seconds"], RERUN_LIMIT_S),
        f"{extra_requests} requests reached the service",
    )
    rss = max(first["peak_rss_mb"], forced["peak_rss_mb"])
    result.add(
        "ledger export: peak RSS",
        rss,
        "MB",
        f"<= {RSS_LIMIT_MB:g} MB",
        at_most(rss, RSS_LIMIT_MB),
        f"export {first['peak_rss_mb']:.0f} MB, forced rerun {forced['peak_rss_mb']:.0f} MB",
    )
    result.add("bare loop: peak RSS", max(before["peak_rss_mb"], after["peak_rss_mb"]), "MB")
    if extra_requests:
        raise RuntimeError(f"the reruns sent {extra_requests} requests to the service")
    result.notes.append(
        f"{n:,} invoices of one date, accounting service with one uvicorn worker and "
        f"latency_ms={LATENCY_MS} on the same Postgres, client concurrency {c} on both "
        f"sides. The bare loops send {before['requests']:,} requests each (fresh keys, the "
        "export's own payloads, one AsyncClient per concurrent worker: the fastest bare "
        "client found); the ledger figure is the whole task (count, stream, claim, send, "
        "record, complete) divided into N. Every process shares the machine's cores with "
        "the service and Postgres, and at this latency the client is CPU-bound on both "
        "sides (~0.7-0.9 ms of CPU per request, nearly all of it inside httpx/httpcore), so "
        "the rates follow whatever else the machine runs during each loop; the CPU per "
        "request (the whole task for the ledger, the loop alone for the bare client) is the "
        "steadier comparison."
    )
    result.notes.append(
        "**The single shared AsyncClient was the bottleneck, and ledger.py was changed.** "
        "httpcore 1.0's connection pool checks every connection it holds (polling each idle "
        "socket for readability) whenever a request is assigned or released, so one "
        "AsyncClient with 32 connections spends most of its CPU in "
        "`_assign_requests_to_connections` / `has_expired` (py-spy: ~47 % of samples in the "
        "pool, ~33 % in `has_expired`). The ledger now lends each concurrent call one of up "
        "to `concurrency` clients of one connection each (created on first need, sharing one "
        "SSL context: a client's own context costs 10-120 ms to build), and makes the first "
        "try of a call without tenacity's machinery (a transient error hands over to the "
        "same AsyncRetrying loop, whose attempt 1 re-raises it, so counts and waits are "
        "unchanged). Same service, 20,000 invoices, concurrency 32, measured alternately: "
        "before 205-319 req/s at 2.4-2.6 ms CPU per request; pool only 544-605 req/s "
        "(~0.95 ms); pool + direct first try 593-762 req/s (0.75-0.86 ms), against "
        "626-841 req/s (0.77-0.84 ms) for the bare loop. The `ONE shared AsyncClient` row "
        "above keeps the old pattern measured in every run."
    )
    result.notes.append(
        "**What limits the forced rerun (skipping confirmed keys).** Each batch of 500 is one "
        "fenced claim statement that returns only the keys needing something (new, pending, "
        "failed, or stored with another fingerprint), so a batch of confirmed keys comes back "
        "empty; every key's fingerprint is still compared, in the statement. What was "
        "measured and changed in ledger.py and the ledger queries (pyinstrument on a "
        "100,000-key forced rerun before: _claim 12.0 s of 13.4 s profiled, of which "
        "check_text 3.6, the two fingerprint computations 1.9 + 1.8, the statement 3.5, the "
        "transaction 0.6): (1) the key check has an ASCII fast path (`isascii()`, "
        "`isprintable()`, length, no surrounding blanks: exactly what check_text plus the "
        "ASCII rule accept, fuzzed against it in tests/integration/test_ledger.py), ~0.3 µs instead of "
        "5-25 µs a key; (2) each fingerprint is computed once, with one reused JSON encoder "
        "(same bytes as json.dumps); (3) the key and fingerprint arrays are bound in binary "
        "(~0.5 instead of ~5 µs a key); (4) known keys no longer go through the INSERT: the "
        "speculative insert of a confirmed key drew a ledger_id from the sequence, whose WAL "
        "record gave every claim a transaction id and made its commit a disk flush (a rerun's "
        "claims now write no WAL); (5) each key is looked up on its own (LATERAL ... LIMIT 1): "
        "with statistics taken while the ledger was empty (this server runs without "
        "autovacuum) the plain join was planned as a hash join over every ledger row, "
        "80-150 ms a batch at 100,000 rows until the prepared statement's generic plan took "
        "over; (6) the claim is sent in pipeline mode and the next batch is pulled and "
        "prepared while the server runs it; the fencing check follows the statement, just "
        "before the commit. Fresh processes on a database in the state this benchmark leaves "
        "(after a first export, stale statistics), old and new code alternately: 5.6-7.1 s "
        "before, 1.5-2.0 s after, on a machine with other load. What remains is client CPU "
        "(~1.1-1.4 s for 100,000 keys): pulling the invoices from the example's server-side "
        "cursor and building the Effects (~40 %) and the canonical JSON + SHA-256 "
        "fingerprint of each request (~40 %, 4-5 µs each, needed to detect a changed request "
        "for every key); the claim statements (~2 ms a batch on the server) overlap with them."
    )
    return result
