"""Start the example accounting service as a real subprocess, for tests, the demo and benchmarks.

    with run_accounting_service(dsn, fail_rate=0.1) as service:
        httpx.post(service.url + "/api/invoices", ...)
        assert service.stats()["invoices"] == ...

The service runs in its own process group, so stopping it also stops its workers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

import httpx

from accounting_service.faults import FIELD_TYPES as FAULT_FIELDS

START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 5.0
_READY_LINE = re.compile(r"accounting service listening on (http://\S+)")


class AccountingServiceError(RuntimeError):
    """The service did not start, with what it wrote to stderr."""


class AccountingService:
    """A running service: its URL and process, and a client for its API."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, stderr: IO[bytes]) -> None:
        self.process = process
        self.url = url
        self._stderr = stderr
        self._final_stderr: str | None = None
        # trust_env=False: a proxy from the environment must not see local traffic.
        self.client = httpx.Client(base_url=url, timeout=30.0, trust_env=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """Change fault settings at run time; fields not given keep their value."""
        _check_fault_names(faults)
        settings: dict[str, Any] = self._json(self.client.put("/admin/faults", json=faults))
        return settings

    def stats(self) -> dict[str, Any]:
        """``GET /api/stats``; with several workers the counts may lag by 0.1 s."""
        stats: dict[str, Any] = self._json(self.client.get("/api/stats"))
        return stats

    def invoices(self, key_prefix: str = "", *, page_size: int = 1000) -> list[dict[str, Any]]:
        """Every invoice whose idempotency key starts with ``key_prefix``, in key order."""
        items: list[dict[str, Any]] = []
        params: dict[str, Any] = {"key_prefix": key_prefix, "limit": page_size}
        while True:
            page = self._json(self.client.get("/api/invoices", params=params))
            items.extend(page["items"])
            if page["next_after"] is None:
                return items
            params["after"] = page["next_after"]

    def kill(self) -> None:
        """SIGKILL the service and its workers: a crash, with no shutdown at all."""
        _signal_group(self.process, signal.SIGKILL)
        self.process.wait()

    def stderr_text(self) -> str:
        """What the service has written to stderr so far (or in all, once it has stopped)."""
        if self._final_stderr is not None:
            return self._final_stderr
        return _read_all(self._stderr)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it is still there after 5 s."""
        self.client.close()
        _signal_group(self.process, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        # Also when the leader is gone: a worker that ignored SIGTERM must not linger.
        _signal_group(self.process, signal.SIGKILL)
        self.process.wait()
        self._final_stderr = _read_all(self._stderr)

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        response.raise_for_status()
        return response.json()


@contextlib.contextmanager
def run_accounting_service(
    dsn: str,
    *,
    port: int | None = None,
    workers: int = 1,
    host: str = "127.0.0.1",
    **faults: Any,
) -> Iterator[AccountingService]:
    """Run ``python -m accounting_service`` against ``dsn`` until the block ends (listening on
    ``host``: another address than loopback lets a worker in a network namespace reach it).

    ``faults`` are start-up fault settings (``fail_rate=0.5``, ``seed=7``, ...). With
    ``port=None`` the service binds a free port itself and reports it, so there is no
    race with other processes picking ports.
    """
    _check_fault_names(faults)
    command = [sys.executable, "-m", "accounting_service", "--dsn", dsn]
    command += ["--port", str(0 if port is None else port), "--workers", str(workers)]
    command += ["--host", host]
    for name, value in faults.items():
        command += ["--" + name.replace("_", "-"), str(value)]
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        # Files rather than pipes: nobody reads a pipe after start-up, and a full pipe
        # would block the service the next time it logs.
        process = subprocess.Popen(
            command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
        )
        service = None
        try:
            url = _wait_until_ready(process, stdout, stderr)
            service = AccountingService(process, url, stderr)
            yield service
        finally:
            if service is not None:
                service.stop()
            else:
                _signal_group(process, signal.SIGKILL)
                process.wait()


def _wait_until_ready(
    process: subprocess.Popen[bytes], stdout: IO[bytes], stderr: IO[bytes]
) -> str:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AccountingServiceError(
                f"the accounting service exited with status {process.returncode} before it "
                f"was ready; its stderr:\n{_read_all(stderr)}"
            )
        if url is None:
            match = _READY_LINE.search(_read_all(stdout))
            url = match.group(1) if match else None
        if url is not None and _healthy(url):
            return url
        time.sleep(0.05)
    raise AccountingServiceError(
        f"the accounting service was not ready after {START_TIMEOUT_SECONDS:.0f} s; "
        f"its stderr:\n{_read_all(stderr)}"
    )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2.0, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def _read_all(file: IO[bytes]) -> str:
    # pread leaves the offset alone: the child shares it and keeps appending there.
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # start_new_session made the service the leader of a group whose id is its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _check_fault_names(faults: dict[str, Any]) -> None:
    unknown = sorted(set(faults) - set(FAULT_FIELDS))
    if unknown:
        raise TypeError(f"unknown fault setting(s): {', '.join(unknown)}")
