"""Chaos: seeded, overlapping actions and faults against the real stack (``python3 dev.py chaos``)."""

from devtools.chaos.run import FIRST_DATE, Chaos, Event, main, parser, phase_dates

__all__ = ["FIRST_DATE", "Chaos", "Event", "main", "parser", "phase_dates"]
