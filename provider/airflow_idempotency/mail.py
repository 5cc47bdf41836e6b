"""Email through the outbound ledger: one message per effect key, at most once.

SMTP has no idempotency key: a server that got a message's data and lost the connection
before answering may have delivered it, and a resend would deliver it twice. So
:class:`SmtpSender` is a *not deduplicating* sender: the ledger records the intent before
each message and the outcome after it, and a message whose outcome was lost stays
``unknown`` until an operator resolves it (see :mod:`airflow_idempotency.effects`).

Every message carries a ``Message-ID`` derived from its effect key (the same on every
rerun), so that receiving systems can deduplicate too, and an ``X-Idempotency-Key`` header.

How each SMTP outcome is classified:

- the server's ``250`` after the data: sent (the reference is the Message-ID);
- no connection, or a refusal before the data (``MAIL``/``RCPT``/``DATA`` answered 4xx, the
  connection lost before the data was sent): not delivered, tried again (4xx) or failed (5xx);
- a 4xx/5xx answer to the data itself: the server refused the message: tried again / failed;
- the connection lost or timed out during ``DATA``: unknown (conservatively also when the
  server went away before inviting the data).

Recipients are all or nothing: when the server refuses one, nothing is sent for the effect.
"""

from __future__ import annotations

import hashlib
import re
import ssl
from collections.abc import Iterable, Mapping, Sequence
from email.message import EmailMessage
from email.utils import formatdate, getaddresses
from typing import Any

import aiosmtplib

from airflow_idempotency.effects import Confirmation, Effect, EffectSender
from airflow_idempotency.exceptions import (
    ConfigurationError,
    InvalidInputError,
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)

# An addr-spec as it may travel in MAIL FROM / RCPT TO: local@domain, no blanks, no brackets,
# a domain of labels. Deliberately narrower than RFC 5322's (no quoted local parts).
_ADDRESS = re.compile(
    r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
_LINE_BREAK = re.compile(r"[\r\n]")


def email_effect(
    idempotency_key: str,
    *,
    to: str | Iterable[str],
    subject: str,
    text: str,
    html: str | None = None,
    cc: str | Iterable[str] = (),
    bcc: str | Iterable[str] = (),
    from_email: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Effect:
    """One email as a ledger effect: the same key must always name the same message.

    ``to``, ``cc``, ``bcc``: an address, a comma-separated string, or a list; ``text`` the
    plain body, ``html`` an optional HTML alternative; ``from_email`` defaults to the
    sender's. The request (what is fingerprinted) holds all of it, so a changed message
    under an existing key is refused, like a changed request.
    """
    request: dict[str, Any] = {
        "to": _addresses(to),
        "cc": _addresses(cc),
        "bcc": _addresses(bcc),
        "subject": subject,
        "text": text,
    }
    if html is not None:
        request["html"] = html
    if from_email is not None:
        request["from"] = from_email
    if headers:
        request["headers"] = dict(headers)
    return Effect(idempotency_key, request)


def _addresses(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [
        address.strip()
        for item in items
        for address in re.split(r"[,;]", str(item))
        if address.strip()
    ]


def message_id(idempotency_key: str, domain: str) -> str:
    """The stable Message-ID of the message of ``idempotency_key``: the same on every rerun."""
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
    return f"<idem.{digest}@{domain}>"


class SmtpSender(EffectSender[aiosmtplib.SMTP]):
    """Send email effects (:func:`email_effect`) to an SMTP server, at most once each.

    Build it from an Airflow connection of the smtp provider with :meth:`from_connection`
    (host, port, login, password and the extras ``from_email``, ``timeout``,
    ``disable_ssl``, ``disable_tls``, ``ssl_context``, read as ``SmtpHook`` reads them), or
    directly.

    :param concurrency: SMTP connections used at once (one message in flight on each).
    :param message_id_domain: the right-hand side of the Message-IDs (default: the domain
        of the sender address).
    """

    kind = "email"
    deduplicating = False

    def __init__(
        self,
        *,
        host: str,
        port: int = 25,
        from_email: str | None = None,
        use_ssl: bool = False,
        starttls: bool = False,
        login: str | None = None,
        password: str | None = None,
        timeout: float = 30.0,
        concurrency: int = 4,
        verify_tls: bool = True,
        message_id_domain: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise InvalidInputError("SmtpSender: concurrency must be >= 1")
        self.host = host
        self.port = port
        self.from_email = from_email
        self.use_ssl = use_ssl
        self.starttls = starttls
        self.login = login
        self.password = password
        self.timeout = timeout
        self.concurrency = concurrency
        self.verify_tls = verify_tls
        self.message_id_domain = message_id_domain
        self.target = f"smtp{'s' if use_ssl else ''}://{host}:{port}"

    @classmethod
    def from_connection(cls, conn_id: str = "smtp_default", **overrides: Any) -> SmtpSender:
        """A sender for the Airflow connection ``conn_id`` (type smtp), as ``SmtpHook`` reads
        it: SSL unless the extra ``disable_ssl``, STARTTLS unless ``disable_tls``.

        Unlike ``SmtpHook.send_email_smtp``, a message is never sent again after an error
        that may hide a delivery (the hook retries any error ``retry_limit`` times).
        """
        from airflow.providers.smtp.hooks.smtp import SmtpHook

        hook = SmtpHook(smtp_conn_id=conn_id)
        hook.smtp_connection = hook.get_connection(conn_id)
        if hook.auth_type != "basic":
            raise ConfigurationError(
                f"SMTP connection {conn_id!r}: auth_type {hook.auth_type!r} is not supported by "
                "SmtpSender (basic login only)"
            )
        settings: dict[str, Any] = {
            "host": hook.host,
            "port": hook.port or (465 if hook.use_ssl else 25),
            "from_email": hook.from_email,
            "use_ssl": hook.use_ssl,
            "starttls": hook.smtp_starttls and not hook.use_ssl,
            "login": hook.smtp_user or None,
            "password": hook.smtp_password or None,
            "timeout": float(hook.timeout),
            "verify_tls": hook.ssl_context != "none",
        }
        settings.update(overrides)
        return cls(**settings)

    # -- the effect ---------------------------------------------------------------------

    def check(self, effect: Effect) -> None:
        """Refuse an email effect that cannot be sent as asked: no recipient, a malformed
        address, no sender address, a subject or header with a line break."""
        where = f"email effect {effect.idempotency_key!r}"
        request = effect.request
        recipients = [*request.get("to", ()), *request.get("cc", ()), *request.get("bcc", ())]
        if not recipients:
            raise InvalidInputError(f"{where}: no recipient (give to=, cc= or bcc=)")
        for address in recipients:
            _check_address(address, where)
        sender = request.get("from") or self.from_email
        if not sender:
            raise InvalidInputError(
                f"{where}: no sender address (from_email= on the effect or the sender, or the "
                "smtp connection's extra from_email)"
            )
        _check_address(sender, where)
        subject = request.get("subject")
        if not isinstance(subject, str) or _LINE_BREAK.search(subject):
            raise InvalidInputError(f"{where}: the subject must be one line of text")
        for name, value in (request.get("headers") or {}).items():
            if _LINE_BREAK.search(f"{name}{value}") or ":" in name:
                raise InvalidInputError(f"{where}: header {name!r} is malformed")

    def message(self, effect: Effect) -> EmailMessage:
        """The message of ``effect``, with its stable Message-ID."""
        request = effect.request
        sender = str(request.get("from") or self.from_email)
        msg = EmailMessage()
        msg["From"] = sender
        if request.get("to"):
            msg["To"] = ", ".join(request["to"])
        if request.get("cc"):
            msg["Cc"] = ", ".join(request["cc"])
        msg["Subject"] = request["subject"]
        msg["Date"] = formatdate(localtime=False)
        domain = self.message_id_domain or _bare(sender).rpartition("@")[2]
        msg["Message-ID"] = message_id(effect.idempotency_key, domain)
        msg["X-Idempotency-Key"] = effect.idempotency_key
        for name, value in (request.get("headers") or {}).items():
            msg[name] = value
        msg.set_content(request.get("text") or "")
        if request.get("html"):
            msg.add_alternative(request["html"], subtype="html")
        return msg

    # -- the connection -----------------------------------------------------------------

    def _tls_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        if not self.verify_tls:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    async def connect(self) -> aiosmtplib.SMTP:
        client = aiosmtplib.SMTP(
            hostname=self.host,
            port=self.port,
            timeout=self.timeout,
            use_tls=self.use_ssl,
            start_tls=self.starttls,
            tls_context=self._tls_context() if (self.use_ssl or self.starttls) else None,
        )
        try:
            await client.connect()
            if self.login and self.password:
                await client.login(self.login, self.password)
        except aiosmtplib.SMTPAuthenticationError as exc:
            raise PermanentRemoteError(f"SMTP login refused at {self.target}: {exc}") from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise TransientRemoteError(
                f"cannot connect to {self.target}: {exc}", unreachable=True
            ) from exc
        return client

    async def disconnect(self, connection: aiosmtplib.SMTP) -> None:
        if connection.is_connected:
            try:
                await connection.quit()
            except (aiosmtplib.SMTPException, OSError):
                connection.close()

    async def discard(self, connection: aiosmtplib.SMTP) -> None:
        connection.close()

    async def send(self, connection: aiosmtplib.SMTP, effect: Effect) -> Confirmation:
        msg = self.message(effect)
        request = effect.request
        sender = _bare(str(request.get("from") or self.from_email))
        recipients = [
            _bare(a)
            for a in (*request.get("to", ()), *request.get("cc", ()), *request.get("bcc", ()))
        ]
        reference = str(msg["Message-ID"])
        await self._envelope(connection, sender, recipients, effect.idempotency_key)
        try:
            reply = await connection.data(msg.as_bytes())
        except aiosmtplib.SMTPDataError as exc:  # the server answered: it did not take it
            raise _refusal(exc, f"message {effect.idempotency_key!r} refused") from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise OutcomeUnknownError(
                f"{type(exc).__name__} during DATA of {reference} at {self.target}: the "
                f"server may have taken it ({exc})",
                unreachable=True,
            ) from exc
        return Confirmation(reference, {"reply": f"{reply.code} {reply.message}"})

    async def _envelope(
        self, connection: aiosmtplib.SMTP, sender: str, recipients: Sequence[str], key: str
    ) -> None:
        """MAIL FROM and every RCPT TO; any refusal ends the transaction (RSET): nothing sent."""
        try:
            await connection.mail(sender)
            for recipient in recipients:
                await connection.rcpt(recipient)
        except aiosmtplib.SMTPResponseException as exc:
            try:
                await connection.rset()
            except (aiosmtplib.SMTPException, OSError) as reset_exc:
                raise TransientRemoteError(f"{exc}; then RSET failed: {reset_exc}") from exc
            raise _refusal(exc, f"envelope of {key!r} refused") from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise TransientRemoteError(
                f"{type(exc).__name__} before the data of {key!r}: not sent ({exc})",
                unreachable=True,
            ) from exc


def _refusal(exc: aiosmtplib.SMTPResponseException, what: str) -> Exception:
    detail = f"{what}: {exc.code} {exc.message}"
    return TransientRemoteError(detail) if 400 <= exc.code < 500 else PermanentRemoteError(detail)


def _bare(address: str) -> str:
    """The addr-spec of ``address`` ("Finance <f@example.com>" -> "f@example.com")."""
    parsed = getaddresses([address])
    return parsed[0][1] if parsed and parsed[0][1] else address.strip()


def _check_address(address: object, where: str) -> None:
    if not isinstance(address, str) or _LINE_BREAK.search(address):
        raise InvalidInputError(f"{where}: {address!r} is not an email address")
    parsed = getaddresses([address])
    if len(parsed) != 1 or not _ADDRESS.fullmatch(parsed[0][1]):
        raise InvalidInputError(
            f"{where}: {address!r} is not an email address (expected local@domain, "
            "e.g. finance@example.com)"
        )
