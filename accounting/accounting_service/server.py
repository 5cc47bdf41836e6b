"""Running the accounting service under uvicorn, with the hooks the faults need.

Three things uvicorn does not offer out of the box:

* a request handler cannot reach its TCP connection, so it cannot drop it; the protocol
  class below hands each request its connection's transport through the request state;
* a readiness line carrying the real port, also when the port was 0 or there are
  several workers;
* a clean exit (status 0) after a graceful shutdown on SIGTERM or SIGINT; uvicorn
  re-raises the signal once it has shut down, which ends the process by that signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPProtocol
except ImportError:  # pragma: no cover - httptools is optional for uvicorn
    from uvicorn.protocols.http.h11_impl import (  # type: ignore[assignment]
        H11Protocol as _HTTPProtocol,
    )

if TYPE_CHECKING:
    import asyncio

    from accounting_service.settings import ServiceSettings

APP_FACTORY = "accounting_service.app:create_app_from_env"
TRANSPORT_STATE_KEY = "accounting_service.transport"
# Long enough for ordinary requests to finish, short enough that requests hanging on
# purpose (timeout_after_commit) do not hold a shutdown for their whole hang.
GRACEFUL_SHUTDOWN_SECONDS = 3
WORKER_READY_SECONDS = 60


class ResettableHTTPProtocol(_HTTPProtocol):
    """uvicorn's HTTP/1.1 protocol, exposing the connection to request handlers.

    uvicorn copies ``app_state`` into every request's ``scope["state"]``; giving each
    connection its own copy with the transport in it is the one hook that reaches the
    handler without patching uvicorn.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app_state = {**self.app_state, TRANSPORT_STATE_KEY: transport}


def reset_connection(scope: Any) -> None:
    """Abort the request's TCP connection with a RST; no HTTP response is ever sent."""
    transport = scope.get("state", {}).get(TRANSPORT_STATE_KEY)
    if transport is None:
        raise RuntimeError(
            "dropping a connection needs uvicorn with "
            "http=accounting_service.server.ResettableHTTPProtocol"
        )
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # A zero linger time makes close() send RST instead of FIN: the client sees
        # "connection reset by peer", as when a proxy or a NAT drops the connection.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def listening_line(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"accounting service listening on http://{shown}:{port}"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready_line: str) -> None:
        super().__init__(config)
        self._ready_line = ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self._ready_line, flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _Supervisor(Multiprocess):
    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], ready_line: str):
        super().__init__(config, sockets)
        self._ready_line = ready_line
        self.ready = False

    def init_processes(self) -> None:
        super().init_processes()
        workers = self.processes
        if all(w.wait_until_ready(WORKER_READY_SECONDS, self.should_exit) for w in workers):
            self.ready = True
            print(self._ready_line, flush=True)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(
    settings: ServiceSettings,
    *,
    host: str,
    port: int,
    workers: int = 1,
    log_level: str = "warning",
) -> int:
    """Serve until SIGTERM or SIGINT; return the process exit status."""
    # Workers are spawned, not forked: the environment is how they get the settings.
    # One worker goes through the same factory, so both cases run the same code.
    os.environ.update(settings.to_env())
    config = uvicorn.Config(
        APP_FACTORY,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        http=ResettableHTTPProtocol,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    # Binding here, before any worker starts, tells us the real port when it is 0.
    sock = config.bind_socket()
    ready_line = listening_line(host, sock.getsockname()[1])
    if workers == 1:
        _Server(config, ready_line).run(sockets=[sock])
        return 0
    supervisor = _Supervisor(config, [sock], ready_line)
    supervisor.run()
    return 0 if supervisor.ready else STARTUP_FAILURE
