"""docs/run-keys.md stays true: each row of its table of spellings is what the provider
accepts and refuses, and the characters it names are refused (no database, no Airflow)."""

from __future__ import annotations

import re

import pendulum
import pytest

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.run_key import RunFacts, RunKeyRule, resolve_run_key
from support import ROOT

PAGE = (ROOT / "docs" / "run-keys.md").read_text(encoding="utf-8")
NOW = pendulum.datetime(2026, 11, 29, 8, tz="UTC")
PERIODS = {"hour (UTC)": "hour", "day": "day", "ISO week": "week", "month": "month"}


def spellings() -> list[tuple[str, str, list[str]]]:
    """(period, its one spelling, the refused examples) of each row of the table."""
    section = PAGE.split("## One spelling per key", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0] in PERIODS:
            codes = [re.findall(r"`([^`]+)`", cell) for cell in cells[1:]]
            rows.append((PERIODS[cells[0]], codes[0][0], codes[1]))
    return rows


def explicit(period: str, key: str) -> str:
    facts = RunFacts(run_type="manual", timezone="UTC", now=NOW, conf_run_key=key)
    return resolve_run_key(RunKeyRule(period=period), facts).run_key  # type: ignore[arg-type]


def test_the_table_lists_every_period() -> None:
    """The page's table has a row for each period of RunKeyRule."""
    assert sorted(p for p, _, _ in spellings()) == ["day", "hour", "month", "week"]


@pytest.mark.parametrize(("period", "canonical", "refused"), spellings())
def test_each_rows_spelling_is_kept_and_its_examples_refused(
    period: str, canonical: str, refused: list[str]
) -> None:
    """The one spelling resolves to itself; every example the row gives is refused."""
    assert explicit(period, canonical) == canonical
    for text in refused:
        with pytest.raises(InvalidInputError):
            explicit(period, text)


def test_the_digits_and_characters_the_page_names_are_refused() -> None:
    """The fullwidth, Arabic-Indic and Devanagari 2026-10-01 the page shows are refused,
    naming 2026-10-01; so are the code points it lists."""
    shown = re.findall(r"`([^`]*)`\s+\((?:fullwidth|Arabic-Indic|Devanagari)", PAGE)
    assert len(shown) == 3
    for text in shown:
        with pytest.raises(InvalidInputError, match="'2026-10-01'"):
            explicit("day", text)
    for code in ("200B", "200E", "202E", "2066"):
        assert f"U+{code}" in PAGE
        with pytest.raises(InvalidInputError, match=f"U\\+{code}"):
            explicit("day", f"e{chr(int(code, 16))}u|2026-10-01")
