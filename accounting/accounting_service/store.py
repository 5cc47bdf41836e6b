"""PostgreSQL access for the accounting service: schema, invoices, counters, fault fan-out.

Pool connections run in autocommit mode: an insert is then one round trip, with no
BEGIN/COMMIT of its own. All statements are constants with bound parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same for every instance of the service.
SCHEMA_LOCK_KEY = 0x6163_636F_756E_7473  # "accounts"
FAULTS_CHANNEL = "accounting_faults"
_LISTEN = "LISTEN accounting_faults"

_LOCK_SCHEMA = "SELECT pg_advisory_xact_lock(%s)"

# One round trip inserts a new invoice or returns the stored one for a known key, and
# counts the request (accounting.requests) in the same statement. The NOT EXISTS spares
# an identity value on a plain retry, so retries leave no gaps in the references; ON
# CONFLICT covers an insert of the same key running concurrently.
_CREATE_OR_GET = """
WITH inserted AS (
    INSERT INTO accounting.invoices (idempotency_key, request_hash, invoice)
    SELECT %(key)s, %(hash)s, %(invoice)s::json
    WHERE NOT EXISTS (SELECT FROM accounting.invoices WHERE idempotency_key = %(key)s)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id, idempotency_key, request_hash, invoice, created_at
),
found AS (
    SELECT id, idempotency_key, request_hash, invoice, created_at, true AS created
    FROM inserted
    UNION ALL
    SELECT id, idempotency_key, request_hash, invoice, created_at, false
    FROM accounting.invoices
    WHERE idempotency_key = %(key)s AND NOT EXISTS (SELECT FROM inserted)
),
counted AS (
    INSERT INTO accounting.requests (idempotency_key, received_at, outcome, invoice_id, instance_id)
    SELECT %(key)s, %(received_at)s,
           CASE WHEN f.created THEN 'created'
                WHEN f.request_hash = %(hash)s THEN 'replayed'
                ELSE 'conflict' END,
           f.id, %(instance)s
    FROM found AS f
)
SELECT id, idempotency_key, request_hash, invoice, created_at, created FROM found
"""

# The same key inserted concurrently, after _CREATE_OR_GET took its snapshot: the stored
# row, and the request counted, in one statement.
_GET_COUNTED = """
WITH found AS (
    SELECT id, idempotency_key, request_hash, invoice, created_at
    FROM accounting.invoices WHERE idempotency_key = %(key)s
),
counted AS (
    INSERT INTO accounting.requests (idempotency_key, received_at, outcome, invoice_id, instance_id)
    SELECT %(key)s, %(received_at)s,
           CASE WHEN f.request_hash = %(hash)s THEN 'replayed' ELSE 'conflict' END,
           f.id, %(instance)s
    FROM found AS f
)
SELECT id, idempotency_key, request_hash, invoice, created_at FROM found
"""

# A request answered without deciding anything (an injected 503 or reset, a bad request).
_COUNT_REQUEST = """
INSERT INTO accounting.requests (idempotency_key, received_at, outcome, instance_id)
VALUES (%(key)s, %(received_at)s, %(outcome)s, %(instance)s)
"""

_BY_KEY = """
SELECT id, idempotency_key, request_hash, invoice, created_at
FROM accounting.invoices WHERE idempotency_key = %s
"""
_BY_ID = """
SELECT id, idempotency_key, request_hash, invoice, created_at
FROM accounting.invoices WHERE id = %s
"""
_PAGE = """
SELECT id, idempotency_key, request_hash, invoice, created_at
FROM accounting.invoices
WHERE idempotency_key LIKE %(pattern)s AND idempotency_key > %(after)s
ORDER BY idempotency_key
LIMIT %(limit)s
"""
_COUNT_INVOICES = "SELECT count(*) FROM accounting.invoices"

_ADD_COUNTERS = """
INSERT INTO accounting.request_counters AS c (instance_id, worker_pid, name, value)
SELECT %(instance)s, %(pid)s, name, value
FROM unnest(%(names)s::text[], %(values)s::bigint[]) AS t(name, value)
ON CONFLICT (instance_id, worker_pid, name) DO UPDATE SET value = c.value + excluded.value
"""
_SUM_COUNTERS = """
SELECT name, sum(value)::bigint AS value FROM accounting.request_counters
WHERE instance_id = %s GROUP BY name
"""
_NOTIFY = "SELECT pg_notify(%s, %s)"


@dataclass(frozen=True)
class ReceivedRequest:
    """When a POST came in (the service's clock) and which instance of the service took it."""

    at: datetime
    instance_id: str


@dataclass(frozen=True)
class Invoice:
    id: int
    idempotency_key: str
    request_hash: str
    invoice: Any
    created_at: datetime

    @property
    def reference(self) -> str:
        return format_reference(self.id)


def format_reference(invoice_id: int) -> str:
    return f"ACC-{invoice_id:06d}"


def parse_reference(reference: str) -> int | None:
    """The id behind a reference, or None unless it is exactly how we format one."""
    digits = reference.removeprefix("ACC-")
    # 18 digits always fit a bigint; anything longer is no reference of ours anyway.
    if digits == reference or len(digits) > 18 or not (digits.isascii() and digits.isdigit()):
        return None
    invoice_id = int(digits)
    return invoice_id if format_reference(invoice_id) == reference else None


def escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


async def ensure_schema(dsn: str) -> None:
    """Create the schema and tables if missing; safe to run from many processes at once."""
    ddl = resources.files(__package__).joinpath("schema.sql").read_text(encoding="utf-8")
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await conn.execute(_LOCK_SCHEMA, (SCHEMA_LOCK_KEY,))
        # No parameters: psycopg may then send the whole file as one multi-statement query.
        await conn.execute(ddl, prepare=False)


class Store:
    """Invoices and counters over a small pool of autocommit connections."""

    def __init__(self, dsn: str, pool_size: int) -> None:
        self.dsn = dsn
        self.pool = AsyncConnectionPool(
            dsn,
            connection_class=AsyncConnection[DictRow],
            min_size=pool_size,
            max_size=pool_size,
            kwargs={"autocommit": True, "row_factory": dict_row},
            open=False,
            name="accounting",
            # How long a request waits for a connection before it gets a 503.
            timeout=10,
        )

    async def open(self) -> None:
        await self.pool.open(wait=True, timeout=30)

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("SELECT 1")

    async def create_invoice(
        self, key: str, request_hash: str, invoice_json: str, received: ReceivedRequest
    ) -> tuple[Invoice, bool]:
        """Insert the invoice unless the key exists; return the stored row and whether it is
        new. The request is counted in accounting.requests by the same statement."""
        params = {
            "key": key,
            "hash": request_hash,
            "invoice": invoice_json,
            "received_at": received.at,
            "instance": received.instance_id,
        }
        async with self.pool.connection() as conn:
            row = await (await conn.execute(_CREATE_OR_GET, params)).fetchone()
            if row is None:
                # Another request inserted the key after this statement took its snapshot:
                # ON CONFLICT waited for that commit, but only a new statement sees the row.
                row = await (await conn.execute(_GET_COUNTED, params)).fetchone()
                if row is None:  # pragma: no cover - invoices are never deleted
                    raise RuntimeError(f"invoice with idempotency key {key!r} vanished")
                row["created"] = False
        created = row.pop("created")
        return Invoice(**row), created

    async def count_request(self, key: str, received: ReceivedRequest, outcome: str) -> None:
        """Count a request answered before anything was decided for its key."""
        params = {
            "key": key,
            "received_at": received.at,
            "outcome": outcome,
            "instance": received.instance_id,
        }
        async with self.pool.connection() as conn:
            await conn.execute(_COUNT_REQUEST, params)

    async def invoice_by_id(self, invoice_id: int) -> Invoice | None:
        return await self._one(_BY_ID, (invoice_id,))

    async def invoice_by_key(self, key: str) -> Invoice | None:
        return await self._one(_BY_KEY, (key,))

    async def invoice_page(self, key_prefix: str, after: str, limit: int) -> list[Invoice]:
        params = {"pattern": escape_like(key_prefix) + "%", "after": after, "limit": limit}
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(_PAGE, params)).fetchall()
        return [Invoice(**row) for row in rows]

    async def count_invoices(self) -> int:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(_COUNT_INVOICES)).fetchone()
        assert row is not None
        return int(row["count"])

    async def add_counters(self, instance_id: str, counts: Counter[str]) -> None:
        params = {
            "instance": instance_id,
            "pid": os.getpid(),
            "names": list(counts),
            "values": list(counts.values()),
        }
        async with self.pool.connection() as conn:
            await conn.execute(_ADD_COUNTERS, params)

    async def counter_totals(self, instance_id: str) -> dict[str, int]:
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(_SUM_COUNTERS, (instance_id,))).fetchall()
        return {row["name"]: int(row["value"]) for row in rows}

    async def notify_faults(self, payload: dict[str, Any]) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(_NOTIFY, (FAULTS_CHANNEL, json.dumps(payload)))

    async def _one(self, query: str, params: tuple[Any, ...]) -> Invoice | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(query, params)).fetchone()
        return None if row is None else Invoice(**row)


async def listen_for_faults(
    dsn: str, on_payload: Callable[[dict[str, Any]], Awaitable[None]]
) -> None:
    """Pass every fault-settings notification to ``on_payload``, reconnecting forever.

    This is how a ``PUT /admin/faults`` answered by one worker reaches the others.
    """
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute(_LISTEN)
                async for notify in conn.notifies():
                    try:
                        payload = json.loads(notify.payload)
                    except ValueError:
                        log.warning("ignoring a malformed %s notification", FAULTS_CHANNEL)
                        continue
                    await on_payload(payload)
        except psycopg.OperationalError as exc:
            log.warning("fault listener lost its connection (%s); reconnecting in 1 s", exc)
            await asyncio.sleep(1)


class RequestCounters:
    """Per-process counters, added to Postgres in batches so workers can be summed."""

    def __init__(self, store: Store, instance_id: str) -> None:
        self._store = store
        self._instance_id = instance_id
        self._pending: Counter[str] = Counter()
        self._flush_lock = asyncio.Lock()

    def add(self, name: str) -> None:
        self._pending[name] += 1

    async def flush(self) -> None:
        # The lock keeps a stats request from reading the totals while the periodic
        # flush still holds counts it has taken but not yet written.
        async with self._flush_lock:
            batch, self._pending = self._pending, Counter()
            if not batch:
                return
            try:
                await self._store.add_counters(self._instance_id, batch)
            except BaseException:
                self._pending.update(batch)
                raise

    async def flush_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            with contextlib.suppress(psycopg.Error):
                await self.flush()

    async def totals(self) -> dict[str, int]:
        await self.flush()
        return await self._store.counter_totals(self._instance_id)
