"""The Run keys view of the Airflow 3 UI: run keys, attempts, locks and the outbound ledger.

- :mod:`~airflow_idempotency.ui.reads`: what the view reads, for one reader (Airflow-free);
- :mod:`~airflow_idempotency.ui.app`: the FastAPI app the plugin mounts on the api-server
  (pages and their JSON), with Airflow's authentication and per-DAG authorization.

Nothing here is imported by the plugin module itself (``airflow_idempotency.plugin``), which
every Airflow process loads: the app is built on its first request.
"""
