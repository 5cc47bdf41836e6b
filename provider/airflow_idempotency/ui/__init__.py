"""The Run keys view of the Airflow UI: run keys, attempts, locks and the outbound ledger.

Line-neutral:

- :mod:`~airflow_idempotency.ui.reads`: what the view reads, for one reader (Airflow-free);
- :mod:`~airflow_idempotency.ui.pages`: each page's query object and data function;
- :mod:`~airflow_idempotency.ui.rendering`: the templates, their filters, links and JSON;
- :mod:`~airflow_idempotency.ui.database`: connections to the job database;
- :mod:`~airflow_idempotency.ui.settings`: ``[idempotency] ui_*`` configuration.

Airflow 3 (the api-server):

- :mod:`~airflow_idempotency.ui.app`: the FastAPI app the plugin mounts (``create_app``);
- :mod:`~airflow_idempotency.ui.routes`: its router, a function per page and JSON twin;
- :mod:`~airflow_idempotency.ui.dependencies`: settings, access and reader as dependencies;
- :mod:`~airflow_idempotency.ui.errors`: its exception handlers.

The plugin module (``airflow_idempotency.plugin``), which every Airflow process loads, imports
only this package's constants: the app is built on its first request.
"""

MOUNT = "/idempotency"
"""Where the plugin mounts the app on the api-server (``url_prefix``)."""

NAV_ROUTE = "run-keys"
"""The UI route of the nav entry: ``/plugin/run-keys/<app path>`` opens any page of the app
inside Airflow's own page (its iframe follows the path), e.g. from the operator's extra link."""
