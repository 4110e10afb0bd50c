"""A stand-in farm worker for producer tests: the farm's Celery app with a `renderfarm.render`
task that records what each message carried to a Redis list, so a test can check that
submitted messages are ones a real Celery worker accepts, intact and in priority order.

Run: RENDERFARM_BROKER_URL=... celery -A tests.celery_echo_app worker --pool solo -Q QUEUE
"""

from __future__ import annotations

import json
from typing import Any

import redis
from celery import Task

from renderfarm.queue import TASK_NAME, make_app

ECHO_KEY = "test:echo"

app = make_app()


@app.task(name=TASK_NAME, bind=True)
def render(self: Task, **job: Any) -> None:
    request = self.request
    record = {"id": request.id, "job": job, "kwargsrepr": getattr(request, "kwargsrepr", None),
              "queue": request.delivery_info.get("routing_key")}
    with redis.Redis.from_url(app.conf.broker_url) as client:
        client.rpush(ECHO_KEY, json.dumps(record))
