"""The view's parameter parsers: text, map indexes, and refusals that say what to do.

Line-neutral and Airflow-free: the query objects of :mod:`.pages` (FastAPI and Flask read
the same ones) are built from these types, so that every parameter of both lines is checked
once, here, before any statement reaches the job database. A refused request is a 400 whose
message names the parameter, what was wrong with it and what to send instead
(:func:`explain`); PostgreSQL never sees a NUL byte, a control character or an over-long
value.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field

TEXT_LIMIT = 400
"""The longest value a query parameter may have (job names and run keys are shorter)."""

MAP_INDEX_MAX = 2**31 - 1
"""The largest map index Airflow stores (an INTEGER column)."""

# What a text parameter may not hold: C0 and C1 controls, DEL (PostgreSQL refuses NUL in a
# text value outright; the others cannot be typed into a job name or a run key either).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
TEXT_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
"""The same rule, as the OpenAPI schema states it."""


def printable(value: str) -> str:
    """``value`` if it holds no control character (NUL included), else a ValueError naming
    the first one and where it is."""
    found = _CONTROL.search(value)
    if found is not None:
        code = f"U+{ord(found.group()):04X}"
        name = unicodedata.name(found.group(), "a control character")
        raise ValueError(
            f"holds {code} ({name.lower()}) at position {found.start()}: job names, run keys "
            "and ids never contain control characters; remove it"
        )
    return value


Text = Annotated[
    str,
    Field(max_length=TEXT_LIMIT, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(printable),
]
"""A text parameter: at most :data:`TEXT_LIMIT` characters, no control character."""

RequiredText = Annotated[
    str,
    Field(min_length=1, max_length=TEXT_LIMIT, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(printable),
]
"""A text parameter that must not be empty."""

_MAP_INDEX = re.compile(r"-1|0|[1-9][0-9]{0,9}")


def parse_map_index(value: str | None) -> int | None:
    """A task instance's map index as the "Run key" link sends it: None for a task that is
    not mapped (absent, empty or ``-1``), else a whole number 0 .. :data:`MAP_INDEX_MAX`
    written in ASCII digits; anything else a ValueError saying what to send."""
    if value is None or value in ("", "-1"):
        return None
    if _MAP_INDEX.fullmatch(value) is None or int(value) > MAP_INDEX_MAX:
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(
            f"map_index must be -1 (a task that is not mapped) or a whole number from 0 to "
            f"{MAP_INDEX_MAX} in ASCII digits, not {shown!r}: send the map index Airflow "
            "shows for the task instance, or leave it out"
        )
    return int(value)


# Parameters whose name is a Python keyword: their field has another name, which FastAPI 0.117
# (Airflow 3.1's lock) puts in an error's location where 0.136 (3.2, 3.3) puts the alias.
_SENT_AS = {"from_key": "from", "to_key": "to"}


def _where(loc: Iterable[Any]) -> str:
    parts = [_SENT_AS.get(str(part), str(part)) for part in loc if part not in ("query", "path")]
    return ".".join(parts) or "the request"


def explain(errors: Iterable[Mapping[str, Any]], allowed: Iterable[str] = ()) -> str:
    """Pydantic's errors of a request's parameters as one message: a sentence per parameter,
    each saying what was wrong and what to send (an unknown parameter names those the page
    takes)."""
    known = ", ".join(sorted(allowed))
    said = []
    for error in errors:
        where, kind = _where(error.get("loc", ())), error.get("type", "")
        if kind == "extra_forbidden":
            said.append(
                f"{where}: not a parameter of this page; it takes {known or 'none'}"
                " (check the spelling)"
            )
        elif kind == "missing":
            said.append(f"{where}: required; add ?{where}=... to the address")
        elif kind == "string_too_long":
            said.append(f"{where}: longer than {TEXT_LIMIT} characters; send a shorter value")
        elif kind == "string_too_short":
            said.append(f"{where}: empty; send a value")
        else:
            message = str(error.get("msg", "not valid")).removeprefix("Value error, ")
            said.append(f"{where}: {message}")
    return "; ".join(said) or "the request's parameters are not valid"


__all__ = [
    "MAP_INDEX_MAX",
    "TEXT_LIMIT",
    "TEXT_PATTERN",
    "RequiredText",
    "Text",
    "explain",
    "parse_map_index",
    "printable",
]
