"""Where an attempt came from in Airflow: the ids the task context carries, read on each line.

An attempt row names its DAG, run, task, try and map index (:class:`~.records.Trigger`);
:class:`Provenance` adds what tells two executions of one task apart after a clear, a backfill
or a redeploy. What each line has (``docs/contract.md``, "Provenance"):

- ``ti_id``: Airflow 3's task instance id (``ti.id``, a UUID, new for every clear). Airflow 2
  task instances have no id: there ``dag_id``, ``task_id``, ``run_id`` and ``map_index``
  (with ``try_number``) name one, and ``ti_id`` is ``None``.
- ``run_type``: the DAG run's type as Airflow spells it (``scheduled``, ``manual``,
  ``backfill``, ``asset_triggered``; ``dataset_triggered`` on 2.x).
- ``clear_number``: how many times the DAG run was cleared (``dag_run.clear_number``, both lines).
- ``dag_version_id``: the DAG version the task ran (Airflow 3: ``ti.dag_version_id``; 2.x has
  no DAG versions).

The Task SDK's DAG run carries no backfill id and no DAG version number (Airflow 3.3.2): a
backfill's run is ``run_type`` ``backfill``, and its id and the version's number are Airflow's
to look up from ``run_id`` and ``dag_version_id``. Airflow 2 records no triggering user.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Provenance:
    """The Airflow ids of one execution beyond its DAG, run, task, try and map index; ``None``
    where the line does not have the value, or the run came from outside Airflow."""

    ti_id: uuid.UUID | None = None
    run_type: str | None = None
    clear_number: int | None = None
    dag_version_id: uuid.UUID | None = None

    @property
    def params(self) -> dict[str, Any]:
        """The attempt row's columns of it (migration 0011)."""
        return {
            "ti_id": self.ti_id,
            "run_type": self.run_type,
            "clear_number": self.clear_number,
            "dag_version_id": self.dag_version_id,
        }


def _uuid(value: Any) -> uuid.UUID | None:
    """A UUID from the Task SDK's value (a ``uuid.UUID``, or its text), ``None`` for none."""
    return None if value is None else uuid.UUID(str(value))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def read_provenance(context: Mapping[str, Any], run_type: str | None) -> Provenance:
    """The provenance of the task execution whose Airflow ``context`` this is.

    Reads Airflow's own context objects: on 3.x the Task SDK's ``RuntimeTaskInstance``
    (``id``, ``dag_version_id``) and ``DagRun`` (``clear_number``); on 2.x the ORM
    ``TaskInstance`` (no id, no DAG version: ``None``) and ``DagRun`` (``clear_number``).
    ``run_type`` is the run's type as :func:`~.compat.run_type` read it.
    """
    ti = context["ti"]
    dag_run = context["dag_run"]
    return Provenance(
        ti_id=_uuid(getattr(ti, "id", None)),
        run_type=run_type,
        clear_number=_int(getattr(dag_run, "clear_number", None)),
        dag_version_id=_uuid(getattr(ti, "dag_version_id", None)),
    )
