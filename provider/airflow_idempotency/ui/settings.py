"""Where the Run keys view reads: the job database's Airflow connection and its schema.

Read by the api-server (Airflow 3) or the webserver (Airflow 2.11) from ``airflow.cfg`` or
the environment, section ``[idempotency]``:

- ``ui_conn_id`` / ``AIRFLOW__IDEMPOTENCY__UI_CONN_ID``: the Airflow connection of the job
  database (default ``idempotency_default``);
- ``ui_schema`` / ``AIRFLOW__IDEMPOTENCY__UI_SCHEMA``: the bookkeeping schema (default
  ``idempotency``);
- ``ui_pool_size`` / ``AIRFLOW__IDEMPOTENCY__UI_POOL_SIZE``: the most connections to the job
  database one api-server / webserver worker process opens (default 4);
- ``ui_pool_timeout``: how long a page waits for one of them, in seconds (default 10);
- ``ui_pool_max_idle``: how long an unused connection stays open, in seconds (default 60);
- ``ui_menu_roles`` (Airflow 2.11): the FAB roles the webserver grants the menu entry to,
  comma-separated (default ``Viewer,User,Op``; Admin has every permission; empty: manage
  the "menu access on Run keys" permission yourself).
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.schema import DEFAULT_SCHEMA, validate_schema_name

CONFIG_SECTION = "idempotency"


@dataclass(frozen=True)
class Settings:
    """Where the view reads: an Airflow connection and the bookkeeping schema."""

    conn_id: str = IdempotencyHook.default_conn_name
    schema: str = DEFAULT_SCHEMA
    pool_size: int = 4
    pool_timeout: float = 10.0
    pool_max_idle: float = 60.0
    menu_roles: tuple[str, ...] = ("Viewer", "User", "Op")

    def __post_init__(self) -> None:
        if self.pool_size < 1:
            raise InvalidInputError(
                f"[{CONFIG_SECTION}] ui_pool_size must be at least 1, not {self.pool_size}"
            )
        for name in ("pool_timeout", "pool_max_idle"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(
                    f"[{CONFIG_SECTION}] ui_{name} must be a positive number of seconds, "
                    f"not {getattr(self, name)}"
                )

    @classmethod
    def from_airflow_config(cls) -> Settings:
        from airflow.configuration import conf

        return cls(
            conn_id=conf.get(CONFIG_SECTION, "ui_conn_id", fallback=cls.conn_id),
            schema=validate_schema_name(conf.get(CONFIG_SECTION, "ui_schema", fallback=cls.schema)),
            pool_size=conf.getint(CONFIG_SECTION, "ui_pool_size", fallback=cls.pool_size),
            pool_timeout=conf.getfloat(
                CONFIG_SECTION, "ui_pool_timeout", fallback=cls.pool_timeout
            ),
            pool_max_idle=conf.getfloat(
                CONFIG_SECTION, "ui_pool_max_idle", fallback=cls.pool_max_idle
            ),
            menu_roles=tuple(
                name.strip()
                for name in conf.get(
                    CONFIG_SECTION, "ui_menu_roles", fallback=",".join(cls.menu_roles)
                ).split(",")
                if name.strip()
            ),
        )


__all__ = ["CONFIG_SECTION", "Settings"]
