"""What a route of the Airflow 3 view gets from FastAPI: settings, access, a reader.

The settings, the user's access and a reader of the job database (``Annotated[...,
Depends()]``, as Airflow's own routes take their session and auth manager).

Authentication is Airflow's (the UI's ``_token`` cookie or a Bearer token, through
``GetUserDep``); what a user sees is what the auth manager lets them read
(:func:`visibility`), applied in SQL by the reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import Depends, Request

from airflow_idempotency.ui.database import open_reader
from airflow_idempotency.ui.reads import RecordsReader, Visibility
from airflow_idempotency.ui.settings import Settings


def get_settings(request: Request) -> Settings:
    """The app's settings (``create_app`` keeps them in the app's state)."""
    return request.app.state.settings  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]


def visibility(user: Any) -> Visibility:
    """What ``user`` may read: the DAG ids the auth manager authorizes, one by one; and every
    DAG (records written outside Airflow, records of DAGs Airflow no longer knows) only when
    it grants DAG access without naming a DAG and the authorized ids are all the DAGs there
    are. (A check without a DAG id alone is not enough: in multi-team mode it passes for a
    team's users, whose DAGs are a subset.)"""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    manager = get_auth_manager()
    authorized = frozenset(manager.get_authorized_dag_ids(user=user, method="GET"))
    every = manager.is_authorized_dag(method="GET", user=user)
    if every:
        with create_session() as session:
            every = authorized.issuperset(session.scalars(select(DagModel.dag_id)))
    return Visibility(every, authorized)


@dataclass(frozen=True)
class AirflowAccess:
    """What ``user`` may do, as Airflow 3's auth manager says (:class:`.pages.Access`)."""

    user: Any

    def can_trigger(self, dag_id: str | None) -> bool:
        """Whether the user may create runs of ``dag_id`` (what the REST API's trigger checks)."""
        if not dag_id:
            return False
        from airflow.models.dag import DagModel

        return get_auth_manager().is_authorized_dag(
            method="POST",
            access_entity=DagAccessEntity.RUN,
            details=DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id)),
            user=self.user,
        )

    def dag_is_paused(self, dag_id: str) -> bool | None:
        from airflow.models.dag import DagModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            paused = session.scalar(select(DagModel.is_paused).where(DagModel.dag_id == dag_id))
        return None if paused is None else bool(paused)


def get_access(user: GetUserDep) -> AirflowAccess:
    return AirflowAccess(user)


AccessDep = Annotated[AirflowAccess, Depends(get_access)]


def get_reader(settings: SettingsDep, user: GetUserDep) -> Iterator[RecordsReader]:
    """A reader for the signed-in user, on a connection held for the request."""
    with open_reader(settings, visibility(user)) as reader:
        yield reader


ReaderDep = Annotated[RecordsReader, Depends(get_reader)]


__all__ = [
    "AccessDep",
    "AirflowAccess",
    "ReaderDep",
    "SettingsDep",
    "get_settings",
    "visibility",
]
