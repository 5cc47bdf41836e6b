"""A real Airflow 3 stack (api-server, scheduler, dag-processor) as background processes.

:func:`airflow_stack` and :class:`AirflowStack` (``stack.py``: Airflow's CLI and REST verbs)
stand on ``processes.py`` (the components as process groups), ``metadata.py`` (the metadata
database, read straight) and ``environment.py`` (the settings and the migrated template).
"""

from devtools.airflow_stack.environment import REDIS_URL, free_port, migrated_db_template
from devtools.airflow_stack.metadata import RunResult
from devtools.airflow_stack.processes import StackError
from devtools.airflow_stack.stack import AirflowStack, airflow_stack, run_id_from_trigger_output

__all__ = [
    "REDIS_URL",
    "AirflowStack",
    "RunResult",
    "StackError",
    "airflow_stack",
    "free_port",
    "migrated_db_template",
    "run_id_from_trigger_output",
]
