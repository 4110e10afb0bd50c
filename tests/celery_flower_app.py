"""A tiny Celery app for the Flower tests: the farm's real app configuration
(`renderfarm.queue.make_app`) with a trivial task under the real job task name, so a real
Celery worker can serve jobs without JAX.

    RENDERFARM_BROKER_URL=redis://... celery -A tests.celery_flower_app worker \
        --pool solo -Q rf.float32.MODEL -n NAME@HOST
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from renderfarm.queue import TASK_NAME, make_app
from renderfarm.settings import Settings


def create_app(broker_url: str) -> Celery:
    app = make_app(Settings(broker_url=broker_url))

    @app.task(name=TASK_NAME, bind=True)
    def render(self: Any, **spec: Any) -> dict[str, str]:
        return {"job_id": self.request.id, "campaign": spec["campaign"]}

    return app


app = create_app(Settings.from_env().broker_url)
