"""A second "host" for tests: a network namespace behind a veth pair, with its own Postgres.

A network namespace joined to this one by a veth pair, and a private PostgreSQL server
listening on this side of the link.

A worker started with :meth:`Link.run_prefix` reaches Postgres only over the veth pair, so
:meth:`Link.cut` (the host side's link down) is a real network partition: packets are
dropped, nobody sends a FIN or a reset, and each end learns of it only from its TCP
keepalives and user timeout. Needs root and iproute2 (``ip netns``, veth).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import make_conninfo

from devtools.postgres import PostgresServer, private_embedded

IP = shutil.which("ip") or "/usr/sbin/ip"


def available() -> str | None:
    """``None`` when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.access(IP, os.X_OK):
        return "iproute2 (ip) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Link:
    """A namespace and the veth pair joining it to this one (a /30 of its own)."""

    namespace: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    def run_prefix(self) -> list[str]:
        """The command prefix that runs a process inside the namespace."""
        return [IP, "netns", "exec", self.namespace]

    def cut(self) -> None:
        """Take the link down: from now on every packet between the two sides is lost."""
        _ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        _ip("link", "set", self.host_if, "up")


@contextlib.contextmanager
def veth_namespace() -> Iterator[Link]:
    """Create a namespace with a veth pair to this one; remove both afterwards."""
    tag = uuid.uuid4().hex[:6]
    subnet = random.randrange(1, 250)
    link = Link(f"idem-{tag}", f"vh{tag}", f"vn{tag}", f"10.213.{subnet}.1", f"10.213.{subnet}.2")
    _ip("netns", "add", link.namespace)
    try:
        _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        _ip("link", "set", link.ns_if, "netns", link.namespace)
        _ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
        _ip("link", "set", link.host_if, "up")
        ns = ["netns", "exec", link.namespace, IP]
        _ip(*ns, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_if)
        _ip(*ns, "link", "set", link.ns_if, "up")
        _ip(*ns, "link", "set", "lo", "up")
        yield link
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", link.host_if)  # deletes its peer too
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", link.namespace)


@dataclass
class TcpPostgres:
    """A private embedded PostgreSQL listening on one address over TCP (and its socket)."""

    server: PostgresServer
    host: str
    port: int

    def dsn(self, dbname: str) -> str:
        """A TCP DSN of ``dbname``, as a worker on the other side of the link uses it."""
        return make_conninfo(host=self.host, port=str(self.port), user="postgres", dbname=dbname)

    def local_dsn(self, dbname: str) -> str:
        """A DSN of ``dbname`` over the unix socket: it works whatever happens to the link."""
        return self.server.dsn(dbname)


@contextlib.contextmanager
def tcp_postgres(listen: str) -> Iterator[TcpPostgres]:
    """Start a private embedded server (data under the checkout's .pgdata/) listening on a
    free port of ``listen``; stop it and remove its data afterwards."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind((listen, 0))
        port = probe.getsockname()[1]
    with private_embedded("tcp") as server:
        server.listen(listen, port)
        tcp = TcpPostgres(server, listen, port)
        with psycopg.connect(tcp.dsn("postgres"), connect_timeout=5) as conn:
            conn.execute("SELECT 1")
        yield tcp
