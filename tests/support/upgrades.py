"""Two releases side by side, switched in-process: this code and a next one.

This code is the "old" release; the "new" one ships one more migration.

The next release's migration is a probe: ``ALTER TABLE`` on ``job_runs`` and
``outbound_ledger`` (each needs ``ACCESS EXCLUSIVE``, as a real column migration does), additive like
every migration must be. It is not a file of sql/migrations/, so the tests that use it hold
whatever migrations later releases add.
"""

from __future__ import annotations

import pytest

from airflow_idempotency import schema as schema_mod
from airflow_idempotency._sql import Migration, migrations

PROBE_SQL = """\
ALTER TABLE job_runs ADD COLUMN upgrade_probe integer;
ALTER TABLE outbound_ledger ADD COLUMN upgrade_probe integer;
"""


class Releases:
    """Switch the provider in this process between this release and the next one (a new task
    process of that release: the per-process schema check is forgotten on each switch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.old_files = migrations()
        newest = self.old_files[-1].version + 1
        self.probe = Migration(newest, f"{newest:04d}_upgrade_probe.sql", PROBE_SQL)
        self.new_files = (*self.old_files, self.probe)

    def old(self) -> None:
        """From now on, this process runs this release."""
        self._use(self.old_files)

    def new(self) -> None:
        """From now on, this process runs the next release (one more migration)."""
        self._use(self.new_files)

    def _use(self, files: tuple[Migration, ...]) -> None:
        self._monkeypatch.setattr(schema_mod, "migrations", lambda: files)
        schema_mod._migrated.clear()
