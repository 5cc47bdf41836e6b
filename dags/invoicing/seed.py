"""Create the example schema and generate orders, deterministically.

    python dags/invoicing/seed.py --dsn "postgresql://postgres@127.0.0.1/jobs" \\
        --from 2026-10-01 --to 2026-10-07 --orders 1287 --seed 42

The same arguments always give the same orders (ids, stores, amounts): a date's orders
depend only on the seed and the date, so seeding a wider range later adds, never changes.
Existing orders are left alone (ON CONFLICT DO NOTHING).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg

if __package__ in (None, ""):  # run as a script: make `invoicing` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from invoicing import ensure_example_schema, queries

STORES = 25


def order_rows(
    day: dt.date, count: int, seed: int
) -> Iterator[tuple[int, int, int, int, str, dt.date]]:
    """The orders shipped on ``day``: ids are YYYYMMDD * 10^7 + n, so they never collide."""
    rng = random.Random(f"{seed}:{day.isoformat()}")
    base = int(day.strftime("%Y%m%d")) * 10_000_000
    for n in range(1, count + 1):
        yield (
            base + n,
            rng.randint(1, STORES),
            rng.randint(1, 50_000),
            rng.randint(500, 250_000),
            "EUR",
            day,
        )


def seed_orders(
    conn: psycopg.Connection, start: dt.date, end: dt.date, per_day: int, seed: int
) -> int:
    """Insert ``per_day`` orders for every date in [start, end]; return how many were new."""
    if end < start:
        raise ValueError(f"--to {end} is before --from {start}")
    if per_day < 0:
        raise ValueError("--orders must be >= 0")
    ensure_example_schema(conn)
    created = 0
    day = start
    while day <= end:
        with conn.transaction():
            conn.execute(
                "CREATE TEMP TABLE IF NOT EXISTS staging_orders (LIKE orders INCLUDING DEFAULTS)"
                " ON COMMIT DELETE ROWS"
            )
            columns = "order_id, store_id, customer_id, amount_cents, currency, shipped_on"
            with conn.cursor().copy(f"COPY staging_orders ({columns}) FROM STDIN") as copy:
                for row in order_rows(day, per_day, seed):
                    copy.write_row(row)
            created += conn.execute(queries()["seed_orders_from_staging"]).rowcount
        day += dt.timedelta(days=1)
    return created


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="libpq DSN or URI of the job database")
    parser.add_argument(
        "--from", dest="start", required=True, type=dt.date.fromisoformat, help="YYYY-MM-DD"
    )
    parser.add_argument(
        "--to", dest="end", type=dt.date.fromisoformat, help="YYYY-MM-DD (default: --from)"
    )
    parser.add_argument("--orders", type=int, default=1287, help="orders per day (default 1287)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        created = seed_orders(conn, args.start, args.end or args.start, args.orders, args.seed)
    span = f"{args.start} .. {args.end or args.start}"
    print(f"{created} new orders ({args.orders} per day, {span}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
