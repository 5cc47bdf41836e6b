"""The ledger's HTTP senders, on httpx: :func:`post_json` and :func:`webhook`.

:func:`post_json` is the deduplicating JSON POST the example uses
(:meth:`~airflow_idempotency.ledger.OutboundLedger.send_all` wraps such a call in an
:class:`HttpSender` of its ``base_url``); :func:`webhook` is a JSON POST to a hook,
deduplicating or not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from airflow_idempotency.exceptions import (
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.senders import Confirmation, Effect, EffectSender

Sender = Callable[[httpx.AsyncClient, Effect], Awaitable[Confirmation]]
"""One HTTP call of an effect on a client: what :func:`post_json` returns."""


def post_json(path: str, *, reference_field: str = "reference") -> Sender:
    """A sender that POSTs the request as JSON with an ``Idempotency-Key`` header.

    For a remote that deduplicates by that key. 2xx confirms (``reference_field`` of the
    JSON answer is the remote reference; an ``Idempotent-Replayed: true`` header, as Stripe
    and the example service send, marks a replay of an earlier answer);
    408, 409 (the same key is in flight), 425, 429 and 5xx are transient; any other 4xx
    is permanent. Timeouts and connection errors are transient.
    """

    async def send(client: httpx.AsyncClient, effect: Effect) -> Confirmation:
        try:
            response = await client.post(
                path, json=effect.request, headers={"Idempotency-Key": effect.idempotency_key}
            )
        except httpx.TransportError as exc:  # timeouts, resets, refused connections
            raise TransientRemoteError(f"{type(exc).__name__}: {exc}", unreachable=True) from exc
        status = response.status_code
        if 200 <= status < 300:
            body = response.json()
            replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
            return Confirmation(str(body[reference_field]), body, replayed)
        detail = f"HTTP {status}: {response.text[:300]}"
        if status in (408, 409, 425, 429) or status >= 500:
            raise TransientRemoteError(detail)
        raise PermanentRemoteError(detail)

    return send


def _post_hook(path: str, deduplicating: bool) -> Sender:
    """A JSON POST of the request to a hook; the answer's body is not read.

    Deduplicating: every transport error and 408/409/425/429/5xx is transient (sent again
    with the same key). Not deduplicating: an error is "not delivered" only when the hook
    cannot have acted (no connection; 408, 429, 503: it says it did not process the
    request); a lost answer or another 5xx may hide a delivery: unknown.
    """

    async def send(client: httpx.AsyncClient, effect: Effect) -> Confirmation:
        headers = {"Idempotency-Key": effect.idempotency_key}
        try:
            response = await client.post(path, json=effect.request, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise TransientRemoteError(f"{type(exc).__name__}: {exc}", unreachable=True) from exc
        except httpx.TransportError as exc:  # sent, maybe acted on, answer lost
            error = OutcomeUnknownError if not deduplicating else TransientRemoteError
            raise error(
                f"{type(exc).__name__} after the request was sent: {exc}", unreachable=True
            ) from exc
        status = response.status_code
        if 200 <= status < 300:
            return Confirmation(response.headers.get("x-request-id") or f"HTTP {status}")
        detail = f"HTTP {status}: {response.text[:300]}"
        if status in (408, 429, 503) or (deduplicating and (status in (409, 425) or status >= 500)):
            raise TransientRemoteError(detail)
        if status >= 500:
            raise OutcomeUnknownError(detail)
        raise PermanentRemoteError(detail)

    return send


class HttpSender(EffectSender[httpx.AsyncClient]):
    """Effects as HTTP calls (``call``, e.g. :func:`post_json`) to ``base_url``.

    Each connection is an ``httpx.AsyncClient`` of one connection: one client with N
    connections costs O(N) per request (httpcore 1.0 checks every connection it holds
    whenever a request starts or ends; at 32 calls in flight a shared client was ~3x slower,
    see BENCHMARKS.md). Clients share one SSL context: building one loads the CA bundle,
    ~10-120 ms.
    """

    def __init__(
        self,
        base_url: str,
        call: Sender,
        *,
        timeout: float = 10.0,
        deduplicating: bool = True,
        kind: str = "http",
        concurrency: int | None = None,
    ) -> None:
        self.base_url = base_url
        self.target = base_url
        self.call = call
        self.timeout = timeout
        self.deduplicating = deduplicating
        self.kind = kind
        self.concurrency = concurrency
        self._ssl_context: Any = None

    async def connect(self) -> httpx.AsyncClient:
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()  # what each client would build
        return httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            verify=self._ssl_context,
        )

    async def disconnect(self, connection: httpx.AsyncClient) -> None:
        await connection.aclose()

    async def discard(self, connection: httpx.AsyncClient) -> None:
        # An httpx client survives transport errors (it drops the broken connection itself):
        # closing it would only cost a new client and SSL set-up.
        await self.disconnect(connection)

    async def send(self, connection: httpx.AsyncClient, effect: Effect) -> Confirmation:
        return await self.call(connection, effect)


def webhook(
    url: str,
    *,
    deduplicating: bool = False,
    timeout: float = 10.0,
    concurrency: int | None = None,
) -> HttpSender:
    """A JSON POST of each effect's request to ``url``, with an ``Idempotency-Key`` header.

    ``deduplicating=False`` (the default: Slack's and most chat webhooks cannot tell a
    resend) keeps at most once: a lost answer or a 5xx other than 503 leaves the effect
    ``unknown``. ``deduplicating=True`` for a hook that honours the header: it is then sent
    again on doubt, as :func:`post_json` does. A 2xx confirms; the reference is the answer's
    ``X-Request-Id`` header, if any.
    """
    parsed = httpx.URL(url)
    base_url = str(parsed.copy_with(raw_path=b"/", query=None, fragment=None)).rstrip("/")
    path = parsed.raw_path.decode() or "/"
    call = _post_hook(path, deduplicating)
    sender = HttpSender(
        base_url, call, timeout=timeout, deduplicating=deduplicating, kind="webhook",
        concurrency=concurrency,
    )  # fmt: skip
    sender.target = url
    return sender
