"""``airflow-idempotency``: the on-call operator's view of runs, locks and the ledger.

Exit codes (the runbook's): 0 success, or an already completed key (a no-op);
1 failure, or something to look at (``gaps`` found periods without a completed run,
``runs --stale`` found abandoned work); 2 bad input (a malformed date, an unknown job or
DAG, a range that ends before it starts, a run key that would be refused), nothing
written; 75 the run key is locked elsewhere.

Read-only commands (``runs``, ``show``, ``locks``, ``ledger``) never write: they refuse a
database whose bookkeeping schema is missing or older than this version instead of
creating or migrating it; ``migrate`` does that on purpose.

The database comes from ``--dsn`` (or ``AIRFLOW_IDEMPOTENCY_DSN``), else from the Airflow
connection ``--conn-id`` (default ``idempotency_default``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from airflow_idempotency import records
from airflow_idempotency._sql import query
from airflow_idempotency.exceptions import InvalidInputError, RunLockedError, SchemaNotReadyError
from airflow_idempotency.locks import ON_LOCKED_ENV, hold_run_lock, run_lock_key
from airflow_idempotency.records import Trigger
from airflow_idempotency.schema import (
    DEFAULT_SCHEMA,
    current_version,
    ensure_schema,
    require_readable,
    validate_schema_name,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 75
DSN_ENV = "AIRFLOW_IDEMPOTENCY_DSN"


def business_date(value: str) -> str:
    """argparse type: a real calendar date written YYYY-MM-DD."""
    try:
        if len(value) == 10:
            return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r} is not a date in the format YYYY-MM-DD")


def _dsn(args: argparse.Namespace) -> str:
    if args.dsn or os.environ.get(DSN_ENV):
        return str(args.dsn or os.environ[DSN_ENV])
    from airflow_idempotency.compat import logs_to_stderr
    from airflow_idempotency.hook import IdempotencyHook

    logs_to_stderr()  # Airflow 2 logs to stdout, where --json output goes
    try:
        hook = IdempotencyHook(postgres_conn_id=args.conn_id)
        conn = hook.new_connection()
    except Exception as exc:
        raise SystemExit(
            f"error: cannot open Airflow connection {args.conn_id!r} ({exc}). "
            f"Pass --dsn or set {DSN_ENV}."
        ) from exc
    with conn:
        return str(conn.info.dsn) + (
            f" password={conn.info.password}" if conn.info.password else ""
        )


class CommandError(Exception):
    """A command cannot go on: its message is printed, the process exits with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _open(args: argparse.Namespace) -> psycopg.Connection:
    """A connection to the job database (no server-side prepared statements: see locks.py)."""
    return psycopg.connect(_dsn(args), autocommit=True, prepare_threshold=None)


def _connect_read(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for reading the bookkeeping tables, which must exist: no DDL, ever."""
    conn = _open(args)
    try:
        require_readable(conn, args.schema)
    except SchemaNotReadyError as exc:
        conn.close()
        if exc.version == 0:
            raise CommandError(
                f"database {conn.info.dbname!r} has no bookkeeping tables in schema "
                f"{args.schema!r}: no idempotent task has run against it yet, or --dsn / "
                "--conn-id / --schema point elsewhere."
            ) from exc
        raise CommandError(
            f"schema {args.schema!r} is at version {exc.version}, older than this CLI "
            f"(version {exc.expected}): run `airflow-idempotency migrate`, or let a task "
            "of this version run first."
        ) from exc
    return conn


def _connect_write(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for commands that write: creates or migrates the schema when needed."""
    conn = _open(args)
    ensure_schema(conn, args.schema)
    return conn


def fetch(
    conn: psycopg.Connection, schema: str, name: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Rows of the named query as dicts."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query(name, schema), params).fetchall()


# -- output -----------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """JSON for what json cannot encode: ISO 8601 for dates and times, text otherwise."""
    if isinstance(value, dt.date | dt.datetime | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    if isinstance(value, dict | list):
        return json.dumps(value, default=_json_value)
    return "" if value is None else value


def emit(
    args: argparse.Namespace, title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]
) -> None:
    """Print rows as a table, or as JSON with --json."""
    if args.json:
        print(
            json.dumps(
                [{c: r.get(c) for c in columns} for r in rows], default=_json_value, indent=2
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(_plain(row.get(c))) for c in columns))
    Console(width=max(120, os.get_terminal_size().columns if sys.stdout.isatty() else 160)).print(
        table if rows else f"{title}: none"
    )


# -- commands -----------------------------------------------------------------------------


def cmd_runs(args: argparse.Namespace) -> int:
    if args.stale:
        return cmd_stale(args)
    with _connect_read(args) as conn:
        rows = fetch(
            conn,
            args.schema,
            "cli_list_runs",
            {
                "job": args.job,
                "status": args.status,
                "from_key": args.from_key,
                "to_key": args.to_key,
                "limit": args.limit,
            },
        )
    emit(
        args,
        "job_runs",
        rows,
        [
            "job_name",
            "run_key",
            "status",
            "triggered_by",
            "attempt_count",
            "started_at",
            "completed_at",
            "details",
        ],
    )
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with _connect_read(args) as conn:
        run = records.get_run(conn, args.schema, args.job, args.run_key)
        attempts = fetch(
            conn, args.schema, "cli_attempts", {"job": args.job, "run_key": args.run_key}
        )
    if run is None and not attempts:
        print(f"no run recorded for job {args.job!r} run_key {args.run_key!r}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(
            json.dumps(
                {"run": run.__dict__ if run else None, "attempts": attempts},
                default=_json_value,
                indent=2,
            )
        )
        return EXIT_OK
    if run:
        emit(
            args,
            f"{args.job} {args.run_key}",
            [run.__dict__],
            [
                "status",
                "triggered_by",
                "triggering_user",
                "dag_id",
                "run_id",
                "attempt_count",
                "started_at",
                "completed_at",
                "details",
            ],
        )
    emit(
        args,
        "attempts",
        attempts,
        [
            "attempt_id",
            "outcome",
            "triggered_by",
            "dag_id",
            "task_id",
            "try_number",
            "hostname",
            "pid",
            "started_at",
            "finished_at",
            "error",
        ],
    )
    return EXIT_OK


def cmd_locks(args: argparse.Namespace) -> int:
    with _connect_read(args) as conn:
        rows = fetch(conn, args.schema, "cli_locks")
    emit(
        args,
        "held run locks",
        rows,
        [
            "job_name",
            "run_key",
            "status",
            "backend_pid",
            "client",
            "worker_host",
            "worker_pid",
            "attempt_started_at",
            "dag_id",
        ],
    )
    return EXIT_OK


def cmd_ledger(args: argparse.Namespace) -> int:
    """Effects of every kind not confirmed, the unknown ones first; exit 1 when any is unknown.

    With ``--remote`` and ``--key``: that one effect and the audit of its resolutions.
    """
    if getattr(args, "ledger_action", None):
        return cmd_ledger_resolve(args)
    if args.key:
        return _ledger_effect(args)
    params = {"job": args.job, "run_key": args.run_key, "all": args.all, "limit": args.limit}
    with _connect_read(args) as conn:
        summary = fetch(conn, args.schema, "cli_ledger_summary", params)
        problems = fetch(conn, args.schema, "cli_ledger_problems", params)
    unknown = sum(int(r["effects"]) for r in summary if r["status"] == "unknown")
    if args.json:
        print(
            json.dumps(
                {"summary": summary, "not_confirmed": problems}, default=_json_value, indent=2
            )
        )
        return EXIT_FAILED if unknown else EXIT_OK
    emit(
        args,
        "outbound ledger",
        summary,
        ["job_name", "run_key", "remote_system", "effect_kind", "status", "effects", "last_update"],
    )
    if problems:
        emit(
            args,
            "unknown, pending and failed effects",
            problems,
            ["run_key", "remote_system", "effect_kind", "idempotency_key", "status", "call_count",
             "last_error", "updated_at", "last_resolution", "resolved_by"],
        )  # fmt: skip
    if unknown:
        print(
            f"{unknown} effect(s) unknown: they may have happened and are never sent again on "
            "their own. Look at the remote, then `airflow-idempotency ledger mark-sent REMOTE "
            "KEY --reason ...` or `ledger resend REMOTE KEY --reason ...`.",
            file=sys.stderr,
        )
    return EXIT_FAILED if unknown else EXIT_OK


def _ledger_effect(args: argparse.Namespace) -> int:
    """One effect (``--remote`` and ``--key``) and who resolved it, when, why."""
    from airflow_idempotency.resolutions import resolutions

    if not args.remote:
        raise CommandError("--key needs --remote (the effect's remote system)", EXIT_USAGE)
    with _connect_read(args) as conn:
        rows = fetch(
            conn, args.schema, "ledger_effect", {"remote_system": args.remote, "key": args.key}
        )
        audit = resolutions(conn, args.schema, args.remote, args.key) if rows else []
    if not rows:
        raise CommandError(f"no effect {args.key!r} of remote system {args.remote!r}", EXIT_USAGE)
    if args.json:
        print(json.dumps({"effect": rows[0], "resolutions": audit}, default=_json_value, indent=2))
        return EXIT_OK
    columns = ["job_name", "run_key", "effect_kind", "deduplicating", "status", "intent_at"]
    emit(args, f"{args.remote} {args.key}", rows, [*columns, "last_error"])
    audit_columns = ["action", "previous_status", "resolved_by", "reason", "resolved_at"]
    emit(args, "resolutions", audit, audit_columns)
    return EXIT_OK


def cmd_ledger_resolve(args: argparse.Namespace) -> int:
    """``ledger mark-sent`` / ``ledger resend``: an operator's audited choice for an unknown
    effect."""
    from airflow_idempotency.resolutions import resolve_unknown

    action = "mark_sent" if args.ledger_action == "mark-sent" else "resend"
    who = args.by or os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    with _connect_read(args) as conn:
        try:
            done = resolve_unknown(
                conn,
                args.schema,
                remote_system=args.remote_system,
                idempotency_key=args.idempotency_key,
                action=action,  # type: ignore[arg-type]
                resolved_by=who,
                reason=args.reason,
            )
        except RunLockedError as exc:
            raise CommandError(f"{exc} Nothing resolved.", EXIT_LOCKED) from exc
    then = "it is never sent again" if action == "mark_sent" else "the next run of its key sends it"
    if args.json:
        print(json.dumps(done.__dict__, default=_json_value, indent=2))
    else:
        print(
            f"{done.remote_system} {done.idempotency_key} (job {done.job_name}, run key "
            f"{done.run_key}): unknown -> {done.new_status} by {done.resolved_by} at "
            f"{done.resolved_at.isoformat(timespec='seconds')}; {then}"
        )
    return EXIT_OK


def cmd_reset(args: argparse.Namespace) -> int:
    """Mark a failed or stuck run failed with a reason, so the next run takes it over cleanly."""
    lock_key = run_lock_key(args.job, args.run_key)
    with (
        _connect_write(args) as conn,
        hold_run_lock(
            conn, lock_key, schema=args.schema, application_name="airflow-idempotency reset"
        ) as lock,
    ):
        if lock is None:
            raise CommandError(
                f"run key {args.run_key!r} of {args.job!r} is locked: a worker is running it now "
                "(see `airflow-idempotency locks`). Not resetting.",
                EXIT_LOCKED,
            )
        run = records.get_run(conn, args.schema, args.job, args.run_key)
        if run is None or run.status not in ("failed", "started"):
            status = run.status if run else "never run"
            raise CommandError(
                f"nothing reset: job {args.job!r} run_key {args.run_key!r} is {status}, not "
                "failed or started (a completed run is recomputed with force=true instead)."
            )
        # In the lock transaction: the reset attempt and the reset itself commit together.
        trigger = Trigger(triggered_by="cli", triggering_user=os.environ.get("USER"))
        attempt_id = records.insert_attempt(
            conn,
            args.schema,
            job_name=args.job,
            run_key=args.run_key,
            lock_key=lock_key,
            outcome="reset",
            trigger=trigger,
            lock=lock,
            error=args.reason,
        )
        fetch(
            conn,
            args.schema,
            "reset_run",
            {
                "job": args.job,
                "run_key": args.run_key,
                "reason": args.reason,
                "attempt_id": attempt_id,
            },
        )
    print(f"reset {args.job} {args.run_key} to failed (reason recorded, attempt {attempt_id})")
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    """Create or migrate the bookkeeping schema (what the first task of a version does)."""
    with _open(args) as conn:
        before = current_version(conn, args.schema)
        after = ensure_schema(conn, args.schema)
    print(f"schema {args.schema!r}: version {before} -> {after}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """Run one business date of a DAG through Airflow (`airflow dags test`) and classify it."""
    conf: dict[str, Any] = {"run_key": args.date, "force": args.force, "dry_run": args.dry_run}
    if args.force_reconcile:
        conf["force_reconcile"] = True
    refused = [e for e in _explain(args, "manual", None, conf) if e.run_key is None]
    if refused:  # e.g. a period that has not ended: nothing runs, nothing is written
        reasons = "; ".join(f"{e.task_id}: {e.explanation}" for e in refused)
        raise CommandError(f"{args.dag_id} {args.date} refused, nothing ran: {reasons}", EXIT_USAGE)
    with _open(args) as conn:
        since = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    env = {**os.environ, ON_LOCKED_ENV: "fail"}
    with tempfile.NamedTemporaryFile(
        "w+", prefix=f"{args.dag_id}-{args.date}-", suffix=".log", delete=False
    ) as log:
        command = [
            sys.executable,
            "-m",
            "airflow",
            "dags",
            "test",
            args.dag_id,
            "-c",
            json.dumps(conf),
        ]
        code = subprocess.run(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        ).returncode
    with _open(args) as conn:
        attempts = (
            fetch(
                conn,
                args.schema,
                "cli_attempts_since",
                {"run_key": args.date, "dag_id": args.dag_id, "since": since},
            )
            if current_version(conn, args.schema)
            else []
        )
    outcomes = {a["outcome"] for a in attempts}
    if "lock_held" in outcomes:
        verdict, exit_code = "locked elsewhere", EXIT_LOCKED
    elif code != 0 or not attempts or outcomes & {"failed", "lock_lost"}:
        verdict, exit_code = "failed", EXIT_FAILED
    elif outcomes == {"noop"}:
        verdict, exit_code = "no-op: already completed", EXIT_OK
    else:
        verdict, exit_code = "dry run" if args.dry_run else "completed", EXIT_OK
    kept = exit_code != EXIT_OK or args.keep_log
    if not kept:
        os.unlink(log.name)  # nothing to look at: the attempts say it all
    holders = [a["error"] for a in attempts if a["outcome"] == "lock_held" and a["error"]]
    if args.json:
        print(
            json.dumps(
                {
                    "dag_id": args.dag_id,
                    "run_key": args.date,
                    "verdict": verdict,
                    "exit_code": exit_code,
                    "attempts": attempts,
                    "log": log.name if kept else None,
                },
                default=_json_value,
                indent=2,
            )
        )
    else:
        print(f"{args.dag_id} {args.date}: {verdict}")
        for holder in holders[-1:]:
            print(holder)
        emit(args, "attempts of this run", attempts, ["job_name", "outcome", "error"])
        if kept:
            print(f"log: {log.name}")
        if exit_code == EXIT_FAILED and not attempts:
            with open(log.name, encoding="utf-8", errors="replace") as f:
                print("".join(f.readlines()[-30:]), file=sys.stderr)
    return exit_code


def cmd_gaps(args: argparse.Namespace) -> int:
    """The periods of a job in a range with no completed run; exit 1 when there are any."""
    from airflow_idempotency import status

    with _connect_read(args) as conn:
        found = status.gaps(conn, args.schema, args.job, args.from_key, args.to_key)
    rows = [gap.as_dict() for gap in found]
    emit(
        args,
        f"{args.job}: periods without a completed run, {args.from_key} .. {args.to_key}",
        rows,
        ["run_key", "state", "attempts", "updated_at", "last_error"],
    )
    return EXIT_FAILED if found else EXIT_OK


def cmd_stale(args: argparse.Namespace) -> int:
    from airflow_idempotency import status

    with _connect_read(args) as conn:
        rows = status.stale(conn, args.schema, args.job)
    for row in rows:
        row["age"] = _age(row["age"])
    emit(
        args,
        "stale: running or started, nobody holds the lock",
        rows,
        ["job_name", "run_key", "status", "attempt_id", "hostname", "pid", "started_at", "age"],
    )
    return EXIT_FAILED if rows else EXIT_OK


def _age(value: dt.timedelta) -> str:
    seconds = int(value.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}d {hours}h {rest // 60}m ago" if days else f"{hours}h {rest // 60}m ago"


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete old attempt rows of completed keys (never a job_runs row, never the ledger)."""
    from airflow_idempotency import status

    older_than = status.parse_age(args.older_than)
    with _connect_read(args) as conn:
        count = status.prune_attempts(
            conn, args.schema, older_than, dry_run=args.dry_run, batch_size=args.batch_size
        )
    verb = "would delete" if args.dry_run else "deleted"
    summary = {"dry_run": args.dry_run, "older_than_days": older_than.days, "attempts": count}
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{verb} {count} attempt row(s) older than {older_than.days} days, of completed keys "
            "(job_runs rows, the attempt that completed each key and the ledger are kept)"
        )
    return EXIT_OK


@contextlib.contextmanager
def _airflow_quiet() -> Iterator[None]:
    """Whatever Airflow logs while it parses DAGs goes to stderr: stdout is our output."""
    from airflow_idempotency import compat

    compat.logs_to_stderr()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _load_dag(args: argparse.Namespace) -> Any:
    from airflow_idempotency import compat

    try:
        with _airflow_quiet():
            return compat.load_dag(args.dag_id, args.dags_folder)
    except LookupError as exc:
        raise CommandError(str(exc).strip("'\""), EXIT_USAGE) from exc


def _explain(
    args: argparse.Namespace, kind: str, logical_date: dt.datetime | None, conf: dict[str, Any]
) -> list[Any]:
    from airflow_idempotency import planning

    dag = _load_dag(args)
    with _airflow_quiet():
        return planning.explain(dag, kind=kind, logical_date=logical_date, conf=conf)


def _instant(value: str) -> dt.datetime:
    """argparse type: an ISO date or date-time; a bare date is midnight, a naive time UTC."""
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a date or date-time, e.g. 2026-10-02 or 2026-10-02T01:00:00+00:00"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def cmd_explain(args: argparse.Namespace) -> int:
    """The run key each idempotent task of a run would get, and why; exit 2 when refused."""
    try:
        conf = json.loads(args.conf or "{}")
    except json.JSONDecodeError as exc:
        raise CommandError(f"--conf is not JSON: {exc}", EXIT_USAGE) from exc
    if not isinstance(conf, dict):
        raise CommandError(
            '--conf must be a JSON object, e.g. \'{"run_key": "2026-10-01"}\'', EXIT_USAGE
        )
    explained = _explain(args, args.run_type, args.logical_date, conf)
    emit(
        args,
        f"{args.dag_id}: {args.run_type} run at {args.logical_date or 'no logical date'}",
        [e.as_dict() for e in explained],
        ["task_id", "job_name", "run_key", "explanation"],
    )
    return EXIT_USAGE if any(e.run_key is None for e in explained) else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Which business dates a backfill would cover on this Airflow line, and what each does."""
    from airflow_idempotency import compat, planning

    if args.command_name != compat.BACKFILL_COMMAND:
        line = "Airflow 3" if compat.AIRFLOW_V_3_0_PLUS else "Airflow 2"
        raise CommandError(
            f"this is {line}, whose backfill command is {compat.BACKFILL_COMMAND}; "
            f"{args.command_name} belongs to the other line: run plan where that Airflow runs",
            EXIT_USAGE,
        )
    if args.to_date < args.from_date:
        raise CommandError(f"--from {args.from_date} is after --to {args.to_date}", EXIT_USAGE)
    dag = _load_dag(args)
    with _open(args) as conn:
        recorded = conn if current_version(conn, args.schema) else None  # else: all new
        with _airflow_quiet():
            rows = planning.plan(dag, recorded, args.schema, args.from_date, args.to_date)
    emit(
        args,
        f"{args.dag_id}: {args.command_name} {args.from_date.isoformat()} .. "
        f"{args.to_date.isoformat()}",
        rows,
        ["logical_date", "task_id", "run_key", "status", "would", "explanation"]
        if args.json
        else ["logical_date", "task_id", "run_key", "status", "would"],
    )
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="airflow-idempotency", description=__doc__.split("\n\n")[0]
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help=f"libpq DSN of the job database (or set {DSN_ENV})")
    common.add_argument("--conn-id", default="idempotency_default", help="Airflow connection id")
    common.add_argument("--schema", default=DEFAULT_SCHEMA, help="bookkeeping schema")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)

    runs = sub.add_parser("runs", parents=[common], help="list job runs")
    runs.add_argument("--job")
    runs.add_argument("--status", choices=["started", "completed", "failed"])
    runs.add_argument("--from", dest="from_key", metavar="RUN_KEY", help="run keys >= this")
    runs.add_argument("--to", dest="to_key", metavar="RUN_KEY", help="run keys <= this")
    runs.add_argument("--limit", type=int, default=100)
    runs.add_argument(
        "--stale",
        action="store_true",
        help="only attempts still running and keys still started whose lock nobody holds "
        "(exit 1 when there are any)",
    )
    runs.set_defaults(func=cmd_runs)

    show = sub.add_parser("show", parents=[common], help="one run and all its attempts")
    show.add_argument("job")
    show.add_argument("run_key")
    show.set_defaults(func=cmd_show)

    sub.add_parser("locks", parents=[common], help="run keys locked now, by whom").set_defaults(
        func=cmd_locks
    )

    ledger = sub.add_parser(
        "ledger",
        parents=[common],
        help="external effects of every kind not confirmed, unknown first (exit 1 if any is "
        "unknown); mark-sent / resend resolve an unknown one",
    )
    ledger.add_argument("--job")
    ledger.add_argument("--run-key")
    ledger.add_argument(
        "--all", action="store_true", help="include succeeded effects in the summary"
    )
    ledger.add_argument("--limit", type=int, default=50)
    ledger.add_argument("--remote", help="with --key: the effect's remote system")
    ledger.add_argument("--key", help="show one effect and the audit of its resolutions")
    ledger.set_defaults(func=cmd_ledger)
    actions = ledger.add_subparsers(dest="ledger_action", metavar="{mark-sent,resend}")
    for name, what in (
        ("mark-sent", "an unknown effect did happen: confirm it, never send it again"),
        ("resend", "an unknown effect did not happen: make it pending, the next run sends it"),
    ):
        action = actions.add_parser(name, parents=[common], help=what, description=what)
        action.add_argument("remote_system")
        action.add_argument("idempotency_key")
        action.add_argument(
            "--reason", required=True, help="what you checked at the remote (recorded)"
        )
        action.add_argument("--by", help="who decides (recorded; default $USER)")

    reset = sub.add_parser(
        "reset", parents=[common], help="mark a failed or stuck run failed, with a reason"
    )
    reset.add_argument("job")
    reset.add_argument("run_key")
    reset.add_argument(
        "--reason", required=True, help="why (recorded in job_runs and the attempts)"
    )
    reset.set_defaults(func=cmd_reset)

    sub.add_parser(
        "migrate", parents=[common], help="create or migrate the bookkeeping schema"
    ).set_defaults(func=cmd_migrate)

    run = sub.add_parser(
        "run", parents=[common], help="run one business date of a DAG through Airflow"
    )
    run.add_argument("dag_id")
    run.add_argument("--date", required=True, type=business_date, help="business date, YYYY-MM-DD")
    run.add_argument("--dry-run", action="store_true")
    run.add_argument("--force", action="store_true", help="recompute a completed date")
    run.add_argument(
        "--force-reconcile", action="store_true", help="reconcile the external effects"
    )
    run.add_argument("--keep-log", action="store_true", help="keep Airflow's log of a success too")
    run.add_argument("--dags-folder", help="DAG folder (default: [core] dags_folder)")
    run.set_defaults(func=cmd_run)

    gaps = sub.add_parser(
        "gaps", parents=[common], help="periods of a job with no completed run (exit 1 if any)"
    )
    gaps.add_argument("job")
    gaps.add_argument("--from", dest="from_key", required=True, metavar="RUN_KEY")
    gaps.add_argument("--to", dest="to_key", required=True, metavar="RUN_KEY")
    gaps.set_defaults(func=cmd_gaps)

    prune = sub.add_parser(
        "prune", parents=[common], help="delete old attempt rows of completed keys"
    )
    prune.add_argument(
        "--attempts-older-than", dest="older_than", required=True, metavar="AGE", help="e.g. 400d"
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    prune.add_argument("--batch-size", type=int, default=10_000)
    prune.set_defaults(func=cmd_prune)

    explain = sub.add_parser(
        "explain", parents=[common], help="the run key a run would get, and why"
    )
    explain.add_argument("dag_id")
    explain.add_argument("--logical-date", type=_instant, help="ISO date or date-time")
    explain.add_argument(
        "--run-type", choices=["manual", "scheduled", "backfill"], default="scheduled"
    )
    explain.add_argument("--conf", help="the run's conf, JSON")
    explain.add_argument("--dags-folder", help="DAG folder (default: [core] dags_folder)")
    explain.set_defaults(func=cmd_explain)

    plan = sub.add_parser(
        "plan", parents=[common], help="what a backfill of a range would run, date by date"
    )
    plan.add_argument("dag_id")
    plan.add_argument("--from", dest="from_date", type=_instant, required=True, metavar="DATE")
    plan.add_argument("--to", dest="to_date", type=_instant, required=True, metavar="DATE")
    plan.add_argument(
        "--command",
        dest="command_name",
        choices=["dags-backfill", "backfill-create"],
        default=None,
        help="the backfill command (default: this Airflow line's)",
    )
    plan.add_argument("--dags-folder", help="DAG folder (default: [core] dags_folder)")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command_name", "") is None:
        from airflow_idempotency.compat import BACKFILL_COMMAND

        args.command_name = BACKFILL_COMMAND
    try:
        validate_schema_name(args.schema)
        return int(args.func(args))
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"error: {exc}" if exc.code != EXIT_OK else str(exc), file=sys.stderr)
        return exc.code
    except RunLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except psycopg.OperationalError as exc:
        print(f"error: cannot reach the job database: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
