"""A real SMTP server (aiosmtpd) as a subprocess, counting what it delivers.

For tests, the demo and the email benchmark.

    with run_smtp_server(tmp_path / "mail") as server:
        ...  # send to 127.0.0.1:server.port
        assert server.deliveries_by_key() == {"k1": 1}
        server.kill()       # SIGKILL, as a crashed mail server
        server.start()      # again on the same port, the same mailbox

Each message the server accepts is appended to ``<folder>/mailbox.jsonl`` (Message-ID,
X-Idempotency-Key, envelope, subject) and fsync'ed BEFORE the server answers 250: a message
counted there was delivered, whatever the client learnt. ``--die-after N`` makes the server
exit right after storing the N-th message and before answering it (the client then loses the
answer of a message that was delivered); ``--refuse RCPT`` answers 550 to that recipient;
``--quiet`` stores only the counts (the benchmark: no per-message fsync).

    python -m devtools.smtp_server --port 8025 --folder /tmp/mail [--die-after N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from email import message_from_bytes
from pathlib import Path
from typing import Any

MAILBOX = "mailbox.jsonl"


class Mailbox:
    """The aiosmtpd handler: stores each message durably, then answers."""

    def __init__(
        self, folder: Path, die_after: int | None, refuse: set[str], quiet: bool, delay: float
    ) -> None:
        self.path = folder / MAILBOX
        self.die_after = die_after
        self.delay = delay
        self.refuse = refuse
        self.quiet = quiet
        self.count = 0
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - the server's life

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: Any
    ) -> str:
        if address in self.refuse:
            return f"550 5.1.1 <{address}>: recipient refused"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.count += 1
        if not self.quiet:
            message = message_from_bytes(envelope.original_content or envelope.content)
            record = {
                "n": self.count,
                "message_id": message.get("Message-ID"),
                "key": message.get("X-Idempotency-Key"),
                "from": envelope.mail_from,
                "to": list(envelope.rcpt_tos),
                "subject": message.get("Subject"),
            }
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self.die_after is not None and self.count >= self.die_after:
            os._exit(137)  # stored, never answered: the client cannot know it was delivered
        if self.delay:
            await asyncio.sleep(self.delay)  # a slow server: a batch takes a while
        return "250 2.0.0 OK: queued"


async def _serve(args: argparse.Namespace) -> None:
    from aiosmtpd.smtp import SMTP

    folder = Path(args.folder)
    handler = Mailbox(folder, args.die_after, set(args.refuse or ()), args.quiet, args.delay)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="idempotency-test-smtp"), "127.0.0.1", args.port
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready on 127.0.0.1:{args.port}", flush=True)
    async with server:
        await stop.wait()
    (folder / "count").write_text(str(handler.count))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--refuse", action="append", metavar="RCPT")
    parser.add_argument("--quiet", action="store_true", help="count only (no mailbox lines)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    asyncio.run(_serve(parser.parse_args(argv)))


# -- the client side: start, count, kill ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmtpServer:
    """One server process on a fixed port and mailbox folder; restartable."""

    def __init__(self, folder: Path, port: int | None = None, *, quiet: bool = False) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.quiet = quiet
        self.proc: subprocess.Popen[str] | None = None

    def start(
        self, *, die_after: int | None = None, refuse: tuple[str, ...] = (), delay: float = 0.0
    ) -> None:
        """Start the server (again) and wait until it accepts connections; ``delay``: seconds
        it waits before answering each message (stored first)."""
        command = [sys.executable, "-m", "devtools.smtp_server", "--port", str(self.port)]
        command += ["--folder", str(self.folder), "--delay", str(delay)]
        if die_after is not None:
            command += ["--die-after", str(die_after)]
        for address in refuse:
            command += ["--refuse", address]
        if self.quiet:
            command.append("--quiet")
        root = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        log = open(self.folder / "server.log", "a")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True, cwd=root,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SMTP server exited {self.proc.returncode}: {self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
            ):
                if s.recv(3) == b"220":
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the SMTP server did not answer on port {self.port}: {self.log()}")

    @property
    def url(self) -> str:
        return f"smtp://127.0.0.1:{self.port}"

    def log(self) -> str:
        path = self.folder / "server.log"
        return path.read_text()[-2000:] if path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_dead(self, timeout: float = 30) -> int | None:
        """Wait for the process to end by itself (``--die-after``); its exit code."""
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=timeout)
        return None

    def kill(self) -> None:
        """SIGKILL the server (a mail server that crashed)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (it writes its count) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def deliveries(self) -> list[dict[str, Any]]:
        """Every message delivered so far, in order (from the mailbox file)."""
        path = self.folder / MAILBOX
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def deliveries_by_key(self) -> Counter[str]:
        """How many times each X-Idempotency-Key was delivered."""
        return Counter(str(d["key"]) for d in self.deliveries())

    def delivered_count(self) -> int:
        """The quiet server's count, written when it stopped (SIGTERM)."""
        path = self.folder / "count"
        return int(path.read_text()) if path.exists() else 0


@contextlib.contextmanager
def run_smtp_server(folder: Path, port: int | None = None, **options: Any) -> Iterator[SmtpServer]:
    """A started :class:`SmtpServer`; killed on exit."""
    server = SmtpServer(folder, port, quiet=options.pop("quiet", False))
    server.start(**options)
    try:
        yield server
    finally:
        server.kill()


def smtp_connection_env(
    server: SmtpServer, conn_id: str = "smtp_default", from_email: str = "jobs@example.com"
) -> dict[str, str]:
    """``AIRFLOW_CONN_<ID>`` of an smtp connection to ``server`` (no TLS, no login)."""
    extra = {"from_email": from_email, "disable_ssl": True, "disable_tls": True, "retry_limit": 0,
             "timeout": 10}  # fmt: skip
    value = {"conn_type": "smtp", "host": "127.0.0.1", "port": server.port, "extra": extra}
    return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(value)}


if __name__ == "__main__":
    main()
