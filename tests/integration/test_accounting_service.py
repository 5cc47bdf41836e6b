"""The example accounting service, run as a real process against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from accounting_service.store import ensure_schema
from devtools.accounting import AccountingService, AccountingServiceError, run_accounting_service

INVOICE = {"customer": "ACME", "lines": [{"sku": "widget", "qty": 3, "unit_cents": 1250}]}


@pytest.fixture
def service(pg_dsn: str) -> Iterator[AccountingService]:
    with run_accounting_service(pg_dsn) as running:
        yield running


def post(client: httpx.Client, key: str | None, body: Any = INVOICE, **kw: Any) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post("/api/invoices", json=body, headers=headers, **kw)


def test_replay_returns_the_first_response(service: AccountingService) -> None:
    """The same key with the same body replays the first 201 and stores one invoice."""
    first = post(service.client, "inv-1")
    # Same content, other key order: the comparison is on canonical JSON.
    again = post(service.client, "inv-1", dict(reversed(list(INVOICE.items()))))

    assert first.status_code == again.status_code == 201
    assert first.json() == {
        "reference": "ACC-000001",
        "idempotency_key": "inv-1",
        "invoice": INVOICE,
    }
    assert again.content == first.content
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert service.stats() == {
        "invoices": 1,
        "requests": 2,
        "replays": 1,
        "conflicts": 0,
        "faults_injected": {"fail": 0, "reset": 0, "timeout_after_commit": 0},
    }


def test_same_key_with_another_body_is_a_conflict(service: AccountingService) -> None:
    """Reusing a key with a different body is a 422 idempotency_error that stores nothing."""
    assert post(service.client, "inv-1").status_code == 201

    conflict = post(service.client, "inv-1", {**INVOICE, "customer": "Globex"})

    assert conflict.status_code == 422
    assert conflict.json()["error"]["type"] == "idempotency_error"
    assert [i["invoice"]["customer"] for i in service.invoices()] == ["ACME"]
    assert service.stats()["conflicts"] == 1


INVALID_POSTS = [
    ({}, b"{}", "Idempotency-Key"),
    ({"Idempotency-Key": ""}, b"{}", "Idempotency-Key"),
    ({"Idempotency-Key": "k" * 256}, b"{}", "Idempotency-Key"),
    ({"Idempotency-Key": "k"}, b"{not json", "valid JSON"),
    ({"Idempotency-Key": "k"}, b'{"amount": NaN}', "valid JSON"),
    ({"Idempotency-Key": "k"}, b"[1, 2]", "JSON object"),
]


def test_invalid_requests_are_400(service: AccountingService) -> None:
    """A missing, empty or over-long key, or a body that is not a JSON object, is a 400."""
    for headers, content, message in INVALID_POSTS:
        response = service.client.post("/api/invoices", content=content, headers=headers)

        assert response.status_code == 400, (headers, content)
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert message in response.json()["error"]["message"]
    assert service.stats()["invoices"] == 0


def test_key_of_255_characters_is_accepted(service: AccountingService) -> None:
    """The longest allowed key, 255 characters, creates an invoice."""
    assert post(service.client, "k" * 255).status_code == 201


def test_lookup_by_reference_and_by_key(service: AccountingService) -> None:
    """An invoice can be read back by its reference and by its exact key, and 404s otherwise."""
    reference = post(service.client, "inv-1").json()["reference"]

    by_reference = service.client.get(f"/api/invoices/{reference}")
    by_key = service.client.get("/api/invoices", params={"idempotency_key": "inv-1"})

    assert by_reference.status_code == 200
    assert by_reference.json()["invoice"] == INVOICE
    assert by_key.json() == [by_reference.json()]
    assert service.client.get("/api/invoices", params={"idempotency_key": "nope"}).json() == []
    for missing in ("ACC-000002", "ACC-1", "INV-000001"):
        assert service.client.get(f"/api/invoices/{missing}").status_code == 404


def test_concurrent_requests_with_one_key_create_one_invoice(service: AccountingService) -> None:
    """Fifty simultaneous POSTs with the same key create exactly one invoice."""

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=service.url, limits=limits, timeout=30) as client:
            requests = [
                client.post("/api/invoices", json=INVOICE, headers={"Idempotency-Key": "same"})
                for _ in range(50)
            ]
            return await asyncio.gather(*requests)

    responses = asyncio.run(fire())

    assert {r.status_code for r in responses} == {201}
    assert len({r.content for r in responses}) == 1
    assert sum("idempotent-replayed" not in r.headers for r in responses) == 1
    stats = service.stats()
    assert (stats["invoices"], stats["requests"], stats["replays"]) == (1, 50, 49)


def logged_requests(dsn: str) -> list[tuple[str, str, bool]]:
    """accounting.requests as (key, outcome, whether an invoice is named), in arrival order."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT idempotency_key, outcome, invoice_id IS NOT NULL FROM accounting.requests"
            " ORDER BY id"
        ).fetchall()


def test_every_post_is_logged_by_key_with_its_outcome(
    service: AccountingService, pg_dsn: str
) -> None:
    """Each POST leaves one accounting.requests row (key, outcome, the invoice it created or
    replayed, when it came in): new, replayed, conflicting and invalid requests alike."""
    import psycopg

    assert post(service.client, "inv-1").status_code == 201
    assert post(service.client, "inv-1").status_code == 201
    assert post(service.client, "inv-1", {"other": 1}).status_code == 422
    assert post(service.client, None).status_code == 400
    assert logged_requests(pg_dsn) == [
        ("inv-1", "created", True),
        ("inv-1", "replayed", True),
        ("inv-1", "conflict", True),
        ("", "invalid", False),
    ]
    with psycopg.connect(pg_dsn) as conn:
        ordered = conn.execute(
            "SELECT bool_and(received_at <= answered_at AND answered_at <= clock_timestamp())"
            " FROM accounting.requests"
        ).fetchone()
    assert ordered == (True,)


def test_concurrent_posts_of_one_key_are_each_logged_once(
    service: AccountingService, pg_dsn: str
) -> None:
    """Fifty simultaneous POSTs of one key leave fifty request rows: one created, 49 replays
    (also those that found the key only with a second statement)."""

    async def fire() -> None:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=service.url, limits=limits, timeout=30) as client:
            await asyncio.gather(
                *(
                    client.post("/api/invoices", json=INVOICE, headers={"Idempotency-Key": "k"})
                    for _ in range(50)
                )
            )

    asyncio.run(fire())
    logged = logged_requests(pg_dsn)
    assert sorted(outcome for _, outcome, _ in logged) == ["created"] + ["replayed"] * 49
    assert all(named for _, _, named in logged)


def test_injected_faults_are_logged_as_requests(pg_dsn: str) -> None:
    """A POST answered 503 or reset before anything is stored still counts as a request
    that reached the remote (outcome fail, reset_before_commit)."""
    with run_accounting_service(pg_dsn, fail_rate=1) as service:
        assert post(service.client, "inv-1").status_code == 503
        service.set_faults(fail_rate=0, reset_rate=1, reset_phase="before_commit")
        with pytest.raises(httpx.TransportError):
            post(service.client, "inv-2")
    assert logged_requests(pg_dsn) == [
        ("inv-1", "fail", False),
        ("inv-2", "reset_before_commit", False),
    ]


def test_fail_rate_answers_503_before_storing_anything(pg_dsn: str) -> None:
    """With fail_rate=1 (a start-up flag) every POST is a 503 and nothing is stored."""
    with run_accounting_service(pg_dsn, fail_rate=1) as service:
        responses = [post(service.client, f"inv-{i}") for i in range(5)]

        assert {r.status_code for r in responses} == {503}
        assert responses[0].json()["error"]["type"] == "service_unavailable"
        stats = service.stats()
        assert (stats["invoices"], stats["requests"]) == (0, 5)
        assert stats["faults_injected"]["fail"] == 5


def test_timeout_after_commit_keeps_the_invoice_and_the_retry_replays_it(
    service: AccountingService,
) -> None:
    """A client that times out on a committed POST finds the invoice, and its retry replays it."""
    service.set_faults(timeout_after_commit_rate=1, hang_seconds=2)

    with pytest.raises(httpx.ReadTimeout):
        post(service.client, "inv-1", timeout=0.5)

    stored = service.client.get("/api/invoices", params={"idempotency_key": "inv-1"}).json()
    assert len(stored) == 1
    service.set_faults(timeout_after_commit_rate=0)
    retry = post(service.client, "inv-1")
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["reference"] == stored[0]["reference"]
    stats = service.stats()
    assert (stats["invoices"], stats["faults_injected"]["timeout_after_commit"]) == (1, 1)


@pytest.mark.parametrize("phase", ["after_commit", "before_commit"])
def test_reset_drops_the_connection_without_a_response(
    service: AccountingService, phase: str
) -> None:
    """A reset is a connection error for the client, with the invoice stored only after commit."""
    service.set_faults(reset_rate=1, reset_phase=phase)

    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        post(service.client, "inv-1")

    stored = service.client.get("/api/invoices", params={"idempotency_key": "inv-1"}).json()
    assert len(stored) == (1 if phase == "after_commit" else 0)
    service.set_faults(reset_rate=0)
    retry = post(service.client, "inv-1")
    assert retry.status_code == 201
    assert ("idempotent-replayed" in retry.headers) == (phase == "after_commit")
    stats = service.stats()
    assert (stats["invoices"], stats["faults_injected"]["reset"]) == (1, 1)


def test_latency_is_added_to_posts(service: AccountingService) -> None:
    """latency_ms delays every POST by at least that long."""
    service.set_faults(latency_ms=300)

    started = time.monotonic()
    response = post(service.client, "inv-1")

    assert response.status_code == 201
    assert time.monotonic() - started >= 0.3


def test_seed_makes_the_faults_reproducible(service: AccountingService) -> None:
    """The same seed gives the same sequence of faults for the same sequence of POSTs."""

    def statuses(batch: str) -> list[int]:
        return [post(service.client, f"{batch}-{i}").status_code for i in range(20)]

    service.set_faults(fail_rate=0.5, seed=42)
    first = statuses("a")
    service.set_faults(seed=42)
    second = statuses("b")

    assert first == second
    assert set(first) == {201, 503}


def test_admin_faults_rejects_invalid_settings(service: AccountingService) -> None:
    """Unknown fields, wrong types and rates summing above 1 are a 400 and change nothing."""
    before = service.client.get("/admin/faults").json()
    for body in ({"nope": 1}, {"fail_rate": "high"}, {"fail_rate": 0.6, "reset_rate": 0.6}):
        assert service.client.put("/admin/faults", json=body).status_code == 400
    assert service.client.get("/admin/faults").json() == before


def test_faults_can_come_from_the_environment(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACCOUNTING_* environment variables set the start-up fault settings."""
    monkeypatch.setenv("ACCOUNTING_RESET_RATE", "0.25")
    monkeypatch.setenv("ACCOUNTING_SEED", "7")
    with run_accounting_service(pg_dsn) as service:
        faults = service.client.get("/admin/faults").json()

    assert (faults["reset_rate"], faults["seed"], faults["fail_rate"]) == (0.25, 7, 0.0)


def test_key_prefix_pagination_walks_every_page(service: AccountingService) -> None:
    """Keyset pagination by key prefix returns every matching invoice once, in key order."""
    keys = [f"run_a/{i:04d}" for i in range(25)]
    # Would match if "_" were a LIKE wildcard, or if the prefix were not anchored.
    decoys = ["runXa/0001", "run_b/0001", "x-run_a/0001"]
    for key in keys + decoys:
        assert post(service.client, key).status_code == 201

    pages: list[list[str]] = []
    params: dict[str, str | int] = {"key_prefix": "run_a/", "limit": 10}
    while True:
        page = service.client.get("/api/invoices", params=params).json()
        pages.append([item["idempotency_key"] for item in page["items"]])
        if page["next_after"] is None:
            break
        params["after"] = page["next_after"]

    assert [len(p) for p in pages] == [10, 10, 5]
    assert [key for page in pages for key in page] == keys
    assert [i["idempotency_key"] for i in service.invoices("run_a/", page_size=7)] == keys
    assert service.client.get("/api/invoices", params={"limit": 10_001}).status_code == 400


def test_two_instances_starting_at_once_share_one_schema(pg_dsn: str) -> None:
    """Two services started at the same moment on one empty database both come up and share data."""
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:

        def start() -> AccountingService:
            manager = run_accounting_service(pg_dsn)
            service = manager.__enter__()
            stack.push(manager.__exit__)
            return service

        first, second = pool.map(lambda _: start(), range(2))

        reference = post(first.client, "inv-1").json()["reference"]
        replay = post(second.client, "inv-1")
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["reference"] == reference


def test_schema_creation_is_safe_under_heavy_concurrency(pg_dsn: str) -> None:
    """Eight simultaneous schema creations on an empty database all succeed."""

    async def create_all() -> None:
        await asyncio.gather(*(ensure_schema(pg_dsn) for _ in range(8)))

    asyncio.run(create_all())


def test_workers_share_fault_settings_and_stats(pg_dsn: str) -> None:
    """With two workers a fault change reaches both, and the stats count the POSTs of both."""
    sent = 0

    def statuses_over_new_connections(url: str, count: int) -> set[int]:
        nonlocal sent
        sent += count
        # A connection per request lets the kernel hand the requests to either worker.
        return {
            httpx.post(
                url + "/api/invoices", json=INVOICE, headers={"Idempotency-Key": f"k{i}"}
            ).status_code
            for i in range(count)
        }

    with run_accounting_service(pg_dsn, workers=2) as service:
        service.set_faults(fail_rate=1)
        # The other worker hears of the change through LISTEN/NOTIFY, a moment later.
        assert _eventually(lambda: statuses_over_new_connections(service.url, 20) == {503})
        # Each worker adds its counts to the database every 0.1 s.
        assert _eventually(lambda: service.stats()["requests"] == sent)
        stats = service.stats()
        assert stats["invoices"] == 0
        assert stats["faults_injected"]["fail"] == sent


def _eventually(check: Callable[[], bool], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigterm_stops_the_service_cleanly(pg_dsn: str) -> None:
    """On SIGTERM the service shuts down gracefully and exits with status 0."""
    with run_accounting_service(pg_dsn) as service:
        post(service.client, "inv-1")

    assert service.process.returncode == 0
    assert "Traceback" not in service.stderr_text()


def test_kill_crashes_the_service(service: AccountingService) -> None:
    """kill() ends the service at once, with SIGKILL."""
    service.kill()

    assert service.process.returncode == -9
    with pytest.raises(httpx.ConnectError):
        httpx.get(service.url + "/healthz")


def test_start_failure_reports_the_service_stderr() -> None:
    """A service that cannot reach its database fails to start with its stderr in the error."""
    unreachable = "host=127.0.0.1 port=1 user=postgres dbname=nope connect_timeout=2"
    with (
        pytest.raises(AccountingServiceError, match="connection"),
        run_accounting_service(unreachable),
    ):
        pass
