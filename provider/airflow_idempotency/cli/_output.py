"""How commands print: a table for people, JSON with ``--json`` (stdout holds only that)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any


def json_value(value: Any) -> Any:
    """JSON for what json cannot encode: ISO 8601 for dates and times, text otherwise."""
    if isinstance(value, dt.date | dt.datetime | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)


def print_json(value: Any) -> None:
    print(json.dumps(value, default=json_value, indent=2))


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    if isinstance(value, dict | list):
        return json.dumps(value, default=json_value)
    return "" if value is None else value


# Columns that identify a row, shown whole on one line: three job names cut to their common
# beginning would look alike; an id (Airflow's task instance id, its DAG version) is copied whole.
WHOLE_COLUMNS = frozenset(
    {
        "job_name",
        "run_key",
        "remote_system",
        "idempotency_key",
        "task_id",
        "ti_id",
        "dag_version_id",
    }
)


def emit(
    args: argparse.Namespace, title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]
) -> None:
    """Print rows as a table, or as JSON with --json."""
    if args.json:
        print_json([{c: r.get(c) for c in columns} for r in rows])
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    cells = [[str(_plain(row.get(c))) for c in columns] for row in rows]
    # Text, not str: rich would read markup in what the rows hold (a task's error text, a run
    # id, a user name): "[/data/x]" fails to print, "[link=...]" writes a terminal hyperlink.
    table = Table(title=Text(title), title_justify="left")
    whole = 1  # the width the columns need, borders and padding included
    for index, column in enumerate(columns):
        widest = max([len(column), *(len(line[index]) for line in cells)])
        if column in WHOLE_COLUMNS:  # names that differ at their end: never cut, never "…"
            table.add_column(column, no_wrap=True, min_width=widest)
        else:  # wrapped, never cut; a status or a time fits on its line
            widest = min(widest, 25)
            table.add_column(column, overflow="fold", min_width=widest)
        whole += widest + 3
    for line in cells:
        table.add_row(*(Text(cell) for cell in line))
    # Wider than the terminal rather than cut (rich shortens even no_wrap columns to fit).
    terminal = os.get_terminal_size().columns if sys.stdout.isatty() else 160
    Console(width=max(120, terminal, whole)).print(table if rows else Text(f"{title}: none"))


def age(value: dt.timedelta) -> str:
    """``3d 4h 5m ago``: how long ago, to the minute."""
    seconds = int(value.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}d {hours}h {rest // 60}m ago" if days else f"{hours}h {rest // 60}m ago"


def logs_to_stderr() -> None:
    """Move Airflow's console log handlers from stdout to stderr (2.x logs to stdout).

    For the CLI: its ``--json`` output on stdout must hold the JSON only.
    """
    loggers = [logging.getLogger()]
    loggers += [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if hasattr(handler, "_use_stderr"):  # Airflow's RedirectStdHandler
                handler._use_stderr = True
            elif isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)


def spelling_note(run_key: str) -> str:
    """For a message that found nothing under ``run_key``: a note naming its one spelling
    when a period in it is written in other digits (2026-10-01 in fullwidth ones), else
    ``""``. Keys are stored in their one spelling, so the operator looks there."""
    from airflow_idempotency.key_spelling import foreign_spelling
    from airflow_idempotency.partitions import SEGMENT_DELIMITER

    segments = run_key.split(SEGMENT_DELIMITER)
    canonical = SEGMENT_DELIMITER.join(foreign_spelling(s) or s for s in segments)
    if canonical == run_key:
        return ""
    return (
        f" ({run_key!r} is written with non-ASCII digits or characters; its one spelling is "
        f"{canonical!r}: look under that)"
    )
