"""`python3 dev.py lint`: ruff (lint and format check) and mypy, failing on any finding."""

from __future__ import annotations

import subprocess
import sys

CHECKS = [
    ["ruff", "check", "."],
    ["ruff", "format", "--check", "."],
    ["mypy"],
]


def main() -> int:
    failed = 0
    for check in CHECKS:
        print(f"$ {' '.join(check)}", flush=True)
        failed |= subprocess.run([sys.executable, "-m", *check]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
