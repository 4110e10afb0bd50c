"""Everything a farm process reads from its environment, in one place, with its default."""

from __future__ import annotations

import dataclasses
import os
import re


@dataclasses.dataclass(frozen=True)
class Settings:
    broker_url: str = "redis://localhost:6379/0"
    # Seconds before a job held by a worker that died is delivered again. A living worker
    # re-stamps the messages it holds every quarter of this (worker.broker), so it bounds
    # only how long a dead worker's jobs wait.
    visibility_timeout: int = 300
    # How often (seconds) a worker scans for such jobs (kombu scans every interval x throttle).
    restore_interval: int = 10
    max_attempts: int = 3  # a job that fails this many times is failed for good
    # Transient failures (storage or the broker away) a job is forgiven before its attempts count.
    max_refunds: int = 5

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = os.environ
        values = {
            "broker_url": env.get("RENDERFARM_BROKER_URL", cls.broker_url),
            "visibility_timeout": int(env.get("RENDERFARM_VISIBILITY_TIMEOUT", cls.visibility_timeout)),
            "restore_interval": int(env.get("RENDERFARM_RESTORE_INTERVAL", cls.restore_interval)),
            "max_attempts": int(env.get("RENDERFARM_MAX_ATTEMPTS", cls.max_attempts)),
            "max_refunds": int(env.get("RENDERFARM_MAX_REFUNDS", cls.max_refunds)),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def redacted(text: str) -> str:
    """Text safe to print or log: the password of each URL in it replaced by ***. As redis-py
    reads a URL, the password runs to the address's last `@` (it may hold `@` and `/`)."""
    return re.sub(r"([a-z][a-z0-9+.-]*://[^:@/\s]*:)\S*@", r"\1***@", text, flags=re.IGNORECASE)
