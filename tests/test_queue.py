"""The Celery app both sides share: what it promises about serialization, delivery and routing."""

from __future__ import annotations

from renderfarm.jobs import parse_job
from renderfarm.progress import Progress
from renderfarm.queue import job_message, make_app, queue_name, redis_priority
from renderfarm.settings import Settings


def test_json_only_events_on_late_acks() -> None:
    conf = make_app(Settings(broker_url="redis://127.0.0.1:1/0")).conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.result_accept_content == ["json"] and conf.result_serializer == "json"
    assert conf.worker_send_task_events and conf.task_acks_late and conf.task_reject_on_worker_lost


def test_visibility_timeout_reaches_broker_backend_and_app(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("RENDERFARM_VISIBILITY_TIMEOUT", "123")
    conf = make_app().conf
    assert conf.broker_transport_options["visibility_timeout"] == 123
    assert conf.result_backend_transport_options["visibility_timeout"] == 123
    assert conf.visibility_timeout == 123


def test_passwords_and_tls_urls() -> None:
    for url in ("redis://:s3cret@redis.internal:6380/2",
                "rediss://user:s3cret@redis.internal:6380/0?ssl_cert_reqs=required"):
        app = make_app(Settings(broker_url=url))
        assert app.conf.broker_url == url
        assert app.backend.connparams["password"] == "s3cret"  # the result backend parses it too
        assert Progress.from_url(url).r.connection_pool.connection_kwargs["password"] == "s3cret"


def test_routing_by_model_and_priority() -> None:
    spec = parse_job({"prompt": "a fox", "model": "org/sd@v1", "seed": 1, "priority": 9, "campaign": "c"})
    message = job_message(spec)
    assert message["queue"] == queue_name("org/sd@v1", "float32") == "rf.float32.org/sd@v1"
    assert message["task_id"] == spec.job_id and message["kwargs"]["campaign"] == "c"
    assert redis_priority(9) < redis_priority(None) < redis_priority(0)  # kombu serves 0 first
