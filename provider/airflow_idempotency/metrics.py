"""What the contract tells monitoring: counters and timers named ``idempotency.*``.

Every metric is tagged by job (``job``; the ledger's also by ``remote_system``), never by
run key: a key per day (or hour) would make the cardinality unbounded. The Airflow operator
emits them through Airflow's own metrics layer (StatsD or OpenTelemetry, as ``[metrics]``
configures it; :class:`AirflowMetrics`), so no configuration of
ours is needed; the Airflow-free core takes any object with :class:`Metrics`' two methods.
Airflow prefixes the names with ``[metrics] statsd_prefix`` (``airflow.`` by default).

===========================================  =================================================
name                                         meaning
===========================================  =================================================
``idempotency.run.completed``                a run did the work and recorded completion
``idempotency.run.noop``                     a completed key: nothing done (a rerun)
``idempotency.run.failed``                   the work raised; the key is ``failed``
``idempotency.run.lock_held``                another execution held the key: refused
``idempotency.run.lock_lost``                the run lost its lock (session ended, a cut
                                             network): not completed
``idempotency.run.takeover``                 a run took over the key from an attempt whose
                                             worker died (closed as abandoned)
``idempotency.run.dry_run``                  a dry run (rolled back)
``idempotency.run.deferred``                 the work deferred (an Airflow deferrable
                                             task under the policy): the key stays
                                             started, the resumed task is a new attempt
``idempotency.run.decision_ms`` (timer)      lock + read + decision, before the work
``idempotency.run.work_ms`` (timer)          the work itself
``idempotency.run.database_wait_ms`` (timer) lease mode: taking the lease, and each renewal
                                             (a busy pool's queue shows here first)
``idempotency.ledger.sent``                  effects the remote confirmed now
``idempotency.ledger.skipped``               effects skipped: confirmed before
``idempotency.ledger.replayed``              confirmations the remote replayed (it had the
                                             key: a lost answer, resent)
``idempotency.ledger.failed``                effects the remote refused permanently
``idempotency.ledger.pending``               effects left pending (retries ran out, the
                                             remote unreachable, the lock lost)
``idempotency.ledger.unknown``               effects of a remote that does not deduplicate
                                             found or left unknown (a call began, no
                                             outcome recorded): an operator must resolve
``idempotency.ledger.invalid``               effects refused as malformed (not sent)
===========================================  =================================================
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from functools import cache
from typing import Any, Protocol

PREFIX = "idempotency"
RUN_OUTCOMES = ("completed", "noop", "failed", "lock_held", "lock_lost", "dry_run", "deferred")
LEDGER_COUNTS = ("sent", "skipped", "replayed", "failed", "pending", "unknown", "invalid")


class Metrics(Protocol):
    """Where metrics go: Airflow's ``Stats`` has these two methods."""

    def incr(self, stat: str, count: int = 1, *, tags: Mapping[str, str] | None = None) -> None:
        """Add ``count`` to the counter ``stat``."""

    def timing(self, stat: str, dt: dt.timedelta, *, tags: Mapping[str, str] | None = None) -> None:
        """Record one duration of the timer ``stat``."""


class NoMetrics:
    """Metrics that go nowhere (the core's default, outside Airflow)."""

    def incr(self, stat: str, count: int = 1, *, tags: Mapping[str, str] | None = None) -> None:
        return None

    def timing(self, stat: str, dt: dt.timedelta, *, tags: Mapping[str, str] | None = None) -> None:
        return None


NO_METRICS: Metrics = NoMetrics()


def run_outcome(metrics: Metrics, outcome: str, job_name: str) -> None:
    """Count one run's outcome (one of :data:`RUN_OUTCOMES`, or ``takeover``)."""
    if metrics is NO_METRICS:  # nothing to build: the core's default, outside Airflow
        return
    metrics.incr(f"{PREFIX}.run.{outcome}", tags={"job": job_name})


def run_timing(metrics: Metrics, what: str, seconds: float, job_name: str) -> None:
    """Record ``decision``, ``work`` or ``database_wait`` time of one run."""
    if metrics is NO_METRICS:
        return
    metrics.timing(f"{PREFIX}.run.{what}_ms", dt.timedelta(seconds=seconds), tags={"job": job_name})


def ledger_counts(
    metrics: Metrics, counts: Mapping[str, int], job_name: str, remote_system: str
) -> None:
    """Count one export's effects by what happened to them (:data:`LEDGER_COUNTS`)."""
    tags = {"job": job_name, "remote_system": remote_system}
    for name in LEDGER_COUNTS:
        if counts.get(name):
            metrics.incr(f"{PREFIX}.ledger.{name}", counts[name], tags=tags)


class AirflowMetrics:
    """:class:`airflow_idempotency.metrics.Metrics` through Airflow's own ``Stats`` (StatsD
    or OpenTelemetry, whatever ``[metrics]`` configures; nothing when it is off)."""

    def incr(self, stat: str, count: int = 1, *, tags: Mapping[str, str] | None = None) -> None:
        _airflow_stats().incr(stat, count, tags=dict(tags or {}))

    def timing(self, stat: str, dt: dt.timedelta, *, tags: Mapping[str, str] | None = None) -> None:
        _airflow_stats().timing(stat, dt, tags=dict(tags or {}))


@cache
def _airflow_stats() -> Any:
    """Airflow's ``Stats`` (imported when a task first emits: the core stays Airflow-free)."""
    from airflow_idempotency.compat import Stats

    return Stats


AIRFLOW_METRICS = AirflowMetrics()
