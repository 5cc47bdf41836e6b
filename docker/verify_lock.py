"""Fail the image build unless every installed distribution is pinned, at that version, in the lock.

The image installs the runtime part of requirements/lock.txt (the lock used as constraints).
A constraint only pins packages that appear in the lock: a dependency missing from it would
be installed at whatever version the index offers that day. This check turns that silent
drift into a build error.

Usage: python verify_lock.py LOCK_FILE [ALLOWED_UNPINNED ...]
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", re.MULTILINE)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as fh:
        pins = {_norm(name): version for name, version in _PIN.findall(fh.read())}
    allowed = {_norm(name) for name in argv[2:]}
    problems = []
    installed = 0
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"])
        installed += 1
        if name in allowed:
            continue
        if name not in pins:
            problems.append(f"{name}=={dist.version} is installed but not pinned in the lock")
        elif pins[name] != dist.version:
            problems.append(f"{name}=={dist.version} is installed, the lock pins {pins[name]}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"verify_lock: {installed} installed distributions all match {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
