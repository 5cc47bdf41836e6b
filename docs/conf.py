"""Sphinx configuration of the docs site: MyST Markdown pages, the furo theme.

Build it with ``.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html``
(after ``python3 dev.py setup``); tests/docs/test_docs.py builds it the same way, warnings being
errors.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# autodoc imports the provider, and so Airflow, which reads (and would otherwise create)
# its configuration in ~/airflow on first import: give a build without an Airflow home of
# its own a throw-away one.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="idem-docs-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)

from airflow_idempotency import __version__

project = "airflow-provider-idempotency"
author = "airflow-provider-idempotency maintainers"
copyright = "the airflow-provider-idempotency maintainers"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinxarg.ext",
    "sphinxcontrib.mermaid",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
# A ```mermaid block is a diagram on GitHub and, through sphinxcontrib-mermaid, on the site.
myst_fence_as_directive = ["mermaid"]
# Headings of levels 1-3 get anchors, so pages link to each other's sections.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"

html_theme = "furo"
html_title = f"airflow-provider-idempotency {__version__}"
html_static_path: list[str] = []
