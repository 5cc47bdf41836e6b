"""What the tests share (this package has no tests; tests/ is on pytest's ``pythonpath``).

- :mod:`support.db`: ``rows()``, one statement's rows from a connection of its own;
- :mod:`support.locks`: who holds which lock, read through the provider's
  ``held_run_locks()``; a key held by a run in a thread (``key_held``); ending a lock's
  session as a lost connection would; who waits for which advisory key space
  (``waiting_backends``), for any lock or a row's (``lock_waiters``); a call in a thread
  (``Background``), ``wait_for`` a condition;
- :mod:`support.fenced_work`: the fence tests' table (``public.facts``, the ``facts``
  fixture), work that writes it, and a remote that records its calls;
- :mod:`support.workers`: ``airflow dags test`` workers in private Airflow homes, and
  ``race()``, two workers on one run key;
- :mod:`support.dag_runs`: DAGs defined in tests run through Airflow's ``dag.test()``;
- :mod:`support.cli`: the CLI in process, as a process, and records for it to read;
- :mod:`support.effects`: one idempotent run around some work, the same killed in a worker
  process, the ledger's rows, local webhooks;
- :mod:`support.faults`: the fault scenarios' workers, worlds, checks and figures;
- :mod:`support.browser`: Chromium through Playwright (the ``browser`` fixture of
  tests/stack/conftest.py);
- :mod:`support.auth_manager`: an Airflow auth manager with per-DAG rules (the UI tests);
- scripts run as processes: ``effects_worker.py`` (the effect crash tests),
  ``broken_build_scenario.py`` (chaos's broken builds).
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
"""The tests/ folder (its test DAG folders: ``dags``, ``dags_ui``, ``dags_effects``, ...)."""
ROOT = TESTS.parent
"""The checkout."""
