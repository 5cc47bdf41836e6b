"""The accounting service's HTTP API: idempotent invoice creation with Stripe-like semantics.

``POST /api/invoices`` stores an invoice once per ``Idempotency-Key``. Repeating the key
with the same body replays the first response (with ``Idempotent-Replayed: true``);
repeating it with another body is a 422 ``idempotency_error``. Faults (failures, lost
answers, dropped connections, latency) are injected on purpose, see ``faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from accounting_service.faults import Fault, FaultInjector, FaultSettings
from accounting_service.server import reset_connection
from accounting_service.settings import ServiceSettings
from accounting_service.store import (
    Invoice,
    ReceivedRequest,
    RequestCounters,
    Store,
    ensure_schema,
    listen_for_faults,
    parse_reference,
)

log = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10_000
MAX_BODY_BYTES = 1024 * 1024
# Starlette refuses larger bodies itself (413) from 1.6 on; Airflow 3.1's FastAPI (0.117)
# pins an older Starlette, which has no such option: there the example service takes any.
BODY_LIMIT = (
    {"max_body_size": MAX_BODY_BYTES}
    if "max_body_size" in inspect.signature(Starlette.__init__).parameters
    else {}
)
COUNTER_FLUSH_SECONDS = 0.1
INJECTED_FAULTS = (Fault.FAIL, Fault.RESET, Fault.TIMEOUT_AFTER_COMMIT)


class AsciiJSONResponse(JSONResponse):
    # ASCII escapes survive anything a client can send, lone surrogates included,
    # which Starlette's UTF-8 rendering would turn into a 500.
    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class DropConnection(Response):
    """Not an answer: resets the TCP connection so the client gets no response at all."""

    def __init__(self) -> None:
        super().__init__(status_code=500)  # never sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reset_connection(scope)
        # Return only once uvicorn has seen the connection go; returning earlier makes it
        # answer the unanswered request with a 500 of its own.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_until_disconnected(receive), timeout=5)


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _hang(seconds: float, receive: Receive) -> None:
    # A client that gave up can never read the answer: stop hanging then, so abandoned
    # requests do not pile up nor hold up a graceful shutdown.
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_until_disconnected(receive), timeout=seconds)


def error(
    status: int, kind: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    return AsciiJSONResponse({"error": {"type": kind, "message": message}}, status, headers)


def invalid_request(message: str) -> Response:
    return error(400, "invalid_request_error", message)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a dict; ``ValueError`` with a client-facing message otherwise."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError("The request body must be valid JSON.") from exc
    if not isinstance(value, dict):
        raise ValueError("The request body must be a JSON object.")
    return value


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON, and Postgres would refuse them.
    raise ValueError(f"{name} is not valid JSON")


def request_hash(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def post_view(invoice: Invoice) -> dict[str, Any]:
    # Built from the stored row both times, so a replay is the first answer byte for byte.
    return {
        "reference": invoice.reference,
        "idempotency_key": invoice.idempotency_key,
        "invoice": invoice.invoice,
    }


def read_view(invoice: Invoice) -> dict[str, Any]:
    return {**post_view(invoice), "created_at": invoice.created_at.isoformat()}


class AccountingService:
    """The routes and the state behind them, for one process."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.store = Store(settings.dsn, settings.pool_size)
        self.counters = RequestCounters(self.store, settings.instance_id)
        self.faults = FaultInjector(settings.faults)

    def asgi_app(self) -> Starlette:
        routes = [
            Route("/api/invoices", self.invoices, methods=["GET", "POST"]),
            Route("/api/invoices/{reference}", self.get_invoice, methods=["GET"]),
            Route("/api/stats", self.stats, methods=["GET"]),
            Route("/admin/faults", self.admin_faults, methods=["GET", "PUT"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]
        handlers: dict[Any, Any] = {
            HTTPException: _http_error,
            psycopg.OperationalError: _database_unavailable,
            PoolTimeout: _database_unavailable,
        }
        return Starlette(
            routes=routes,
            exception_handlers=handlers,
            lifespan=self.lifespan,
            **BODY_LIMIT,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await ensure_schema(self.settings.dsn)
        await self.store.open()
        background = [
            asyncio.create_task(self.counters.flush_every(COUNTER_FLUSH_SECONDS)),
            asyncio.create_task(listen_for_faults(self.settings.dsn, self._on_fault_change)),
        ]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(psycopg.Error, PoolTimeout):
                await self.counters.flush()
            await self.store.close()

    async def invoices(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create_invoice(request)
        return await self.list_invoices(request)

    # -- POST /api/invoices ------------------------------------------------------------

    async def create_invoice(self, request: Request) -> Response:
        received = ReceivedRequest(datetime.now(timezone.utc), self.settings.instance_id)
        key = request.headers.get(IDEMPOTENCY_HEADER, "")
        self.counters.add("requests")
        decision = self.faults.draw()
        settings = decision.settings
        if settings.latency_ms:
            await asyncio.sleep(settings.latency_ms / 1000)
        if decision.fault is not Fault.NONE:
            self.counters.add("fault." + decision.fault.value)
        if decision.fault is Fault.FAIL:
            await self.store.count_request(key, received, "fail")
            return error(
                503, "service_unavailable", "Injected failure: nothing was done, retry later."
            )
        if decision.fault is Fault.RESET and settings.reset_phase == "before_commit":
            await self.store.count_request(key, received, "reset_before_commit")
            # Reading the whole request first means the client is done writing and sees
            # the reset on its read, as "connection reset by peer", every time.
            await request.body()
            return DropConnection()
        response = await self._create_invoice(request, key, received)
        if decision.fault is Fault.RESET:
            return DropConnection()
        if decision.fault is Fault.TIMEOUT_AFTER_COMMIT:
            await _hang(settings.hang_seconds, request.receive)
        return response

    async def _create_invoice(
        self, request: Request, key: str, received: ReceivedRequest
    ) -> Response:
        body = await self._body_or_refusal(request, key)
        if isinstance(body, Response):
            await self.store.count_request(key, received, "invalid")
            return body
        digest = request_hash(body)
        stored = json.dumps(body, separators=(",", ":"))
        invoice, created = await self.store.create_invoice(key, digest, stored, received)
        if created:
            return AsciiJSONResponse(post_view(invoice), 201)
        if invoice.request_hash != digest:
            self.counters.add("conflicts")
            return error(
                422,
                "idempotency_error",
                f"Keys for idempotent requests can only be used with the same body they were "
                f"first used with; {IDEMPOTENCY_HEADER} {key!r} was first used for invoice "
                f"{invoice.reference} with another body.",
            )
        self.counters.add("replays")
        return AsciiJSONResponse(post_view(invoice), 201, {"Idempotent-Replayed": "true"})

    @staticmethod
    async def _body_or_refusal(request: Request, key: str) -> Response | dict[str, Any]:
        """The 400 answer for a request without a usable key or body, else its body."""
        if not key:
            return invalid_request(f"The {IDEMPOTENCY_HEADER} header is required.")
        if len(key) > MAX_KEY_LENGTH:
            return invalid_request(
                f"The {IDEMPOTENCY_HEADER} header must be at most {MAX_KEY_LENGTH} characters."
            )
        try:
            return parse_json_object(await request.body())
        except ValueError as exc:
            return invalid_request(str(exc))

    # -- reads -------------------------------------------------------------------------

    async def get_invoice(self, request: Request) -> Response:
        reference = request.path_params["reference"]
        invoice_id = parse_reference(reference)
        invoice = None if invoice_id is None else await self.store.invoice_by_id(invoice_id)
        if invoice is None:
            return error(404, "not_found", f"No invoice {reference!r}.")
        return AsciiJSONResponse(read_view(invoice))

    async def list_invoices(self, request: Request) -> Response:
        query = request.query_params
        if "idempotency_key" in query:
            if {"key_prefix", "after", "limit"} & set(query):
                return invalid_request(
                    "idempotency_key cannot be combined with key_prefix, after or limit."
                )
            invoice = await self.store.invoice_by_key(query["idempotency_key"])
            return AsciiJSONResponse([] if invoice is None else [read_view(invoice)])
        try:
            limit = int(query.get("limit", DEFAULT_PAGE_SIZE))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_PAGE_SIZE:
            return invalid_request(f"limit must be an integer from 1 to {MAX_PAGE_SIZE}.")
        # One row more than asked tells whether another page exists.
        rows = await self.store.invoice_page(
            query.get("key_prefix", ""), query.get("after", ""), limit + 1
        )
        items = rows[:limit]
        next_after = items[-1].idempotency_key if len(rows) > limit else None
        return AsciiJSONResponse({"items": [read_view(i) for i in items], "next_after": next_after})

    async def stats(self, request: Request) -> Response:
        totals = await self.counters.totals()
        return AsciiJSONResponse(
            {
                "invoices": await self.store.count_invoices(),
                "requests": totals.get("requests", 0),
                "replays": totals.get("replays", 0),
                "conflicts": totals.get("conflicts", 0),
                "faults_injected": {
                    f.value: totals.get("fault." + f.value, 0) for f in INJECTED_FAULTS
                },
            }
        )

    async def healthz(self, request: Request) -> Response:
        await self.store.ping()
        return AsciiJSONResponse({"status": "ok"})

    # -- /admin/faults -----------------------------------------------------------------

    async def admin_faults(self, request: Request) -> Response:
        if request.method == "PUT":
            return await self.put_faults(request)
        return await self.get_faults(request)

    async def get_faults(self, request: Request) -> Response:
        return AsciiJSONResponse(self.faults.settings.as_dict())

    async def put_faults(self, request: Request) -> Response:
        try:
            changes = parse_json_object(await request.body())
            settings = self.faults.settings.updated(changes)
        except ValueError as exc:
            return invalid_request(str(exc))
        reseed = "seed" in changes
        self.faults.configure(settings, reseed=reseed)
        await self.store.notify_faults(
            {
                "instance": self.settings.instance_id,
                "sender": os.getpid(),
                "settings": settings.as_dict(),
                "reseed": reseed,
            }
        )
        return AsciiJSONResponse(settings.as_dict())

    async def _on_fault_change(self, payload: dict[str, Any]) -> None:
        # Every worker of this instance hears the change, the one that made it included.
        if payload.get("instance") != self.settings.instance_id:
            return
        if payload.get("sender") == os.getpid():
            return
        try:
            settings = FaultSettings().updated(payload["settings"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring fault settings notification %r: %s", payload, exc)
            return
        self.faults.configure(settings, reseed=bool(payload.get("reseed")))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error(exc.status_code, kind or "invalid_request_error", str(exc.detail), exc.headers)


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    log.warning("database unavailable: %s", exc)
    return error(503, "service_unavailable", "The database is unavailable; retry later.")


def create_app(settings: ServiceSettings) -> Starlette:
    return AccountingService(settings).asgi_app()


def create_app_from_env() -> Starlette:
    """The uvicorn factory: every worker process builds its app from ``ACCOUNTING_*``."""
    return create_app(ServiceSettings.from_env(os.environ))
