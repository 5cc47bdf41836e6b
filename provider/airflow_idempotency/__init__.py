"""Airflow provider for idempotent, safely rerunnable batch jobs."""
