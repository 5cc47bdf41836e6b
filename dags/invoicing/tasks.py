"""The work of each invoice-finalization task, as functions of the run context."""

from __future__ import annotations

import csv
import datetime as dt
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg

from airflow_idempotency import (
    Effect,
    OutboundLedger,
    OutputFile,
    Retries,
    RunContext,
    SmtpSender,
    email_effect,
    post_json,
)
from airflow_idempotency.crashpoints import crash_point
from invoicing import ensure_example_schema, one_row, queries

KEY_PREFIX = "finalize_invoices"  # idempotency keys: finalize_invoices:<date>:order_<id>
REMOTE_SYSTEM = "accounting"
EXPORT_PATH = "/api/invoices"
FINANCE_MAIL_CONN = "finance_smtp"  # an smtp connection; its extra from_email sends the mail
FINANCE_TO = "finance@example.com"
EXPORTS_CONN = "invoice_exports"  # a File (path) connection: extra {"path": "/data/exports"}


def business_date(run: RunContext) -> dt.date:
    """The run key of these jobs is the business date, YYYY-MM-DD."""
    return dt.date.fromisoformat(run.run_key)


def region_and_date(run: RunContext) -> tuple[str, dt.date]:
    """The partitioned variant's run keys are ``<region>|<YYYY-MM-DD>`` (eu|2026-10-01)."""
    region, day = run.run_key.split("|")
    return region, dt.date.fromisoformat(day)


def accounting_endpoint(conn_id: str = "accounting_api") -> tuple[str, dict[str, Any]]:
    """Base URL of the accounting service and the export's options in the connection's extra.

    The connection is of type http, e.g. ``AIRFLOW_CONN_ACCOUNTING_API='http://host:8099'``;
    its extra may tune the export: ``{"timeout": 5, "concurrency": 16, "max_attempts": 5}``
    (``max_attempts``, ``backoff_initial`` and ``backoff_max`` make the ledger's
    ``Retries``; ``timeout`` is per request, for ``send_all``).
    """
    from airflow.providers.common.compat.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    scheme = conn.schema or "http"
    port = f":{conn.port}" if conn.port else ""
    extra = conn.extra_dejson or {}
    options = {
        k: extra[k]
        for k in ("timeout", "concurrency", "batch_size", "unreachable_after")
        if k in extra
    }
    retries = {
        k: extra[k] for k in ("max_attempts", "backoff_initial", "backoff_max") if k in extra
    }
    if retries:
        options["retries"] = Retries(**retries)
    return f"{scheme}://{conn.host}{port}", options


def count_execution(cur: psycopg.Cursor[Any], run: RunContext, work: str) -> None:
    """Append this work transaction to work_witness: what the chaos checker counts
    executions by (devtools/invariants.sql). It commits with the work, or not at all."""
    cur.execute(
        queries()["count_execution"],
        {
            "attempt_id": run.attempt_id,
            "job_name": run.job_name,
            "run_key": run.run_key,
            "forced": run.force,
            "work": work,
        },
    )


# [START create_invoices]
def create_invoices(run: RunContext) -> dict[str, int]:
    """Invoice the orders shipped on the business date (natural key, ON CONFLICT DO NOTHING)."""
    ensure_example_schema(run.connection)
    with run.transaction() as cur:
        count_execution(cur, run, "create_invoices")  # the executions witness (schema.sql)
        cur.execute(queries()["create_invoices"], {"business_date": business_date(run)})
        orders_seen, invoices_created, _marked = one_row(cur)
        crash_point("invoices.before_commit")
    crash_point("invoices.after_commit")
    run.log.info("orders shipped: %d, invoices created now: %d", orders_seen, invoices_created)
    return {"orders_seen": orders_seen, "invoices_created": invoices_created}


# [END create_invoices]


def rebuild_daily_totals(run: RunContext) -> dict[str, int]:
    """Rebuild daily_invoice_totals of the date: delete and insert in one transaction."""
    ensure_example_schema(run.connection)
    with run.transaction() as cur:
        count_execution(cur, run, "rebuild_totals")
        params = {"business_date": business_date(run)}
        cur.execute(queries()["delete_totals"], params)
        crash_point("totals.after_delete")
        cur.execute(queries()["insert_totals"], params)
        rows = cur.rowcount
    return {"totals_rows": rows}


# [START export_invoices]
def invoice_request(row: tuple[Any, ...]) -> dict[str, Any]:
    """The accounting service's request for one row of the invoices_to_export query."""
    number, order_id, store_id, customer_id, amount_cents, currency, day = row
    return {
        "invoice_number": number,
        "order_id": order_id,
        "store_id": store_id,
        "customer_id": customer_id,
        "amount_cents": amount_cents,
        "currency": currency,
        "business_date": day.isoformat(),
    }


def invoice_effects(run: RunContext) -> Iterator[Effect]:
    """Stream the date's invoices as export effects (a server-side cursor, never a list)."""
    conn = run.connection
    with conn.transaction(), conn.cursor(name="invoices_to_export") as cur:
        cur.itersize = 2000
        cur.execute(queries()["invoices_to_export"], {"business_date": business_date(run)})
        for row in cur:
            request = invoice_request(row)
            # One key per order and business date: a rerun sends the same key again.
            key = f"{KEY_PREFIX}:{request['business_date']}:order_{request['order_id']}"
            yield Effect(idempotency_key=key, request=request)


def count_invoices(run: RunContext) -> int:
    row = run.connection.execute(
        queries()["count_invoices"], {"business_date": business_date(run)}
    ).fetchone()
    return int(row[0]) if row else 0


def export_invoices(
    run: RunContext, base_url: str, timeout: float = 10.0, **ledger_options: Any
) -> dict[str, int]:
    """Send the date's invoices to the accounting service through the outbound ledger."""
    ledger = OutboundLedger(run, REMOTE_SYSTEM, **ledger_options)
    total = count_invoices(run)
    summary = ledger.send_all(
        invoice_effects(run), post_json(EXPORT_PATH), base_url=base_url, timeout=timeout,
        total=total,
    )  # fmt: skip
    return {"exports_total": total, **summary.as_counts("exports")}


# [END export_invoices]


def remote_invoices(base_url: str, key_prefix: str) -> dict[str, str]:
    """idempotency key -> reference of what the accounting service holds under a prefix."""
    found: dict[str, str] = {}
    after: str | None = None
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while True:
            params: dict[str, Any] = {"key_prefix": key_prefix, "limit": 5000}
            if after:
                params["after"] = after
            page = client.get(EXPORT_PATH, params=params)
            page.raise_for_status()
            body = page.json()
            for item in body["items"]:
                found[item["idempotency_key"]] = item["reference"]
            after = body.get("next_after")
            if not after:
                return found


# [START finance_effects]
def export_root(conn_id: str = EXPORTS_CONN) -> str:
    """The folder of the export files: the ``path`` extra of a File (path) connection."""
    from airflow.providers.common.compat.sdk import BaseHook

    return str(BaseHook.get_connection(conn_id).extra_dejson["path"])


def write_export_file(run: RunContext, root: str | None = None) -> dict[str, Any]:
    """The date's invoices as one CSV file, written through the contract (once per content)."""
    with OutputFile(run, f"invoices/{run.run_key}.csv", root=root or export_root()) as out:
        writer = csv.writer(out.open("w", newline=""))
        writer.writerow(["invoice_number", "order_id", "store_id", "amount_cents", "currency"])
        for effect in invoice_effects(run):
            r = effect.request
            writer.writerow(
                [
                    r["invoice_number"],
                    r["order_id"],
                    r["store_id"],
                    r["amount_cents"],
                    r["currency"],
                ]
            )
    return {"export_file": f"invoices/{run.run_key}.csv", "export_file_outcome": out.outcome}


def finance_summary(run: RunContext) -> Effect:
    """The "invoices finalized" email of the date: one key per date, the same text on reruns."""
    rows = run.connection.execute(
        queries()["daily_totals"], {"business_date": business_date(run)}
    ).fetchall()
    lines = [f"store {store}: {count} invoices, {cents / 100:,.2f}" for store, count, cents in rows]
    count = sum(r[1] for r in rows)
    total = sum(r[2] for r in rows) / 100
    return email_effect(
        f"{KEY_PREFIX}:{run.run_key}:finance_summary",
        to=FINANCE_TO,
        subject=f"Invoices finalized for {run.run_key}: {count} invoices",
        text=f"Business date {run.run_key}: {count} invoices, {total:,.2f} in total.\n\n"
        + "\n".join(lines),
    )


def email_finance_summary(run: RunContext, conn_id: str = FINANCE_MAIL_CONN) -> dict[str, int]:
    """Send the date's summary to finance at most once (SMTP cannot deduplicate)."""
    sender = SmtpSender.from_connection(conn_id)
    summary = OutboundLedger(run, "finance_mail").send_all([finance_summary(run)], sender)
    return summary.as_counts("summary_mail")


# [END finance_effects]


def reconcile_export(
    run: RunContext,
    base_url: str,
    export_job_name: str,
    timeout: float = 10.0,
    **ledger_options: Any,
) -> dict[str, Any]:
    """Compare invoices, the ledger and the accounting service for the date; mend what is safe.

    Safe to mend: an invoice whose ledger row is missing, pending or failed is sent again
    with its SAME idempotency key (the service replays it if it already has it). Never
    mended automatically: a confirmed row the service does not know, or a reference that
    differs; those are reported for a human.
    """
    day = business_date(run)
    prefix = f"{KEY_PREFIX}:{day.isoformat()}:"
    expected = {e.idempotency_key: e for e in invoice_effects(run)}
    ledger = OutboundLedger(run, REMOTE_SYSTEM, **ledger_options)
    ledger_rows = {
        row["idempotency_key"]: (row["status"], row["remote_reference"])
        for row in ledger.rows(job_name=export_job_name)
    }
    remote = remote_invoices(base_url, prefix)
    not_confirmed = [k for k in expected if ledger_rows.get(k, (None,))[0] != "succeeded"]
    confirmed_missing_remotely = [
        k for k, (status, _) in ledger_rows.items() if status == "succeeded" and k not in remote
    ]
    reference_mismatch = [
        k
        for k, (status, ref) in ledger_rows.items()
        if status == "succeeded" and k in remote and remote[k] != ref
    ]
    unexpected_remote = [k for k in remote if k not in expected]
    report: dict[str, Any] = {
        "reconcile_invoices": len(expected),
        "reconcile_ledger_rows": len(ledger_rows),
        "reconcile_remote_invoices": len(remote),
        "reconcile_not_confirmed": len(not_confirmed),
        "reconcile_confirmed_missing_remotely": len(confirmed_missing_remotely),
        "reconcile_reference_mismatch": len(reference_mismatch),
        "reconcile_unexpected_remote": len(unexpected_remote),
        "reconcile_samples": {
            "not_confirmed": not_confirmed[:5],
            "confirmed_missing_remotely": confirmed_missing_remotely[:5],
            "reference_mismatch": reference_mismatch[:5],
            "unexpected_remote": unexpected_remote[:5],
        },
    }
    run.log.info("reconcile %s: %s", day, report)
    mended = 0
    if not_confirmed:
        # The same keys as the export: the service replays what it already has.
        summary = ledger.send_all(
            (expected[k] for k in not_confirmed),
            post_json(EXPORT_PATH),
            base_url=base_url,
            timeout=timeout,
            total=len(not_confirmed),
            raise_on_failure=False,
        )
        mended = summary.sent
        report["reconcile_mend_failed"] = summary.failed + summary.pending
    report["reconcile_mended"] = mended
    return report


def reconcile_stores(run: RunContext) -> dict[str, int]:
    """Per-store reconciliation (unique per date and store) and ONE summary row per date."""
    ensure_example_schema(run.connection)
    with run.transaction() as cur:
        count_execution(cur, run, "reconcile_stores")
        params = {"business_date": business_date(run)}
        cur.execute(queries()["upsert_store_reconciliation"], params)
        stores = cur.rowcount
        cur.execute(queries()["upsert_reconciliation_summary"], params)
        _stores, mismatched, runs = one_row(cur)
    return {"stores": stores, "mismatched_stores": mismatched, "summary_writes": runs}


# [START region_tasks]
def create_region_invoices(run: RunContext) -> dict[str, int]:
    """Invoice one region's orders of the business date (run key eu|2026-10-01)."""
    region, day = region_and_date(run)
    ensure_example_schema(run.connection)
    with run.transaction() as cur:
        cur.execute(queries()["create_region_invoices"], {"business_date": day, "region": region})
        orders_seen, invoices_created, _marked = one_row(cur)
    run.log.info(
        "%s %s: orders %d, invoices created now %d", region, day, orders_seen, invoices_created
    )
    return {"orders_seen": orders_seen, "invoices_created": invoices_created}


def reconcile_region(run: RunContext) -> dict[str, int]:
    """One reconciliation row per region and date; ``runs`` counts the ones that worked."""
    region, day = region_and_date(run)
    ensure_example_schema(run.connection)
    with run.transaction() as cur:
        cur.execute(
            queries()["upsert_region_reconciliation"], {"business_date": day, "region": region}
        )
        orders, invoiced, difference, runs = one_row(cur)
    return {"orders": orders, "invoiced": invoiced, "difference_cents": difference, "runs": runs}


# [END region_tasks]
