"""What the demo prints: sections, checks that stop it at the first failure, tables, timings."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text


class DemoFailure(Exception):
    """A step did not do what it claims."""


def rel(path: Path) -> str:
    """``path`` relative to the current folder when it is below it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass(kw_only=True)
class Narration:
    """The demo's terminal: what it says, the checks passed so far, the time of each part."""

    console: Console
    timings: dict[str, float] = field(default_factory=dict)
    checks: int = 0

    def say(self, text: str) -> None:
        self.console.print(
            Padding(Text.from_markup(text), (0, 0, 0, 2), expand=False), highlight=False
        )

    def section(self, number: int | str, title: str, intro: str = "") -> None:
        self.console.print()
        self.console.rule(f"[bold cyan]Step {number} · {title}", align="left", style="cyan")
        if intro:
            self.say(f"[dim]{intro}[/dim]")

    def check(self, ok: bool, claim: str, detail: Callable[[], str] | str = "") -> None:
        """Print ``claim`` as passed, or stop the demo with it as the failure."""
        if not ok:
            text = detail() if callable(detail) else detail
            raise DemoFailure(f"{claim}\n{text}".strip())
        self.checks += 1
        self.console.print(f"  [green]✓[/green] {claim}", highlight=False, soft_wrap=True)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        self.console.print(table)

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        return _timer(self.timings, name)


@contextlib.contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = time.monotonic() - t0


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if value is None:
        return "-"
    return str(value)
