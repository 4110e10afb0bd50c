"""The Celery app both sides share (importable without JAX), queue naming and routing.

One message is one job: task `renderfarm.render` with the job spec as keyword arguments,
so Flower shows each job's campaign, prompt and seed. JSON only, events on, late acks.
"""

from __future__ import annotations

import ssl
from urllib.parse import parse_qs, urlsplit

from celery import Celery

from renderfarm.connections import celery_settings
from renderfarm.jobs import JobSpec, Lora, loras_key
from renderfarm.settings import Settings

TASK_NAME = "renderfarm.render"
ENQUEUED_HEADER = "rf_enqueued"  # a message header: when the producer enqueued it (unix seconds)
REPR_LIMIT = 16384  # characters of a job's fields Flower shows (Celery's default cuts at 1 KiB)
QUEUE_PREFIX = "rf."
PRIORITY_STEPS = list(range(10))


def queue_name(model: str, dtype: str, variant: str | None = None, base: str | None = None,
               loras: tuple[Lora, ...] | None = None) -> str:
    """Jobs for a model go to that model's queue; a worker consumes the queue of what it holds
    (the weights variant, a single file's base and the LoRA set are part of it: other weights)."""
    name = f"{QUEUE_PREFIX}{dtype}{'' if variant is None else f'.{variant}'}.{model}"
    if base is not None:
        name += f"+base={base}"
    if loras:
        name += f"+loras={loras_key(loras)}"
    return name


def redis_priority(priority: int | None) -> int:
    """Job priority 9 is the most urgent; kombu's Redis transport serves 0 first."""
    return 9 - (5 if priority is None else priority)


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    transport = {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": settings.restore_interval,
        "unacked_restore_throttle": 1,
        # A worker killed while it scans holds the scan's lock until this expires (kombu's
        # default is 300 s, which would hold back a dead worker's jobs that long).
        "unacked_mutex_expire": 5 * settings.restore_interval,
        "queue_order_strategy": "priority",
        "priority_steps": PRIORITY_STEPS,
    }
    where = celery_settings(settings.broker_url)  # a Redis, or one behind Sentinel
    app = Celery("renderfarm", broker=where["broker_url"], backend=where["result_backend"])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        task_ignore_result=True,  # a job's result is its stored sidecar; failures are recorded
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_transport_options={**transport, **where["broker_transport_options"]},
        # The result backend and the app read their own copies of the timeout.
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout,
                                          **where["result_backend_transport_options"]},
        broker_failover_strategy=where["broker_failover_strategy"],
        visibility_timeout=settings.visibility_timeout,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        result_expires=7 * 24 * 3600,
    )
    if settings.broker_url.startswith("rediss://"):
        app.conf.broker_use_ssl = tls_options(settings.broker_url)
    # Celery cuts argument reprs at 1 KiB; a job's spec must stay whole in Flower.
    app.amqp.argsrepr_maxsize = app.amqp.kwargsrepr_maxsize = REPR_LIMIT
    return app


CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def tls_options(url: str) -> dict[str, object]:
    """The TLS settings of a `rediss://` URL's query (`ssl_cert_reqs`, `ssl_ca_certs`,
    `ssl_certfile`, `ssl_keyfile`), as redis-py and Celery's result backend read them.
    Certificates are verified unless the URL says `ssl_cert_reqs=none`."""
    query = {key: values[-1] for key, values in parse_qs(urlsplit(url).query).items()}
    reqs = query.get("ssl_cert_reqs", "required").lower().removeprefix("cert_")
    if reqs not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs={reqs!r} in the broker URL: must be required, optional or none")
    options: dict[str, object] = {"ssl_cert_reqs": CERT_REQS[reqs]}
    options.update({key: query[key] for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if key in query})
    return options


def job_message(spec: JobSpec) -> dict[str, object]:
    """The task options of one job: its id is the job id, its queue its model's, its keyword
    arguments the fields that are set (the job contract reads an absent field as null)."""
    return {
        "task_id": spec.job_id,
        "queue": queue_name(spec.model, spec.dtype, spec.variant, spec.base, spec.loras),
        "priority": redis_priority(spec.priority),
        "kwargs": {name: value for name, value in spec.to_dict().items() if value is not None},
    }


# kombu's Redis transport keeps one list per priority step: QUEUE for step 0, then
# QUEUE + SEP + step (`Channel._q_for_pri`); tests/test_broker.py checks this against kombu.
PRIORITY_SEP = "\x06\x16"


def priority_list(queue: str, step: int) -> str:
    """The Redis list that holds `queue`'s messages of one kombu priority step."""
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def priority_lists(queue: str) -> list[str]:
    """Every Redis list of `queue`, most urgent first (the order workers pop them in)."""
    return [priority_list(queue, step) for step in PRIORITY_STEPS]
