"""The Run keys view of the Airflow UI: run keys, attempts, locks and the outbound ledger.

Line-neutral:

- :mod:`~airflow_idempotency.ui.reads`: what the view reads, for one reader (Airflow-free);
- :mod:`~airflow_idempotency.ui.pages`: each page's query object and data function;
- :mod:`~airflow_idempotency.ui.rendering`: the templates, their filters, links and JSON;
- :mod:`~airflow_idempotency.ui.database`: the bounded pool of job-database connections;
- :mod:`~airflow_idempotency.ui.headers`: the security headers (CSP) of every answer;
- :mod:`~airflow_idempotency.ui.settings`: ``[idempotency] ui_*`` configuration.

Airflow 3 (the api-server):

- :mod:`~airflow_idempotency.ui.app`: the FastAPI app the plugin mounts (``create_app``);
- :mod:`~airflow_idempotency.ui.routes`: its router, a function per page and JSON twin;
- :mod:`~airflow_idempotency.ui.dependencies`: settings, access and reader as dependencies;
- :mod:`~airflow_idempotency.ui.errors`: its exception handlers.

Airflow 2.11 (the webserver): :mod:`~airflow_idempotency.ui.fab`, the Flask AppBuilder view.

The plugin module (``airflow_idempotency.plugin``), which every Airflow process loads, imports
only this package's constants: the app (3.x) is built on its first request, the Flask view
(2.11) when the webserver asks the plugin for it.
"""

MOUNT = "/idempotency"
"""Where the plugin mounts the app on the api-server (``url_prefix``)."""

AIRFLOW2_ROUTE = "/runkeys"
"""Where the Flask AppBuilder view lives on Airflow 2.11's webserver (its menu's "Run keys")."""

NAV_ROUTE = "run-keys"
"""The UI route of the nav entry: ``/plugin/run-keys/<app path>`` opens any page of the app
inside Airflow's own page (its iframe follows the path), e.g. from the operator's extra link."""
