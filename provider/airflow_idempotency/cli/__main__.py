"""``python -m airflow_idempotency.cli``: the console script ``airflow-idempotency``."""

from __future__ import annotations

from airflow_idempotency.cli import main

raise SystemExit(main())
