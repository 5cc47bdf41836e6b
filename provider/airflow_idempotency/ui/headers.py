"""The security headers of the view's responses (line-neutral).

The pages are shown in Airflow's own page (3.x: its iframe, same origin; 2.11: inside its
layout), so a script injected into one of them could script Airflow's page too. The
Content-Security-Policy lets only the page's own inline style and script run (a nonce per
response; no inline handlers, no ``style`` attributes), fetch only this origin (the JSON
twins, Airflow's REST API for a rerun), and be framed only by this origin
(``frame-ancestors 'self'``: Airflow's iframe keeps working, another site's does not).
"""

from __future__ import annotations

import secrets


def new_nonce() -> str:
    """A fresh CSP nonce for one response."""
    return secrets.token_urlsafe(16)


def security_headers(nonce: str | None) -> dict[str, str]:
    """The headers of one response: a page's (``nonce`` given) or a JSON answer's."""
    if nonce is None:  # JSON: nothing may run, nothing may frame it but this origin
        policy = "default-src 'none'; frame-ancestors 'self'; base-uri 'none'"
    else:
        policy = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
            "frame-ancestors 'self'"
        )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "SAMEORIGIN",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


__all__ = ["new_nonce", "security_headers"]
