"""The Run keys view's parameter parsers (airflow_idempotency.ui.parameters and the query
objects of ui.pages), for any input: each either refuses with a ValueError / a pydantic
ValidationError that names the parameter, or returns what the pages then read."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from airflow_idempotency.ui import pages
from airflow_idempotency.ui.parameters import (
    MAP_INDEX_MAX,
    TEXT_LIMIT,
    TEXT_PATTERN,
    explain,
    parse_map_index,
    printable,
)

CONTROL = st.characters(min_codepoint=0, max_codepoint=0x1F) | st.sampled_from(
    [chr(c) for c in range(0x7F, 0xA0)]
)


@given(st.text())
def test_printable_refuses_exactly_what_the_schema_pattern_refuses(value: str) -> None:
    """printable and the OpenAPI pattern agree on every string; a refusal names the code
    point and says to remove it."""
    try:
        assert printable(value) == value
        accepted = True
    except ValueError as exc:
        accepted = False
        assert "U+" in str(exc) and "remove it" in str(exc)
    assert accepted == bool(re.fullmatch(TEXT_PATTERN, value))


@given(st.text(), CONTROL, st.text())
def test_a_control_character_anywhere_is_refused(head: str, bad: str, tail: str) -> None:
    """A NUL byte or any other control character, wherever it is, is refused."""
    with pytest.raises(ValueError, match=f"U\\+{ord(bad):04X}|U\\+"):
        printable(head + bad + tail)


@given(st.integers(min_value=0, max_value=MAP_INDEX_MAX))
def test_every_map_index_airflow_stores_parses_to_itself(index: int) -> None:
    """Each map index 0 .. 2**31-1 written as Airflow writes it parses to that number."""
    assert parse_map_index(str(index)) == index


@given(st.text(max_size=30))
def test_a_map_index_is_canonical_or_refused(value: str) -> None:
    """Any text is None (not mapped: empty or -1), the number whose canonical spelling it is,
    or a ValueError saying what to send: never another exception, never a second spelling
    (+3, 03, ٣, 1_0, " 3") of a number."""
    try:
        parsed = parse_map_index(value)
    except ValueError as exc:
        assert "map_index must be -1" in str(exc)
        return
    if parsed is None:
        assert value in ("", "-1")
    else:
        assert str(parsed) == value and 0 <= parsed <= MAP_INDEX_MAX


@given(st.integers().filter(lambda n: n < -1 or n > MAP_INDEX_MAX))
def test_a_map_index_out_of_range_is_refused(index: int) -> None:
    with pytest.raises(ValueError, match="from 0 to 2147483647"):
        parse_map_index(str(index))


@given(st.dictionaries(st.sampled_from(["job", "run_key", "x", "from"]), st.text(max_size=450)))
def test_a_key_query_accepts_only_two_printable_bounded_values(params: dict[str, str]) -> None:
    """KeyQuery takes exactly job and run_key, each 1..400 printable characters; anything
    else is a ValidationError whose explanation names each refused parameter."""
    valid = set(params) == {"job", "run_key"} and all(
        1 <= len(v) <= TEXT_LIMIT and re.fullmatch(TEXT_PATTERN, v) for v in params.values()
    )
    try:
        query = pages.KeyQuery.model_validate(params)
    except ValidationError as exc:
        assert not valid
        said = explain(exc.errors(), ["job", "run_key"])
        for error in exc.errors():
            assert str(error["loc"][0]) in said
        return
    assert valid and (query.job, query.run_key) == (params["job"], params["run_key"])


@given(st.text(max_size=12), st.text(max_size=12))
def test_an_overview_range_is_refused_only_when_reversed(low: str, high: str) -> None:
    """from after to is refused (swap them); an empty field means no bound."""
    params = {"from": low, "to": high}
    printable_both = all(re.fullmatch(TEXT_PATTERN, v) for v in (low, high))
    try:
        query = pages.OverviewQuery.model_validate(params)
    except ValidationError as exc:
        assert not printable_both or (low and high and low > high)
        if printable_both:
            assert "swap them" in str(exc)
        return
    assert printable_both and not (low and high and low > high)
    assert (query.from_key, query.to_key) == (low or None, high or None)
