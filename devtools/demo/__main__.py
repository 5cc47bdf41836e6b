"""`python -m devtools.demo`: runs :func:`devtools.demo.command.main`."""

from devtools.demo.command import main

if __name__ == "__main__":
    raise SystemExit(main())
