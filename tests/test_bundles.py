"""One bundle's life as one object (worker/bundles.py): its states and their order, the jobs it
holds until each one's outcome is recorded, a stored result settling a job of its own bundle
only, and the hooks that fire on its state changes (worker/hooks.py)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest
import redis
from prometheus_client import generate_latest

from renderfarm.fleet import PREFIX
from renderfarm.jobs import parse_job
from renderfarm.layout import index_name
from renderfarm.queue import ENQUEUED_HEADER
from renderfarm.storage import open_storage
from harness.farm import STEPS
from worker.bundles import Bundle, BundleHook, Job, State
from worker.engine import Batch, Rendered, ShapeKey
from worker.hooks import FleetHook, GalleryHook, MetricsHook
from worker.metrics import WorkerMetrics
from worker.output import ResultWriter

KEY = ShapeKey(64, 64, STEPS, "pndm")


def job(prompt: str, campaign: str = "c", enqueued: float | None = None) -> Job:
    spec = parse_job({"prompt": prompt, "model": "m", "seed": 1, "steps": STEPS, "width": 64, "height": 64,
                      "campaign": campaign})
    # Celery's request, as far as a bundle and its hooks read it
    request = SimpleNamespace(request_dict={ENQUEUED_HEADER: enqueued} if enqueued is not None else {})
    return Job(request, spec, KEY)  # type: ignore[arg-type]


def rendered(jobs: list[Job], one_by_one: bool = False) -> list[Rendered]:
    """Their results from one batch, or from one each (after their batch raised)."""
    def device_batch(i: int) -> Batch:
        return Batch(i, 1, 8, 0.5, 4.0) if one_by_one else Batch(0, len(jobs), 8, 0.5, 4.0)

    return [Rendered(i, j.spec, np.full((64, 64, 3), 40 * i, np.uint8), KEY, False, device_batch(i))
            for i, j in enumerate(jobs)]


def record(j: Job) -> dict[str, Any]:
    """A sidecar, as far as a bundle and its hooks read it (its batch: 2 jobs in 8 slots)."""
    return {"job_id": j.spec.job_id, "spec": j.spec.to_dict(), "width": 64, "height": 64,
            "batch": {"seq": 0, "jobs": 2, "slots": 8}, "device_seconds": 0.5}


def gathered(*jobs: Job, hooks: tuple[BundleHook, ...] = ()) -> Bundle:
    bundle = Bundle(KEY, hooks)
    for j in jobs:
        bundle.add(j)
    return bundle


class Events(BundleHook):
    """Writes down every event it is told of, with the bundle's state and jobs at that moment."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, State, int]] = []

    def admitted(self, bundle: Bundle) -> None:
        self.seen.append(("admitted", bundle.state, len(bundle.jobs)))

    def rendered(self, bundle: Bundle) -> None:
        self.seen.append(("rendered", bundle.state, len(bundle.rendered)))

    def settled(self, bundle: Bundle) -> None:
        self.seen.append(("settled", bundle.state, len(bundle.records)))


class Broken(BundleHook):
    def settled(self, bundle: Bundle) -> None:
        raise RuntimeError("a hook that fails")


def test_a_bundle_goes_through_its_states_in_order_and_no_other_way() -> None:
    a, b = job("a"), job("b")
    bundle = gathered(a, b)
    assert bundle.state is State.GATHERED and bundle.jobs == [a, b]
    with pytest.raises(RuntimeError, match="cannot become storing"):
        bundle.storing(rendered([a, b]))  # not rendered yet
    bundle.compiling()
    with pytest.raises(RuntimeError, match="jobs are added while it is gathered only"):
        bundle.add(job("c"))
    bundle.rendering(None)
    bundle.rendering(None)  # its jobs one by one after the devices raised: rendering still
    with pytest.raises(RuntimeError, match="cannot become compiling"):
        bundle.compiling()
    bundle.storing(rendered([a, b]))
    assert bundle.state is State.STORING and bundle.inflight is None
    assert bundle.stored([record(a), record(b)]) == [(a, record(a)), (b, record(b))]
    assert bundle.state is State.SETTLED and bundle.jobs == []
    assert list(bundle.entered) == [State.GATHERED, State.COMPILING, State.RENDERING, State.STORING, State.SETTLED]
    assert list(bundle.entered.values()) == sorted(bundle.entered.values())
    with pytest.raises(RuntimeError, match="cannot become"):
        bundle.rendering(None)


def test_a_bundle_is_settled_when_its_last_job_is_let_go_and_only_then() -> None:
    events = Events()
    a, b = job("a"), job("b")
    bundle = gathered(a, b, hooks=(events,))
    assert bundle.release(a) is a and bundle.state is State.GATHERED  # e.g. its campaign was cancelled
    assert bundle.release(b) is b and bundle.state is State.SETTLED
    assert events.seen == [("settled", State.SETTLED, 0)]  # never admitted: nothing was left to render
    assert bundle.release_all() == [] and events.seen == [("settled", State.SETTLED, 0)]  # once


def test_a_stored_result_settles_a_job_of_its_own_bundle_only() -> None:
    a, twice, other = job("a"), job("a"), job("a", campaign="other")  # `twice`: a message delivered again
    mine, theirs = gathered(a, twice), gathered(other)
    for bundle in (mine, theirs):
        bundle.rendering(None)
    mine.storing(rendered([a, twice]))
    assert a.ident == twice.ident != other.ident
    assert mine.stored([record(other)]) == []  # the same spec in another campaign is another job
    assert theirs.jobs == [other] and mine.jobs == [a, twice]
    assert mine.stored([record(a)]) == [(a, record(a))]  # one result, one job
    assert mine.jobs == [twice] and mine.state is State.STORING
    assert mine.unstored(rendered([twice])[0]) is twice  # its store failed: to be put back on the queue
    assert mine.state is State.SETTLED and mine.unstored(rendered([twice])[0]) is None
    assert theirs.state is State.RENDERING


def test_a_drain_takes_what_a_bundle_holds_and_a_late_result_finds_nothing() -> None:
    a, b = job("a"), job("b")
    bundle = gathered(a, b)
    bundle.rendering(None)
    bundle.storing(rendered([a, b]))
    assert bundle.stored([record(a)]) == [(a, record(a))]
    assert bundle.release_all() == [b] and bundle.state is State.SETTLED
    assert bundle.stored([record(b)]) == []  # put back on the queue already: not acknowledged as well
    assert bundle.release_all() == []


def test_hooks_hear_each_state_change_once_and_one_that_fails_stops_nothing() -> None:
    events, broken, after = Events(), Broken(), Events()
    a, b, c = job("a"), job("b"), job("c")
    bundle = gathered(a, b, c, hooks=(events, broken, after))
    bundle.release(c)  # stored already: not admitted
    bundle.compiling()
    bundle.rendering(None)
    bundle.storing(rendered([a, b]))
    bundle.stored([record(a)])
    bundle.unstored(rendered([a, b])[1])
    expected = [("admitted", State.COMPILING, 2), ("rendered", State.STORING, 2), ("settled", State.SETTLED, 1)]
    assert events.seen == expected and after.seen == expected
    assert bundle.state is State.SETTLED


def test_metrics_hook_counts_queue_waits_renders_and_stores(sd_engine: Any) -> None:
    metrics = WorkerMetrics("cpu", 8)
    hook = MetricsHook(metrics, sd_engine)
    a, b = job("a", enqueued=time.time() - 5), job("b", enqueued=time.time() - 7)
    bundle = gathered(a, b, hooks=(hook,))
    bundle.rendering(None)
    assert metrics.queue_wait._sum.get() == pytest.approx(12, abs=1)  # two waits of about 5 and 7 s
    bundle.storing(rendered([a, b], one_by_one=True))  # after their batch raised: two batches
    assert metrics.batches._value.get() == 2 and metrics.render_seconds._sum.get() == pytest.approx(1.0)
    time.sleep(0.05)
    bundle.stored([record(a), record(b)])
    text = generate_latest(metrics.registry).decode()
    assert 'renderfarm_images_rendered_total{campaign="c"} 2.0' in text
    assert metrics.store_seconds._sum.get() >= 0.05  # from its hand-over to the writer to its settling


def test_metrics_hook_counts_no_store_of_a_bundle_that_stored_nothing(sd_engine: Any) -> None:
    metrics = WorkerMetrics("cpu", 8)
    a = job("a")
    bundle = gathered(a, hooks=(MetricsHook(metrics, sd_engine),))
    bundle.rendering(None)
    bundle.storing(rendered([a]))
    bundle.release_all()  # a drain put it back
    assert metrics.store_seconds._sum.get() == 0 and 'renderfarm_images_rendered_total{' not in \
        generate_latest(metrics.registry).decode()


def test_fleet_hook_adds_each_stored_bundle_to_the_workers_totals(broker: str) -> None:
    client = redis.Redis.from_url(broker)
    hook = FleetHook(client, "w@host", "rf.float32.m")
    a, b, c = job("a"), job("b"), job("c")
    bundle = gathered(a, b, hooks=(hook,))
    bundle.rendering(None)
    bundle.storing(rendered([a, b]))
    bundle.stored([record(a), record(b)])
    nothing = gathered(c, hooks=(hook,))
    nothing.release(c)  # settled without storing anything: not a bundle of the fleet's
    totals = client.hgetall(PREFIX + "w@host")
    assert (totals[b"images"], totals[b"jobs"], totals[b"slots"], totals[b"queue"]) == (b"2", b"2", b"8",
                                                                                       b"rf.float32.m")


def test_gallery_hook_refreshes_stored_campaigns_and_once_more_when_quiet(sd_model: Any, tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "out"))
    hook = GalleryHook(storage, None, quiet=0.2)

    def store(*jobs: Job) -> None:
        bundle = gathered(*jobs, hooks=(hook,))
        bundle.rendering(None)
        bundle.storing(rendered(list(jobs)))
        records: list[dict[str, Any]] = []
        with ResultWriter(storage, sd_model, jax.devices()) as writer:  # stored as the worker stores them
            writer.submit(bundle.rendered, on_stored=records.extend)
        bundle.stored(records)
        caught_up()

    def caught_up() -> None:
        hook.thread.submit(lambda: None).result()

    store(job("a", campaign="g1"), job("b", campaign="g2"))
    assert storage.exists(index_name("g1")) and storage.exists(index_name("g2"))  # at once, the first time
    storage.path(index_name("g1")).unlink()
    store(job("c", campaign="g1"))  # refreshed again at most every 30 s while the campaign runs
    assert not storage.exists(index_name("g1"))
    hook.polled(busy=False)  # not quiet for long enough
    caught_up()
    assert not storage.exists(index_name("g1"))
    time.sleep(0.3)
    hook.polled(busy=True)  # the devices or the writer have work: later
    caught_up()
    assert not storage.exists(index_name("g1"))
    hook.polled(busy=False)
    caught_up()
    assert storage.exists(index_name("g1"))
    assert '<span id="total">2 images</span>' in storage.get(index_name("g1")).decode()  # both of its jobs
