"""How run keys are spelled: one text for each period, label and segment.

A run key is text that people type (a trigger form, a conf, a CLI argument) and text that
Airflow writes (partition keys). Two spellings of one period would be two keys: two locks,
two ``job_runs`` rows, no no-op, new effect keys. So every key has one spelling:

- its text is in Unicode NFC (:func:`check_text` refuses any other form, naming the NFC
  one; :func:`~airflow_idempotency.run_key.resolve_run_key` maps what it reads to NFC and
  says so in the task log);
- no control, format (zero-width space, bidi marks), surrogate, private-use or unassigned
  character, no line or paragraph separator, no space but the ASCII one, none around it;
- a period is written with ASCII digits (:data:`PERIOD_FORMATS`): 2026-10-01 written in
  fullwidth digits (what a Japanese or Chinese input method types), Arabic-Indic or
  Devanagari ones is refused, naming ``2026-10-01``;
- a label (a segment that is not the period, ``eu`` in ``eu|2026-10-01``) cannot be read
  as a period or a time, in any digits, and is not a marker of the command line (``*``, the
  period's place in ``gaps --segment 'eu|*'``) nor of a key template (``{}``);
- a key has at most one period segment.
"""

from __future__ import annotations

import datetime as dt
import re
import unicodedata
from dataclasses import dataclass

from airflow_idempotency.exceptions import InvalidInputError, InvalidRunKeyError
from airflow_idempotency.partitions import DEFAULT_TIME_FORMATS, SEGMENT_DELIMITER, format_pattern

MAX_KEY_LENGTH = 200

PERIOD_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    "hour": (
        re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2})Z"),
        "YYYY-MM-DDTHHZ (UTC), e.g. 2026-10-01T13Z",
    ),
    "day": (re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})"), "YYYY-MM-DD, e.g. 2026-10-01"),
    "week": (re.compile(r"([0-9]{4})-W([0-9]{2})"), "YYYY-Www (ISO week), e.g. 2026-W40"),
    "month": (re.compile(r"([0-9]{4})-([0-9]{2})"), "YYYY-MM, e.g. 2026-10"),
}
"""The one spelling of each period's key (ASCII digits only: ``\\d`` would take any)."""

MARKERS = frozenset({"*", "{}"})
"""Texts a label may not be: the CLI's period marker and a key template's placeholder."""

_TIME_PATTERNS = tuple(format_pattern(fmt) for fmt in DEFAULT_TIME_FORMATS)

# Unicode categories refused anywhere in a key or a name: control, format (zero-width,
# bidi), surrogate, private use, unassigned, line and paragraph separators.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Characters Unicode says to render as nothing though they are not format characters
# (Default_Ignorable_Code_Point): the combining grapheme joiner, Hangul fillers, Khmer
# inherent vowels, Mongolian and other variation selectors ('✓' + U+FE0F looks like '✓').
IGNORABLE = frozenset(
    [
        *(0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0),
        *range(0x180B, 0x1810),
        *range(0xFE00, 0xFE10),
        *range(0xE0100, 0xE01F0),
    ]
)


def check_text(value: object, what: str) -> str:
    """Validate free text used as a job name, run key or effect key; return it unchanged.

    Any printable text is allowed (quotes and unicode included: it only ever travels as a
    bound parameter). Refused: non-text, empty text, blanks around it, more than
    :data:`MAX_KEY_LENGTH` characters, text not in Unicode NFC (the message names the NFC
    form), control, format, private-use and unassigned characters, and spaces other than
    the ASCII one (a no-break space looks like a space but would make another key).
    """
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be text, got {type(value).__name__}: {value!r}")
    if not value or value != value.strip():
        raise InvalidInputError(f"{what} {value!r} is empty or has leading/trailing blanks")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidInputError(f"{what} is {len(value)} characters long; at most {MAX_KEY_LENGTH}")
    if value.isascii() and value.isprintable():
        return value  # printable ASCII: no refused character, no combining mark, NFC already
    bad = [c for c in value if _refused(c)]
    if bad:
        names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, '(unnamed)')}" for c in bad[:5])
        raise InvalidInputError(
            f"{what} {value!r} contains invisible, control or unassigned characters ({names}): "
            f"text that looks the same without them would be another key; remove them"
        )
    if unicodedata.category(value[0]).startswith("M"):
        raise InvalidInputError(
            f"{what} {value!r} starts with a combining mark (U+{ord(value[0]):04X}), which "
            f"would be drawn on the character before it: start with a letter, digit or sign"
        )
    normal = unicodedata.normalize("NFC", value)
    if normal != value:
        raise InvalidInputError(
            f"{what} {value!r} is not in Unicode NFC: the same text is written {normal!r} "
            f"(composed characters); use that spelling"
        )
    return value


def _refused(char: str) -> bool:
    category = unicodedata.category(char)
    return (
        category in _REFUSED_CATEGORIES
        or (category == "Zs" and char != " ")
        or ord(char) in IGNORABLE
    )


def folded(text: str) -> str:
    """``text`` with compatibility forms folded (NFKC: a fullwidth digit two or hyphen to
    ``2`` and ``-``) and every decimal digit written in ASCII (Arabic-Indic two to ``2``)."""
    if text.isascii():
        return text  # ASCII is its own NFKC form, its digits ASCII already
    text = unicodedata.normalize("NFKC", text)
    return "".join(
        str(unicodedata.decimal(c))
        if not c.isascii() and unicodedata.decimal(c, None) is not None
        else c
        for c in text
    )


def period_of(text: str) -> str | None:
    """The period whose canonical spelling ``text`` is (``hour``, ``day``, ``week``,
    ``month``), or ``None``."""
    for period, (pattern, _) in PERIOD_FORMATS.items():
        if pattern.fullmatch(text):
            return period
    return None


def reads_as_time(text: str) -> bool:
    """Whether ``text`` is written like a period or a time (a run key's period, or one of
    the formats Airflow writes time partition keys in), in ASCII digits."""
    return period_of(text) is not None or any(p.fullmatch(text) for p in _TIME_PATTERNS)


def foreign_spelling(text: str) -> str | None:
    """The canonical spelling of ``text`` when ``text`` is a period or time written with
    non-ASCII digits or compatibility characters (a fullwidth 2026-10-01 ->
    ``2026-10-01``), else ``None``."""
    fold = folded(text)
    return fold if fold != text and reads_as_time(fold) else None


_LENIENT: dict[str, re.Pattern[str]] = {
    "hour": re.compile(
        r"([0-9]{4})[-/.]?([0-9]{1,2})[-/.]?([0-9]{1,2})[T ]([0-9]{1,2})(?::00){0,2}(?:Z|\+00:?00)",
        re.I,
    ),
    # A day with a time of day after it (2026-10-01 00:00:00, 2026-10-01T00:00, ...Z): a
    # date picker's or str(datetime)'s text names the day as much as the date alone does.
    "day": re.compile(
        r"([0-9]{4})[-/.]([0-9]{1,2})[-/.]([0-9]{1,2})"
        r"(?:[T ][0-9]{1,2}(?::[0-9]{2}){0,2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}:?[0-9]{2})?"
        r"|([0-9]{4})([0-9]{2})([0-9]{2})",
        re.I,
    ),
    "week": re.compile(r"([0-9]{4})-?W([0-9]{1,2})", re.I),
    "month": re.compile(r"([0-9]{4})[-/.]([0-9]{1,2})|([0-9]{4})([0-9]{2})"),
}


# Dashes a word processor or a keyboard layout writes for '-' (NFKC keeps them): en dash,
# em dash, hyphen, non-breaking hyphen, figure dash, minus sign.
_DASHES = str.maketrans(dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2212", "-"))


def spelling_of(text: object, period: str) -> str | None:
    """The one spelling of the ``period`` that ``text`` writes another way (``2026-10-1``,
    ``2026/10/01``, ``20261001``, ``2026-w40``, ``2026-10-01T13:00Z``, other digits), if
    it names a real one; else ``None``. For messages only: such text is refused."""
    if not isinstance(text, str):
        return None
    match = _LENIENT[period].fullmatch(folded(text).translate(_DASHES).strip())
    if match is None:
        return None
    y, *rest = (int(g) for g in match.groups() if g is not None)
    try:
        if period == "week":
            dt.date.fromisocalendar(y, rest[0], 1)
            return f"{y:04d}-W{rest[0]:02d}"
        day = rest[1] if len(rest) > 1 else 1
        hour = rest[2] if len(rest) > 2 else 0
        moment = dt.datetime(y, rest[0], day, hour)
    except ValueError:
        return None
    formats = {"hour": "%Y-%m-%dT%HZ", "day": "%Y-%m-%d", "month": "%Y-%m"}
    return moment.strftime(formats[period])


def refuse_foreign_spelling(text: str, what: str) -> None:
    """Refuse ``text`` (a key or one of its segments) if it is a period written with other
    digits or characters than the canonical ones, naming the canonical spelling."""
    canonical = foreign_spelling(text)
    if canonical is not None:
        raise InvalidRunKeyError(
            f"{what} {text!r} is a period written with non-ASCII digits or characters; its "
            f"one spelling is {canonical!r}: write that (another spelling would be another "
            f"run key: another lock and run record, the completed period run again)"
        )


def check_label(segment: object, what: str, key: str) -> str:
    """A segment that is not the period (``eu``): non-empty text without blanks around it,
    without the delimiter, not a marker, not readable as a period or a time, or raise."""
    if not isinstance(segment, str) or not segment or segment != segment.strip():
        raise InvalidRunKeyError(
            f"{what} {segment!r} of {key!r} is empty or has leading/trailing blanks: a run key's "
            f"segments are non-empty text separated by {SEGMENT_DELIMITER!r}, at most one of "
            f"them a period (e.g. eu|2026-10-01)"
        )
    fold = folded(segment)
    if SEGMENT_DELIMITER in fold:
        raise InvalidRunKeyError(
            f"{what} {segment!r} of {key!r} contains {SEGMENT_DELIMITER!r} (or a character "
            f"written like it), which separates the segments of a run key"
        )
    if fold in MARKERS:
        raise InvalidRunKeyError(
            f"{what} {segment!r} of {key!r} is not a label: {fold!r} marks the period's place "
            f"in a segment pattern (gaps --segment 'eu|*'). Name the segment with a word "
            f"(e.g. eu, all)"
        )
    refuse_foreign_spelling(segment, f"{what} of {key!r}")
    _key_text(segment, what)
    if reads_as_time(segment):
        raise InvalidRunKeyError(
            f"{what} {segment!r} of {key!r} reads as a period or a time, so it cannot be a "
            f"label: a run key has exactly one period segment, the others are names (e.g. "
            f"eu|2026-10-01). Give the period once, in the job's period format"
        )
    meant = [
        m for m in (spelling_of(segment, p) for p in PERIOD_FORMATS) if m not in (None, segment)
    ]
    if meant and not fold.isdigit():  # a number (a store id) may be a label
        raise InvalidRunKeyError(
            f"{what} {segment!r} of {key!r} reads as the period {meant[0]!r} written another "
            f"way, so it cannot be a label: give the period once, in its one spelling"
        )
    return segment


def _key_text(text: object, what: str) -> str:
    """:func:`check_text`, its refusal an :class:`InvalidRunKeyError` (a key, not a name)."""
    try:
        return check_text(text, what)
    except InvalidRunKeyError:
        raise
    except InvalidInputError as exc:
        raise InvalidRunKeyError(str(exc)) from None


def check_key_text(key: object, what: str = "run key") -> str:
    """A run key of any origin (a callable's, a script's): :func:`check_text`, then each
    segment: no marker, no period in foreign digits, and at most one period segment.

    A key accepted once is accepted again at once (a pure check: the same text, the same
    verdict; a refusal is not remembered and says the same again): a rerun's decision pays
    for the check once per process and key (issue 32, goal 4)."""
    if type(key) is str and key in _ACCEPTED_KEYS:
        return key
    text = _checked_key_text(key, what)
    if len(_ACCEPTED_KEYS) >= _ACCEPTED_KEYS_MAX:
        _ACCEPTED_KEYS.clear()
    _ACCEPTED_KEYS.add(text)
    return text


_ACCEPTED_KEYS: set[str] = set()
_ACCEPTED_KEYS_MAX = 4096  # keys kept; then forgotten all at once (rechecked when met again)


def _checked_key_text(key: object, what: str) -> str:
    """:func:`check_key_text`'s checks."""
    text = _key_text(key, what)
    segments = text.split(SEGMENT_DELIMITER)
    periods = [s for s in segments if reads_as_time(s)]
    if len(periods) > 1:
        raise InvalidRunKeyError(
            f"{what} {text!r} has {len(periods)} segments that read as periods "
            f"({', '.join(map(repr, periods))}): a run key has at most one period, the other "
            f"segments are names (e.g. eu|2026-10-01)"
        )
    for segment in segments:
        refuse_foreign_spelling(segment, what if len(segments) == 1 else f"a segment of {what}")
        _refuse_unreal_period(segment, what)
        if segment in MARKERS:
            raise InvalidRunKeyError(
                f"{what} {text!r} has the segment {segment!r}, which marks the period's place "
                f"in a segment pattern (gaps --segment 'eu|*'): use a name instead"
            )
    return text


def _refuse_unreal_period(segment: str, what: str) -> None:
    """Refuse a segment written like a period that is none (``2026-13-01``, ``2026-W54``)."""
    period = period_of(segment)
    if period is None:
        return
    numbers = [int(n) for n in PERIOD_FORMATS[period][0].fullmatch(segment).groups()]  # type: ignore[union-attr]
    try:
        if period == "week":
            dt.date.fromisocalendar(numbers[0], numbers[1], 1)
        else:
            day = numbers[2] if len(numbers) > 2 else 1
            hour = numbers[3] if len(numbers) > 3 else 0
            dt.datetime(numbers[0], numbers[1], day, hour)
    except ValueError as exc:
        raise InvalidRunKeyError(
            f"{what} has the segment {segment!r}, written like a {period} but none ({exc}): "
            f"a key read back as a period must name a real one"
        ) from None


# -- reading keys back (gaps, the calendar) ------------------------------------------------


@dataclass(frozen=True)
class KeyParts:
    """A run key taken apart: its period segment and the labels around it.

    ``eu|2026-10-01`` -> labels ``("eu", "{}")``, period ``2026-10-01``; a key without a
    period segment has ``period`` ``None``.
    """

    template: tuple[str, ...]
    period: str | None

    @property
    def segment(self) -> str:
        """The labels with the period left out (``eu|*``), ``""`` for a plain period key."""
        if self.template == ("{}",):
            return ""
        return SEGMENT_DELIMITER.join("*" if s == "{}" else s for s in self.template)

    def with_period(self, period: str) -> str:
        """This key's labels around another period: the key of the same segment then."""
        return SEGMENT_DELIMITER.join(period if s == "{}" else s for s in self.template)


def key_parts(key: str) -> KeyParts:
    """Split a run key into its period segment (the first in a run-key period format) and
    its label segments."""
    segments = key.split(SEGMENT_DELIMITER)
    for index, segment in enumerate(segments):
        if any(pattern.fullmatch(segment) for pattern, _ in PERIOD_FORMATS.values()):
            template = (*segments[:index], "{}", *segments[index + 1 :])
            return KeyParts(template, segment)
    return KeyParts(tuple(segments), None)


def segment_template(segment: str) -> KeyParts:
    """The parts of a segment as users write it on the command line: ``eu`` or ``eu|*``
    (the period after the labels), ``*|eu`` (before them); ``""``: plain period keys."""
    if segment == "":
        return KeyParts(("{}",), None)
    labels = segment.split(SEGMENT_DELIMITER)
    if "*" not in labels:
        labels.append("*")
    if labels.count("*") != 1:
        raise InvalidInputError(f"segment {segment!r}: mark the period's place with one '*'")
    for label in labels:
        if label != "*":
            check_label(label, "segment", segment)
    return KeyParts(tuple("{}" if s == "*" else s for s in labels), None)
