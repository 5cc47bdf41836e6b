"""The idempotent-run contract, independent of Airflow.

:func:`run_idempotently` executes ``work`` for one (job name, run key), in the steps of
:class:`~airflow_idempotency.run_steps.Run`:

1. **lock**: validate the job name and run key, and the zone the key was made in against
   the job's earlier keys (:mod:`~airflow_idempotency.key_zone`; nothing is written when
   they are refused), then take the run lock in a transaction held open on a dedicated connection
   for the whole run. If another session holds it, record a ``lock_held`` attempt naming the
   holder and raise :class:`~airflow_idempotency.exceptions.RunLockedError`;
2. **read** ``job_runs``: a completed key (and no ``force``) records a ``noop`` attempt and
   returns without calling ``work``. In the advisory mode the zone check, the lock, the read
   and the no-op's record are one call, ``run_decide()`` (migration 16), sent with the lock
   transaction's BEGIN (:func:`~airflow_idempotency.run_steps.decide`): a no-op decision takes
   two round trips, a new key four;
3. **start**: on a new work connection, record the attempt and upsert ``job_runs`` to
   ``started`` (committed at once, so everyone sees the run in progress);
4. **work**: call ``work`` with a :class:`~airflow_idempotency.run_context.RunContext`;
5. **fenced completion**: mark ``completed`` in the lock transaction (only this attempt,
   only while its session holds the lock), whose commit also releases the lock;
6. **failure**: on an exception, mark the attempt and the run ``failed`` (in the lock
   transaction when it is alive, else from a fresh connection) and re-raise
   (:mod:`~airflow_idempotency.run_failures`).

``dry_run`` runs ``work`` inside one transaction that is rolled back, leaves ``job_runs``
alone and records a ``dry_run`` attempt.
"""

from __future__ import annotations

from airflow_idempotency.key_spelling import check_key_text, check_text
from airflow_idempotency.lease_run import LeaseRun
from airflow_idempotency.leases import LockMode, resolve_lock_mode
from airflow_idempotency.records import RunIdentity, RunOptions, Trigger
from airflow_idempotency.run_context import ConnectionFactory, RunContext, RunEnvironment, RunSpec
from airflow_idempotency.run_steps import Run, RunOutcome, RunResult, Work
from airflow_idempotency.schema import validate_schema_name

__all__ = [
    "RunContext",
    "RunEnvironment",
    "RunOptions",
    "RunOutcome",
    "RunResult",
    "Trigger",
    "Work",
    "run_idempotently",
]


_DEFAULT_OPTIONS = RunOptions()
_UNKNOWN_TRIGGER = Trigger()
_DEFAULT_ENVIRONMENT = RunEnvironment()


def run_idempotently(
    *,
    connect: ConnectionFactory,
    job_name: str,
    run_key: str,
    work: Work,
    options: RunOptions = _DEFAULT_OPTIONS,
    trigger: Trigger = _UNKNOWN_TRIGGER,
    environment: RunEnvironment = _DEFAULT_ENVIRONMENT,
    lock_mode: str | LockMode | None = None,
) -> RunResult:
    """Execute ``work`` at most once to completion for (job_name, run_key). See the module doc.

    :param connect: opens a new connection to the job database on every call.
    :param job_name: the job's name in the run records (the operator's default is
        ``<dag_id>.<task_id>``).
    :param run_key: the business period, e.g. ``2026-10-01``.
    :param work: called with the :class:`RunContext`; returns a dict of counts (stored in
        ``job_runs.details``) or ``None``.
    :param options: ``force`` and ``dry_run``.
    :param trigger: who or what started the run, and its Airflow ids (recorded with it).
    :param environment: the bookkeeping schema, the logger, the metrics and the Airflow
        task context (:class:`~airflow_idempotency.run_context.RunEnvironment`; the
        operator passes its own).
    :param lock_mode: how the run holds its key: ``"advisory"`` (the default: an advisory
        lock in a transaction kept open on a connection of its own for the whole run) or
        ``"lease"`` (a lease renewed by a heartbeat: no connection held for the run's length;
        a dead worker's key is free again within its time to live, 30 s by default), or a
        :class:`~airflow_idempotency.leases.LockMode` giving that time to live
        (``LockMode("lease", lease_ttl=10)``). docs/locks.md.
    """
    job_name = check_text(job_name, "job name")
    run_key = check_key_text(run_key, "run key")
    validate_schema_name(environment.schema)
    mode = resolve_lock_mode(lock_mode)
    identity = RunIdentity(job_name, run_key, trigger)
    spec = RunSpec(identity, options, connect, environment, lock_mode=mode.mode, lease_ttl=mode.ttl)
    run = LeaseRun(spec, work) if spec.lock_mode == "lease" else Run(spec, work)
    return run.execute()
