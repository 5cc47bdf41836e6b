"""The guided demo of the invoice DAG through real Airflow (`python3 dev.py demo`).

Its plan, set-up, steps and entry point (:mod:`devtools.demo.command`).
"""
