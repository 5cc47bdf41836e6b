"""Sphinx configuration of the docs site: MyST Markdown pages, the furo theme.

Build it with ``.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html``
(after ``python3 dev.py setup``); tests/test_docs.py builds it the same way, warnings being
errors.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

# autodoc imports the provider, and so Airflow, which reads (and would otherwise create)
# its configuration in ~/airflow on first import: give a build without an Airflow home of
# its own a throw-away one.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="idem-docs-airflow-"))

from airflow_idempotency import __version__  # noqa: E402

project = "airflow-provider-idempotency"
author = "airflow-provider-idempotency maintainers"
copyright = "the airflow-provider-idempotency maintainers"  # noqa: A001
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinxarg.ext",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
# Headings of levels 1-3 get anchors, so pages link to each other's sections.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"

html_theme = "furo"
html_title = f"airflow-provider-idempotency {__version__}"
html_static_path: list[str] = []
