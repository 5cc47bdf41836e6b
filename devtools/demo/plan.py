"""The demo's numbers: the example DAG, its jobs, each step's dates and orders."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

DAG_ID = "finalize_invoices"
JOBS = (
    "create_invoices", "rebuild_totals", "export_invoices", "write_export_file",
    "email_finance_summary",
)  # fmt: skip
SEED = 42
FIRST_DATE = dt.date(2026, 10, 1)
RACE_DATE = dt.date(2026, 10, 9)
CRASH_DATE = dt.date(2026, 10, 10)
SLEEP_WHILE_LOCKED = 20  # seconds the winner of the race holds the lock (fault point)
OUTCOMES = ("completed", "noop", "lock_held", "running", "failed", "lock_lost", "dry_run")


@dataclass(frozen=True)
class Plan:
    """The numbers of one demo run."""

    first_orders: int
    week: tuple[dt.date, ...]
    week_orders: int
    race_orders: int
    crash_orders: int
    crash_at: int

    @classmethod
    def build(cls, quick: bool, orders: int | None) -> Plan:
        if quick:
            return cls(orders or 200, _days(dt.date(2026, 10, 2), 3), 30, 40, 120, 70)
        return cls(orders or 1287, _days(dt.date(2026, 10, 2), 7), 200, 200, 300, 120)

    def seeding(self) -> list[tuple[str, dt.date, dt.date, int]]:
        return [
            ("steps 1-2: nightly run, manual rerun", FIRST_DATE, FIRST_DATE, self.first_orders),
            ("step 4: backfill", self.week[0], self.week[-1], self.week_orders),
            ("step 3: two runs at once", RACE_DATE, RACE_DATE, self.race_orders),
            ("step 5: crash mid-export", CRASH_DATE, CRASH_DATE, self.crash_orders),
        ]

    @property
    def all_dates(self) -> list[dt.date]:
        return [FIRST_DATE, *self.week, RACE_DATE, CRASH_DATE]

    @property
    def total_orders(self) -> int:
        return sum(n * ((b - a).days + 1) for _, a, b, n in self.seeding())


def _days(start: dt.date, count: int) -> tuple[dt.date, ...]:
    return tuple(start + dt.timedelta(days=i) for i in range(count))
