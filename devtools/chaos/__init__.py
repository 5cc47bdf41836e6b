"""Chaos: seeded, overlapping actions and faults against the real stack, checked against invariants.

``python3 dev.py chaos [--seed N] [--steps N] [--minutes M] [--builds correct,lock-off,...]``
(docs/chaos.md says what it does and checks).

What runs (:mod:`~devtools.chaos.rig`): a PRIVATE embedded PostgreSQL (the job database;
private so that it can be restarted), the example accounting service on it, and a real
Airflow 3 stack (scheduler, dag-processor, api-server) with the example DAGs of ``dags/``:
``finalize_invoices`` and the pasted-twice pair ``daily_reconciliation`` /
``daily_reconciliation_pasted_twice``.

Builds and phases (:mod:`~devtools.chaos.builds`, :mod:`~devtools.chaos.phases`): ``--builds``
names the provider builds to run, one phase each, in turn on ONE stack: ``correct`` (this
checkout's provider) and the deliberately broken copies ``lock-off``, ``completed-check-off``,
``fence-off``, ``skip-confirmed``; ``NAME:MODE`` (or ``--lock-mode``) runs a phase in a lock
mode, ``advisory`` or ``lease``. Each phase gets a fresh job database (same name, so the
same DSN), its own business dates, a fresh accounting service on the same port, and a
scheduler restarted with the phase's PYTHONPATH, sleep points and lock mode (its task
processes import the phase's provider and read the mode from the job database's connection).
A correct build must keep every invariant; a broken one must be caught, and its phase ends as
soon as it is; both in their lock mode, checked as used.

Each step (:mod:`~devtools.chaos.run`) draws from the seed one action
(:mod:`~devtools.chaos.actions`) and independently, with probability ``--fault-rate``, one
fault (:mod:`~devtools.chaos.faults`); the next step starts after a short random pause, so
actions overlap. The invariants are checked all along. The command line is
:mod:`~devtools.chaos.command`; :mod:`~devtools.chaos.report` renders a run's summary into
FAULTS.md.
"""

from devtools.chaos.command import main, parser
from devtools.chaos.phases import FIRST_DATE, Event, phase_dates
from devtools.chaos.run import Chaos

__all__ = ["FIRST_DATE", "Chaos", "Event", "main", "parser", "phase_dates"]
