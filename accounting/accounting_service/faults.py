"""Fault injection settings and the seeded draw that decides each POST's fate.

Fields (CLI ``--fail-rate``, env ``ACCOUNTING_FAIL_RATE``, JSON ``fail_rate``, ...):

``fail_rate``                  share of POSTs answered 503 before anything is done.
``timeout_after_commit_rate``  share of POSTs processed (committed) normally whose answer
                               is then held for ``hang_seconds`` (default 30), or until the
                               client gives up and disconnects.
``reset_rate``                 share of POSTs whose TCP connection is reset (RST) with no
                               HTTP response: ``reset_phase`` ``after_commit`` (default)
                               processes the request first, ``before_commit`` stores nothing.
``latency_ms``                 delay added to every POST.
``seed``                       seed of the draws (default 0).

Lost answers (timeout, reset) hit whatever the answer would have been: a new invoice,
a replay, a 422 or a 400. Every POST draws exactly one number from a seeded
``random.Random``, whatever the settings, so the faults depend only on the seed and the
order in which POSTs arrive: a run with one worker is reproducible. The three rates split
``[0, 1)`` into disjoint slices, hence their sum must not exceed 1.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "ACCOUNTING_"
RESET_PHASES = ("before_commit", "after_commit")


class Fault(enum.Enum):
    NONE = "none"
    FAIL = "fail"
    RESET = "reset"
    TIMEOUT_AFTER_COMMIT = "timeout_after_commit"


@dataclass(frozen=True)
class FaultSettings:
    """What to break and how often; the JSON form of ``GET/PUT /admin/faults``."""

    fail_rate: float = 0.0
    timeout_after_commit_rate: float = 0.0
    reset_rate: float = 0.0
    # After commit is the interesting case for clients: the invoice exists but the
    # answer is lost, so only a retry with the same key tells them the outcome.
    reset_phase: str = "after_commit"
    latency_ms: float = 0.0
    hang_seconds: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_rate", "timeout_after_commit_rate", "reset_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if self.fail_rate + self.timeout_after_commit_rate + self.reset_rate > 1.0:
            raise ValueError(
                "fail_rate + timeout_after_commit_rate + reset_rate must not exceed 1 "
                "(each POST suffers at most one of these faults)"
            )
        if self.reset_phase not in RESET_PHASES:
            raise ValueError(f"reset_phase must be one of {', '.join(RESET_PHASES)}")
        if self.latency_ms < 0 or self.hang_seconds < 0:
            raise ValueError("latency_ms and hang_seconds must not be negative")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, changes: Mapping[str, Any]) -> FaultSettings:
        """A copy with ``changes`` applied; fields not mentioned keep their value.

        Raises ``ValueError`` with a message fit for the client on unknown fields, wrong
        types or out-of-range values.
        """
        unknown = sorted(set(changes) - set(FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(unknown)}")
        values = {name: _coerce_json(name, value) for name, value in changes.items()}
        return dataclasses.replace(self, **values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultSettings:
        """Read ``ACCOUNTING_FAIL_RATE``, ``ACCOUNTING_SEED`` and friends."""
        values: dict[str, Any] = {}
        for name, kind in FIELD_TYPES.items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                try:
                    values[name] = kind(raw)
                except ValueError as exc:
                    raise ValueError(f"{ENV_PREFIX}{name.upper()}: {exc}") from exc
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + name.upper(): str(value) for name, value in self.as_dict().items()}


FIELD_TYPES: dict[str, type] = {
    "fail_rate": float,
    "timeout_after_commit_rate": float,
    "reset_rate": float,
    "reset_phase": str,
    "latency_ms": float,
    "hang_seconds": float,
    "seed": int,
}


def _coerce_json(name: str, value: Any) -> Any:
    kind = FIELD_TYPES[name]
    # bool is an int in Python but never a sensible rate, latency or seed.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a {kind.__name__}")
    if kind is float and isinstance(value, int | float):
        return float(value)
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__}")
    return value


@dataclass(frozen=True)
class Decision:
    """The fault drawn for one POST, with the settings in force when it arrived."""

    fault: Fault
    settings: FaultSettings


class FaultInjector:
    """Holds the current settings and the seeded generator the draws come from."""

    def __init__(self, settings: FaultSettings) -> None:
        self.settings = settings
        self._random = random.Random(settings.seed)

    def configure(self, settings: FaultSettings, *, reseed: bool) -> None:
        self.settings = settings
        if reseed:
            self._random.seed(settings.seed)

    def draw(self) -> Decision:
        settings = self.settings
        point = self._random.random()
        if point < settings.fail_rate:
            fault = Fault.FAIL
        elif point < settings.fail_rate + settings.reset_rate:
            fault = Fault.RESET
        elif point < settings.fail_rate + settings.reset_rate + settings.timeout_after_commit_rate:
            fault = Fault.TIMEOUT_AFTER_COMMIT
        else:
            fault = Fault.NONE
        return Decision(fault, settings)
