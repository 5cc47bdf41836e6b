"""The Run keys view of the Airflow 3 UI: run keys, attempts, locks and the outbound ledger.

- :mod:`~airflow_idempotency.ui.reads`: what the view reads, for one reader (Airflow-free);
- :mod:`~airflow_idempotency.ui.app`: the FastAPI app the plugin mounts on the api-server
  (pages and their JSON), with Airflow's authentication and per-DAG authorization.

The plugin module (``airflow_idempotency.plugin``), which every Airflow process loads, imports
only this package's constants: the app is built on its first request.
"""

MOUNT = "/idempotency"
"""Where the plugin mounts the app on the api-server (``url_prefix``)."""

NAV_ROUTE = "run-keys"
"""The UI route of the nav entry: ``/plugin/run-keys/<app path>`` opens any page of the app
inside Airflow's own page (its iframe follows the path), e.g. from the operator's extra link."""
