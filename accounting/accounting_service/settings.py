"""The settings of one process of the accounting service (passed to workers as environment)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from accounting_service.faults import ENV_PREFIX, FaultSettings


@dataclass(frozen=True)
class ServiceSettings:
    """Everything one process of the service needs; passed to workers as environment."""

    dsn: str
    pool_size: int = 10
    faults: FaultSettings = field(default_factory=FaultSettings)
    # One id per run of the service, shared by its workers: stats and fault changes
    # are scoped to it, so two services on one database do not mix them.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ServiceSettings:
        dsn = environ.get(ENV_PREFIX + "DSN")
        if not dsn:
            raise ValueError(f"{ENV_PREFIX}DSN is not set")
        instance_id = environ.get(ENV_PREFIX + "INSTANCE_ID") or uuid.uuid4().hex
        return cls(
            dsn=dsn,
            pool_size=int(environ.get(ENV_PREFIX + "POOL_SIZE") or 10),
            faults=FaultSettings.from_env(environ),
            instance_id=instance_id,
        )

    def to_env(self) -> dict[str, str]:
        return {
            ENV_PREFIX + "DSN": self.dsn,
            ENV_PREFIX + "POOL_SIZE": str(self.pool_size),
            ENV_PREFIX + "INSTANCE_ID": self.instance_id,
            **self.faults.to_env(),
        }
