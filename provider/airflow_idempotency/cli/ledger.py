"""``ledger``: effects not confirmed; ``ledger mark-sent`` / ``ledger resend``.

Every kind of external effect not confirmed, the unknown ones first; and, for an unknown
effect, an operator's audited choice: mark it sent, or resend it.

An effect of a remote that does not deduplicate (an email, a chat message, a notification)
is ``unknown`` when its call began and no outcome was recorded: it may have happened, and the
ledger never sends it again on its own. ``ledger`` exits 1 while one is unknown.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli._arguments import count, text
from airflow_idempotency.cli._base import (
    EXIT_FAILED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    add_command,
    epilog,
)
from airflow_idempotency.cli._database import connect_read
from airflow_idempotency.cli._output import emit, print_json
from airflow_idempotency.exceptions import RunLockedError

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands

ACTIONS = {
    "mark-sent": ("mark_sent", "an unknown effect did happen: confirm it, never send it again"),
    "resend": (
        "resend",
        "an unknown effect did not happen: make it pending, the next run sends it",
    ),
}


EXAMPLES = """
ledger                      # exit 1 while an effect is unknown
ledger --job finalize_invoices.mail_finance --run-key 2026-10-01 --all
ledger --remote finance_mail --key mail:2026-10-01 --json
ledger mark-sent finance_mail mail:2026-10-01 --reason "Message-ID found in the mailbox"
ledger resend finance_mail mail:2026-10-01 --reason "not in the mailbox" --dsn "$DSN"
"""
MAX_LIMIT = 100_000


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "ledger",
        "external effects of every kind not confirmed, unknown first (exit 1 if any is "
        "unknown); mark-sent / resend resolve an unknown one",
        handle,
        EXAMPLES,
    )
    parser.add_argument("--job", type=text, help="only effects of this job")
    parser.add_argument("--run-key", type=text, help="only effects of this run key")
    parser.add_argument(
        "--all", action="store_true", help="include succeeded effects in the summary"
    )
    parser.add_argument(
        "--limit",
        type=count(MAX_LIMIT),
        default=50,
        metavar="N",
        help=f"at most N effects not confirmed (default: 50; 1 to {MAX_LIMIT})",
    )
    parser.add_argument("--remote", type=text, help="with --key: the effect's remote system")
    parser.add_argument(
        "--key", type=text, help="with --remote: show one effect and the audit of its resolutions"
    )
    actions = parser.add_subparsers(
        dest="ledger_action",
        metavar="{mark-sent,resend}",
        title="actions",
        help="resolve an unknown effect (`ledger ACTION --help` for its options)",
    )
    for name, (_, what) in ACTIONS.items():
        action = actions.add_parser(
            name,
            parents=[common],
            help=what,
            description=what,
            epilog=epilog(
                f'ledger {name} finance_mail mail:2026-10-01 --reason "checked the mailbox"'
            ),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        action.add_argument("remote_system", type=text, help="the effect's remote system")
        action.add_argument("idempotency_key", type=text, help="the effect's idempotency key")
        action.add_argument(
            "--reason", type=text, required=True, help="what you checked at the remote (recorded)"
        )
        action.add_argument(
            "--by", type=text, help="who decides (recorded; default: $USER, else $LOGNAME)"
        )


def handle(args: argparse.Namespace) -> int:
    """Effects per job, key, remote system, kind and status, then each one not confirmed, the
    unknown ones first; exit 1 while any is unknown. With ``--remote`` and ``--key``: that one
    effect and who resolved it, when, why."""
    if args.ledger_action:
        listing = {"--job": args.job, "--run-key": args.run_key, "--all": args.all,
                   "--remote": args.remote, "--key": args.key}  # fmt: skip
        ignored = [option for option, value in listing.items() if value]
        if ignored:
            raise CommandError(
                f"{', '.join(ignored)} filter the listing; `ledger {args.ledger_action}` names "
                "its effect by REMOTE KEY alone: drop them",
                EXIT_USAGE,
            )
        return resolve(args)
    if args.key:
        return show_effect(args)
    params = {"job": args.job, "run_key": args.run_key, "all": args.all, "limit": args.limit}
    with connect_read(args) as conn:
        summary = query_rows(conn, "cli_ledger_summary", args.schema, params)
        problems = query_rows(conn, "cli_ledger_problems", args.schema, params)
    unknown = sum(int(r["effects"]) for r in summary if r["status"] == "unknown")
    if args.json:
        print_json({"summary": summary, "not_confirmed": problems})
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


def show_effect(args: argparse.Namespace) -> int:
    """One effect (``--remote`` and ``--key``) and the audit of its resolutions."""
    from airflow_idempotency.effects.resolutions import resolutions

    if not args.remote:
        raise CommandError("--key needs --remote (the effect's remote system)", EXIT_USAGE)
    params = {"remote_system": args.remote, "key": args.key}
    with connect_read(args) as conn:
        rows = query_rows(conn, "ledger_effect", args.schema, params)
        audit = resolutions(conn, args.schema, args.remote, args.key) if rows else []
    if not rows:
        raise CommandError(f"no effect {args.key!r} of remote system {args.remote!r}", EXIT_USAGE)
    if args.json:
        print_json({"effect": rows[0], "resolutions": audit})
        return EXIT_OK
    columns = ["job_name", "run_key", "effect_kind", "deduplicating", "status", "intent_at"]
    emit(args, f"{args.remote} {args.key}", rows, [*columns, "last_error"])
    audit_columns = ["action", "previous_status", "resolved_by", "reason", "resolved_at"]
    emit(args, "resolutions", audit, audit_columns)
    return EXIT_OK


def resolve(args: argparse.Namespace) -> int:
    """``ledger mark-sent`` / ``ledger resend`` (see
    :mod:`airflow_idempotency.effects.resolutions`)."""
    from airflow_idempotency.effects.resolutions import resolve_unknown

    action = ACTIONS[args.ledger_action][0]
    who = args.by or os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    with connect_read(args) as conn:
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
        print_json(done.__dict__)
    else:
        print(
            f"{done.remote_system} {done.idempotency_key} (job {done.job_name}, run key "
            f"{done.run_key}): unknown -> {done.new_status} by {done.resolved_by} at "
            f"{done.resolved_at.isoformat(timespec='seconds')}; {then}"
        )
    return EXIT_OK
