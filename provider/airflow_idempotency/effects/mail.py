"""Email through the outbound ledger: one message per effect key, at most once.

SMTP has no idempotency key: a server that got a message's data and lost the connection
before answering may have delivered it, and a resend would deliver it twice. So
:class:`SmtpSender` is a *not deduplicating* sender: the ledger records the intent before
each message and the outcome after it, and a message whose outcome was lost stays
``unknown`` until an operator resolves it (see :mod:`airflow_idempotency.ledger.senders`).

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
In smtplib's terms: ``SMTPServerDisconnected``, a timeout or another ``OSError`` before
``DATA`` is transient (not sent), during it unknown; an ``SMTPDataError`` (``DATA``
refused) or a non-250 reply to the data is a refusal (4xx transient, 5xx permanent), as is
a ``MAIL``/``RCPT`` reply other than 250/251 (what ``SMTPSenderRefused`` and
``SMTPRecipientsRefused`` report); ``SMTPAuthenticationError`` at login is permanent.
"""

from __future__ import annotations

import email.policy
import hashlib
import re
import smtplib
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, getaddresses
from typing import Any, Literal

from airflow_idempotency.exceptions import (
    ConfigurationError,
    InvalidInputError,
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.senders import BlockingEffectSender, Confirmation, Effect

# An addr-spec as it may travel in MAIL FROM / RCPT TO: local@domain, no blanks, no brackets,
# a domain of labels. Deliberately narrower than RFC 5322's (no quoted local parts).
_ADDRESS = re.compile(
    r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
_LINE_BREAK = re.compile(r"[\r\n]")
# The common case, checked without the parser: a dot-atom local part (no quotes, no dots at
# its ends or side by side) @ such a domain. getaddresses() returns it exactly as it is.
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_PLAIN_ADDRESS = re.compile(
    rf"{_ATEXT}(?:\.{_ATEXT})*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)


@dataclass(frozen=True)
class Recipients:
    """Who gets a message: ``to``, ``cc`` and ``bcc``, each an address, a comma-separated
    string, or a list (at least one address in all).

    ``email_effect(key, to=Recipients("ops@example.com", cc="cfo@example.com"), ...)``; a
    plain ``to="ops@example.com"`` is ``Recipients(to="ops@example.com")``.
    """

    to: str | Iterable[str] = ()
    cc: str | Iterable[str] = ()
    bcc: str | Iterable[str] = ()


@dataclass(frozen=True)
class SmtpSecurity:
    """How :class:`SmtpSender` secures and authenticates its connections.

    :param tls: ``"ssl"``: TLS from the first byte (SMTPS, port 465); ``"starttls"``: a plain
        connection upgraded with STARTTLS (port 587, the server must offer it); ``None``: no
        TLS (a local relay).
    :param verify: check the server's certificate and host name (TLS only).
    :param login: the user name to log in with (with ``password``); ``None``: no login.
    """

    tls: Literal["ssl", "starttls"] | None = None
    verify: bool = True
    login: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line

    def __post_init__(self) -> None:
        if self.tls not in (None, "ssl", "starttls"):
            raise InvalidInputError(
                f"SmtpSecurity: tls must be 'ssl', 'starttls' or None, not {self.tls!r}"
            )


def email_effect(
    idempotency_key: str,
    *,
    to: str | Iterable[str] | Recipients,
    subject: str,
    text: str,
    html: str | None = None,
    from_email: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Effect:
    """One email as a ledger effect: the same key must always name the same message.

    ``to``: an address, a comma-separated string, a list, or :class:`Recipients` (with
    ``cc`` and ``bcc``); ``text`` the plain body, ``html`` an optional HTML alternative;
    ``from_email`` defaults to the sender's. The request (what is fingerprinted) holds all
    of it, so a changed message under an existing key is refused, like a changed request.
    """
    recipients = to if isinstance(to, Recipients) else Recipients(to)
    request: dict[str, Any] = {
        "to": _addresses(recipients.to),
        "cc": _addresses(recipients.cc),
        "bcc": _addresses(recipients.bcc),
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


class SmtpSender(BlockingEffectSender[smtplib.SMTP]):
    """Send email effects (:func:`email_effect`) to an SMTP server, at most once each.

    Build it from an Airflow connection of the smtp provider with :meth:`from_connection`
    (host, port, login, password and the extras ``from_email``, ``timeout``,
    ``disable_ssl``, ``disable_tls``, ``ssl_context``, read as ``SmtpHook`` reads them), or
    directly.

    It speaks SMTP with the standard library's ``smtplib``, one blocking connection per
    worker of the ledger (a thread each): the ledger commits the intents of the next
    messages while these are sent.

    :param host: the SMTP server; ``port`` its port.
    :param from_email: the sender address of effects that name none.
    :param security: TLS and login (:class:`SmtpSecurity`; default: neither).
    :param timeout: seconds for the connection and each SMTP command.
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
        security: SmtpSecurity = SmtpSecurity(),
        timeout: float = 30.0,
        concurrency: int = 4,
        message_id_domain: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise InvalidInputError("SmtpSender: concurrency must be >= 1")
        if not isinstance(security, SmtpSecurity):
            raise InvalidInputError(
                f"SmtpSender: security must be an SmtpSecurity(...), not {security!r}"
            )
        self.host = host
        self.port = port
        self.from_email = from_email
        self.security = security
        self.timeout = timeout
        self.concurrency = concurrency
        self.message_id_domain = message_id_domain
        self.target = f"smtp{'s' if security.tls == 'ssl' else ''}://{host}:{port}"

    @classmethod
    def from_connection(cls, conn_id: str = "smtp_default", **overrides: Any) -> SmtpSender:
        """A sender for the Airflow connection ``conn_id`` (type smtp), as ``SmtpHook`` reads
        it: SSL unless the extra ``disable_ssl``, STARTTLS unless ``disable_tls``; the
        ``overrides`` replace what it read, e.g. ``concurrency=8`` or
        ``security=SmtpSecurity(tls="starttls", verify=False)``.

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
        security = SmtpSecurity(
            tls="ssl" if hook.use_ssl else "starttls" if hook.smtp_starttls else None,
            verify=hook.ssl_context != "none",
            login=hook.smtp_user or None,
            password=hook.smtp_password or None,
        )
        settings: dict[str, Any] = {
            "host": hook.host,
            "port": hook.port or (465 if hook.use_ssl else 25),
            "from_email": hook.from_email,
            "security": security,
            "timeout": float(hook.timeout),
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
            raise InvalidInputError(f"{where}: no recipient (give to=, or Recipients(cc=, bcc=))")
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
        if not self.security.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def connect(self) -> smtplib.SMTP:
        tls, login, password = self.security.tls, self.security.login, self.security.password
        context = self._tls_context() if tls else None
        client: smtplib.SMTP | None = None
        try:
            if tls == "ssl":
                client = smtplib.SMTP_SSL(
                    self.host, self.port, timeout=self.timeout, context=context
                )
            else:
                client = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
            client.ehlo_or_helo_if_needed()
            if tls == "starttls":
                client.starttls(context=context)
                client.ehlo()
            if login and password:
                client.login(login, password)
        except smtplib.SMTPAuthenticationError as exc:
            _close(client)
            raise PermanentRemoteError(f"SMTP login refused at {self.target}: {exc}") from exc
        except (smtplib.SMTPException, OSError) as exc:
            _close(client)
            raise TransientRemoteError(
                f"cannot connect to {self.target}: {exc}", unreachable=True
            ) from exc
        return client

    def disconnect(self, connection: smtplib.SMTP) -> None:
        try:
            connection.quit()
        except (smtplib.SMTPException, OSError):
            connection.close()

    def discard(self, connection: smtplib.SMTP) -> None:
        connection.close()

    def send(self, connection: smtplib.SMTP, effect: Effect) -> Confirmation:
        msg = self.message(effect)
        request = effect.request
        sender = _bare(str(request.get("from") or self.from_email))
        recipients = [
            _bare(a)
            for a in (*request.get("to", ()), *request.get("cc", ()), *request.get("bcc", ()))
        ]
        reference = str(msg["Message-ID"])
        self._envelope(connection, sender, recipients, effect.idempotency_key)
        try:
            # smtplib quotes leading dots and ends the data; CRLF line ends, as SMTP wants
            code, reply = connection.data(msg.as_bytes(policy=_SMTP_POLICY))
        except smtplib.SMTPDataError as exc:  # DATA itself refused: the message was not sent
            what = f"message {effect.idempotency_key!r} refused"
            raise _refusal(exc.smtp_code, exc.smtp_error, what) from exc
        except (smtplib.SMTPException, OSError) as exc:
            raise OutcomeUnknownError(
                f"{type(exc).__name__} during DATA of {reference} at {self.target}: the "
                f"server may have taken it ({exc})",
                unreachable=True,
            ) from exc
        if code != 250:  # the server answered the data: it did not take it
            raise _refusal(code, reply, f"message {effect.idempotency_key!r} refused")
        return Confirmation(reference, {"reply": f"{code} {_text(reply)}"})

    def _envelope(
        self, connection: smtplib.SMTP, sender: str, recipients: Sequence[str], key: str
    ) -> None:
        """MAIL FROM and every RCPT TO; any refusal ends the transaction (RSET): nothing sent.

        The addresses were checked (:meth:`check`): plain ``local@domain``, sent as they are.
        """
        try:
            code, reply = connection.docmd("mail", f"FROM:<{sender}>")
            if code == 250:
                for recipient in recipients:
                    code, reply = connection.docmd("rcpt", f"TO:<{recipient}>")
                    if code not in (250, 251):
                        break
        except (smtplib.SMTPException, OSError) as exc:
            raise TransientRemoteError(
                f"{type(exc).__name__} before the data of {key!r}: not sent ({exc})",
                unreachable=True,
            ) from exc
        if code in (250, 251):
            return
        refusal = f"{code} {_text(reply)}"
        try:
            reset, reset_reply = connection.docmd("rset")
        except (smtplib.SMTPException, OSError) as reset_exc:
            raise TransientRemoteError(f"{refusal}; then RSET failed: {reset_exc}") from None
        if reset != 250:
            raise TransientRemoteError(f"{refusal}; then RSET failed: {reset} {_text(reset_reply)}")
        raise _refusal(code, reply, f"envelope of {key!r} refused")


_SMTP_POLICY = email.policy.SMTP  # the default policy with CRLF line ends


def _text(reply: bytes | str) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


def _close(client: smtplib.SMTP | None) -> None:
    if client is not None:
        client.close()


def _refusal(code: int, reply: bytes | str, what: str) -> Exception:
    detail = f"{what}: {code} {_text(reply)}"
    return TransientRemoteError(detail) if 400 <= code < 500 else PermanentRemoteError(detail)


def _bare(address: str) -> str:
    """The addr-spec of ``address`` ("Finance <f@example.com>" -> "f@example.com")."""
    if _PLAIN_ADDRESS.fullmatch(address):
        return address
    parsed = getaddresses([address])
    return parsed[0][1] if parsed and parsed[0][1] else address.strip()


def _check_address(address: object, where: str) -> None:
    if isinstance(address, str) and _PLAIN_ADDRESS.fullmatch(address):
        return  # what the parse below accepts, ~1 us instead of ~20
    if not isinstance(address, str) or _LINE_BREAK.search(address):
        raise InvalidInputError(f"{where}: {address!r} is not an email address")
    parsed = getaddresses([address])
    if len(parsed) != 1 or not _ADDRESS.fullmatch(parsed[0][1]):
        raise InvalidInputError(
            f"{where}: {address!r} is not an email address (expected local@domain, "
            "e.g. finance@example.com)"
        )
