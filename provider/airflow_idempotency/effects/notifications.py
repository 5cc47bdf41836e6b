"""Notifications from task callbacks, once per (job, run key, event): not once per try.

``on_success_callback`` and ``on_failure_callback`` run after every try that ends so: a
retry, a Clear, a rerun of the date, a backfill all notify again. Wrapped by
:func:`notify_once`, any Airflow notifier (``BaseNotifier``: ``SmtpNotifier``, Slack's,
...) or plain callback notifies once per (job, run key, event) of an idempotent task:

    @task.idempotent_run(
        on_success_callback=notify_once(SmtpNotifier(to="ops@example.com"), event="success"),
        on_failure_callback=notify_once(send_to_chat, event="failure"),
    )

Each notifier's notification is an effect in the outbound ledger: kind ``notification``,
remote system ``notify:<name>`` (the notifier's class or function name unless ``name=``),
key ``<job>:<run key>:<event>``, *not deduplicating* (a notifier cannot tell a resend): its
intent is recorded before the notifier is called and its outcome after, so a crash in
between leaves it ``unknown`` (an operator resolves it), never sent twice. A dry run (even
one that fails) sends nothing and writes nothing; so does a no-op rerun of a completed key,
but for a notification an operator chose to resend (``ledger resend``: ``pending``), which
it delivers.

A notifier that raises is named in the task's log and recorded ``unknown`` (it may have
notified before raising; ``on_error="failed"`` if it cannot have: the next callback then
tries again); the other notifiers of the same call go on, and the callback raises at the
end, naming each failure (Airflow logs it; the task's state does not change). An
``SmtpNotifier`` gets the stable ``Message-ID`` of the email sender for its key.

Callbacks run outside the run: they take no run lock. Two callbacks of one key at once are
kept apart by the intent itself (one statement moves the row to ``unknown``; the other
finds it taken and sends nothing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import psycopg

from airflow_idempotency._sql import query_row
from airflow_idempotency._transactions import bounded_transaction
from airflow_idempotency.effects.mail import message_id
from airflow_idempotency.exceptions import (
    IdempotencyError,
    NotificationError,
    OutcomeUnknownError,
    PermanentRemoteError,
    RemoteError,
)
from airflow_idempotency.ledger import OutboundLedger, Retries
from airflow_idempotency.ledger.senders import BlockingEffectSender, Confirmation, Effect
from airflow_idempotency.metrics import NO_METRICS, Metrics
from airflow_idempotency.run_context import ConnectionFactory, autocommit_connection
from airflow_idempotency.schema import DEFAULT_CONN_ID, DEFAULT_SCHEMA, ensure_schema

log = logging.getLogger(__name__)

OnError = Literal["unknown", "failed"]
Notifier = Callable[[Any], Any]


class _CallbackScope:
    """What the ledger needs, outside a run: no attempt, no run lock to check (the intent
    statement keeps two callbacks of one key apart)."""

    attempt_id = None
    dry_run = False

    def __init__(
        self,
        job_name: str,
        run_key: str,
        connect: ConnectionFactory,
        schema: str,
        logger: Any,
        metrics: Metrics,
    ) -> None:
        self.job_name = job_name
        self.run_key = run_key
        self.schema = schema
        self.log = logger
        self.metrics = metrics
        self._connect = connect

    def lock_is_held(self, conn: psycopg.Connection | None = None) -> bool:
        return True

    def lock_session_ended(self) -> bool:
        return False

    @contextlib.contextmanager
    def fenced_transaction(self, conn: psycopg.Connection) -> Iterator[None]:
        # no run lock to fence against (READ COMMITTED: its own); its lock waits bounded
        with bounded_transaction(conn, self.schema):
            yield

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException:
        return exc

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]:
        return autocommit_connection(self._connect)


def _notifier_name(notifier: Notifier) -> str:
    name = getattr(notifier, "__qualname__", None) or type(notifier).__name__
    return str(name).replace("<", "").replace(">", "")


def _call(notifier: Notifier, context: Any) -> None:
    """Call ``notifier`` so that its failure reaches us: Airflow 2's ``BaseNotifier.__call__``
    logs and swallows what ``notify`` raises, so a notifier's own steps are run directly."""
    if hasattr(notifier, "notify") and hasattr(notifier, "render_template_fields"):
        update = getattr(notifier, "_update_context", None)
        if update is not None:
            update(context)
        notifier.render_template_fields(context)
        notifier.notify(context)
    else:
        notifier(context)


class _NotifierSender(BlockingEffectSender[None]):
    """One notifier as the ledger's sender: calls it (in the ledger's worker thread)."""

    kind = "notification"
    deduplicating = False
    concurrency = 1

    def __init__(self, notifier: Notifier, context: Any, on_error: OnError) -> None:
        self.notifier = notifier
        self.context = context
        self.on_error = on_error
        self.target = _notifier_name(notifier)

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        headers: Any = getattr(self.notifier, "custom_headers", False)
        if headers is not False and hasattr(self.notifier, "smtp_conn_id"):
            # SmtpNotifier: the stable Message-ID the email sender would give this key
            self.notifier.custom_headers = {  # type: ignore[attr-defined]
                **(headers or {}),
                "Message-ID": message_id(effect.idempotency_key, "airflow.notification"),
                "X-Idempotency-Key": effect.idempotency_key,
            }
        try:
            _call(self.notifier, self.context)
        except RemoteError:
            raise  # a notifier of our own kind classified its failure itself
        except Exception as exc:
            detail = f"{self.target} raised {type(exc).__name__}: {exc}"
            if self.on_error == "failed":
                raise PermanentRemoteError(detail) from exc
            raise OutcomeUnknownError(detail) from exc
        return Confirmation(f"notified by {self.target}")


class NotifyOnce:
    """The callback :func:`notify_once` returns."""

    def __init__(
        self,
        notifiers: tuple[Notifier, ...],
        *,
        event: str,
        name: str | None,
        on_error: OnError,
        postgres_conn_id: str | None,
        schema: str | None,
    ) -> None:
        if not notifiers:
            raise ValueError("notify_once needs at least one notifier or callback")
        for notifier in notifiers:
            if not callable(notifier):
                raise TypeError(f"notify_once: {notifier!r} is not callable")
        if on_error not in ("unknown", "failed"):
            raise ValueError(f"on_error must be 'unknown' or 'failed', not {on_error!r}")
        if name is not None and len(notifiers) > 1:
            raise ValueError("name= names one notifier: wrap each in its own notify_once")
        self.notifiers = notifiers
        self.event = event
        self.name = name
        self.on_error = on_error
        self.postgres_conn_id = postgres_conn_id
        self.schema = schema
        self.__name__ = f"notify_once({event})"

    def __call__(self, context: Any) -> None:
        task = context["task"]
        job_name = str(getattr(task, "effective_job_name", None) or f"{task.dag_id}.{task.task_id}")
        if self._skipped(task, context, job_name):
            return
        run_key = self._run_key(task, context, job_name)
        failures = []
        with self._connect(task) as connect:
            scope = _CallbackScope(
                job_name, run_key, connect, self._schema(task), _task_log(task), _metrics()
            )
            for notifier in self.notifiers:
                if _outcome(task) == "noop" and not self._resent(scope, notifier):
                    scope.log.info(
                        "job=%s: no-op run, the %s notification is not sent", job_name, self.event
                    )
                    continue
                failure = self._notify(scope, notifier, context)
                if failure:
                    failures.append(failure)
        if failures:
            raise NotificationError("; ".join(failures))

    # -- the steps ----------------------------------------------------------------------

    def _skipped(self, task: Any, context: Any, job_name: str) -> bool:
        """A dry run notifies nothing (and writes nothing), even when it fails."""
        if _outcome(task) == "dry_run":
            _task_log(task).info(
                "job=%s: dry run, the %s notification is not sent", job_name, self.event
            )
            return True
        return False

    def _run_key(self, task: Any, context: Any, job_name: str) -> str:
        resolve = getattr(task, "resolve_run_key", None)
        if resolve is not None:
            try:
                return str(resolve(context).run_key)
            except Exception as exc:
                _task_log(task).warning(
                    "job=%s: no run key for the %s notification (%s): keyed by the Airflow run",
                    job_name, self.event, exc,
                )  # fmt: skip
        return f"airflow-run:{context['run_id']}"

    def _schema(self, task: Any) -> str:
        return self.schema or str(getattr(task, "schema", None) or DEFAULT_SCHEMA)

    @contextlib.contextmanager
    def _connect(self, task: Any) -> Iterator[ConnectionFactory]:
        from airflow_idempotency.connection import JobDatabase

        conn_id = self.postgres_conn_id or getattr(task, "postgres_conn_id", None)
        database = JobDatabase(conn_id or DEFAULT_CONN_ID)
        with autocommit_connection(database.new_connection) as conn:
            ensure_schema(conn, self._schema(task))
        yield database.new_connection

    def _resent(self, scope: _CallbackScope, notifier: Notifier) -> bool:
        """Whether the notification waits to be sent again (``pending``: an operator chose to
        resend it, ``ledger resend``): a no-op rerun of its completed key delivers it, and
        sends nothing else."""
        remote, key = self._effect_of(scope, notifier)
        with scope.bookkeeping_connection() as conn:
            params = {"remote_system": remote, "key": key}
            row = query_row(conn, "ledger_effect", scope.schema, params)
        return row is not None and row["status"] == "pending"

    def _effect_of(self, scope: _CallbackScope, notifier: Notifier) -> tuple[str, str]:
        """The remote system and the key of ``notifier``'s notification."""
        remote = f"notify:{self.name or _notifier_name(notifier)}"
        return remote, f"{scope.job_name}:{scope.run_key}:{self.event}"

    def _notify(self, scope: _CallbackScope, notifier: Notifier, context: Any) -> str | None:
        """One notifier's notification through the ledger; the failure's text, if any."""
        remote, key = self._effect_of(scope, notifier)
        effect = Effect(key, {"event": self.event, "notifier": remote})
        ledger = OutboundLedger(scope, remote, retries=Retries(max_attempts=1), concurrency=1)
        try:
            summary = ledger.send_all(
                [effect], _NotifierSender(notifier, context, self.on_error), raise_on_failure=False
            )
        except IdempotencyError as exc:
            scope.log.error("notification %s to %s: %s", key, remote, exc)
            return f"{key} to {remote}: {exc}"
        if summary.sent:
            scope.log.info("notification %s sent by %s", key, remote)
            return None
        if summary.skipped_existing:
            scope.log.info("notification %s by %s: sent before, not again", key, remote)
            return None
        error = summary.errors[0] if summary.errors else "not sent"
        state = "unknown" if summary.unknown else "failed" if summary.failed else "pending"
        scope.log.error(
            "notification %s to %s is %s in the outbound ledger: %s", key, remote, state, error
        )
        return f"{key} to {remote} is {state}: {error}"


def _outcome(task: Any) -> str | None:
    """How the task's run ended, as its execute set it (in this process): ``noop``,
    ``dry_run`` (also when a dry run failed), ..."""
    return getattr(task, "last_run_outcome", None)


def _task_log(task: Any) -> Any:
    return getattr(task, "log", None) or log


def _metrics() -> Metrics:
    try:
        from airflow_idempotency.metrics import AIRFLOW_METRICS
    except ImportError:  # outside Airflow
        return NO_METRICS
    return AIRFLOW_METRICS


def notify_once(
    *notifiers: Notifier,
    event: str,
    name: str | None = None,
    on_error: OnError = "unknown",
    postgres_conn_id: str | None = None,
    schema: str | None = None,
) -> NotifyOnce:
    """A task callback that calls each of ``notifiers`` once per (job, run key, ``event``).

    :param notifiers: Airflow notifiers (``BaseNotifier`` instances) or plain callables
        taking the callback's context; each is its own effect, so one that raises costs
        the others nothing.
    :param event: names the notification in its key, e.g. ``"success"``, ``"failure"``.
    :param name: the remote system's name (``notify:<name>``) of a single notifier; default
        its class or function name. Renaming it later makes every notification new again.
    :param on_error: a notifier that raised is ``unknown`` (it may have notified: never
        repeated on its own) or ``failed`` (it cannot have: tried again by the next callback).
    :param postgres_conn_id: the job database (default: the task's, else
        ``idempotency_default``).
    """
    return NotifyOnce(
        notifiers,
        event=event,
        name=name,
        on_error=on_error,
        postgres_conn_id=postgres_conn_id,
        schema=schema,
    )
