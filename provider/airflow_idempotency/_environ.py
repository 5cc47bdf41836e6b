"""Reads of the process environment that cost a run next to nothing when a variable is unset.

``os.environ.get(name)`` encodes the name and, for a variable that is not set, raises and
catches a ``KeyError``: about 0.8 µs, and a run reads a dozen (its fault points, its lock
wait; issue 32, goal 4). ``os.environ`` keeps its variables in a dict of encoded names
(``_data``) that its own setters keep in step (``os.environ[name] = ...``, ``del``,
``monkeypatch.setenv``, ``mock.patch.dict``); :func:`get` reads that dict, each name encoded
once. Where there is no such dict (another Python), it reads ``os.environ`` itself.
"""

from __future__ import annotations

import functools
import os


def get(name: str) -> str | None:
    """``os.environ.get(name)``."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is not dict:
        return environ.get(name)
    raw = data.get(_encoded(name))
    return None if raw is None else environ.decodevalue(raw)


@functools.lru_cache(maxsize=64)
def _encoded(name: str) -> object:
    return os.environ.encodekey(name)
