"""The provider's metrics reach a real StatsD listener through Airflow's own metrics layer.

`airflow dags test` of the example DAG runs with ``[metrics] statsd_on`` pointed at a UDP
socket of this process: what arrives is what a team's StatsD (or Datadog/InfluxDB agent)
would receive. Plain StatsD has no tags; with ``statsd_influxdb_enabled`` the same metrics
carry the job (and remote system) as tags.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.airflow_env import DAGS_FOLDER
from support.dag_runs import scheduled_logical_date
from support.workers import start_worker

pytestmark = pytest.mark.both_airflow_lines

D = "2026-10-01"


class Listener:
    """A UDP socket on 127.0.0.1 collecting StatsD lines."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.lines.extend(data.decode(errors="replace").splitlines())

    def ours(self) -> list[str]:
        return [line for line in self.lines if ".idempotency." in line]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def statsd() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.close()


def run_example(airflow_home: Path, invoicing: Any, listener: Listener, **metrics: str) -> None:
    env = {
        **invoicing.connection_env(),
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(listener.port),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        **metrics,
    }
    worker = start_worker(
        airflow_home,
        "finalize_invoices",
        scheduled_logical_date(D),
        invoicing.dsn,
        env,
        dags_folder=DAGS_FOLDER,
    )
    out, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0, out[-3000:]


def test_run_and_ledger_metrics_reach_statsd(
    airflow_home: Path, invoicing: Any, statsd: Listener
) -> None:
    """A date run (three completed jobs, 40 effects sent), then its rerun (three no-ops):
    the counters and timers arrive under airflow.idempotency.*."""
    invoicing.seed(D, orders=40)
    run_example(airflow_home, invoicing, statsd)
    run_example(airflow_home, invoicing, statsd)
    lines = statsd.ours()
    counts: dict[str, int] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        value, _, kind = rest.partition("|")
        if kind == "c":
            counts[name] = counts.get(name, 0) + int(float(value))
    assert counts.get("airflow.idempotency.run.completed") == 3, lines
    assert counts.get("airflow.idempotency.run.noop") == 3, lines
    assert counts.get("airflow.idempotency.ledger.sent") == 40, lines
    assert "airflow.idempotency.run.failed" not in counts
    timers = {line.partition(":")[0] for line in lines if line.endswith("|ms")}
    assert {"airflow.idempotency.run.decision_ms", "airflow.idempotency.run.work_ms"} <= timers


def test_metrics_carry_the_job_as_a_tag(
    airflow_home: Path, invoicing: Any, statsd: Listener
) -> None:
    """With tags enabled (InfluxDB line format), each metric names its job, never its run key."""
    invoicing.seed(D, orders=5)
    run_example(airflow_home, invoicing, statsd, AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED="True")
    lines = statsd.ours()
    assert any(
        line.startswith("airflow.idempotency.run.completed,")
        and "job=finalize_invoices.export_invoices" in line
        for line in lines
    ), lines
    assert any(
        line.startswith("airflow.idempotency.ledger.sent,")
        and "remote_system=accounting" in line
        and line.endswith(":5|c")
        for line in lines
    ), lines
    assert not any(D in line for line in lines), "a run key in a metric"
