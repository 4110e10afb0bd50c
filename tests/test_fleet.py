"""The fleet in `renderfarm status`: per worker images/s, megapixel-steps/s, batch fill, time
since its last batch, and a flag on a worker whose queue has jobs but that finishes none."""

from __future__ import annotations

import json
import time

import redis

from producer.submit import submit
from renderfarm.fleet import STALL_SECONDS, fleet, record_stored
from tests.helpers import Cli


def records(n: int, seq: int, slots: int, width: int = 512, height: int = 512, steps: int = 25) -> list[dict]:
    """Sidecars of one stored batch, as far as the fleet reads them."""
    return [{"width": width, "height": height, "spec": {"steps": steps},
             "batch": {"seq": seq, "jobs": n, "slots": slots}} for _ in range(n)]


def test_a_workers_totals_rates_and_fill(broker: str) -> None:
    client = redis.Redis.from_url(broker)
    record_stored(client, "w1@host", "rf.float32.m", records(8, seq=0, slots=8))
    start = float(client.hget("rf:fleet:w1@host", "first_batch"))
    client.hset("rf:fleet:w1@host", "first_batch", start - 10)  # the first batch was 10 s ago
    record_stored(client, "w1@host", "rf.float32.m", records(4, seq=1, slots=8, width=1024, height=1024, steps=4))
    (worker,) = fleet(client, {"rf.float32.m": 0})
    assert (worker["node"], worker["queue"], worker["images"]) == ("w1@host", "rf.float32.m", 12)
    assert abs(worker["images_per_second"] - 1.2) < 0.02  # over ~10 s
    mp_steps = 8 * 512 * 512 / 1e6 * 25 + 4 * 1024 * 1024 / 1e6 * 4  # 52.4288 + 16.777216
    assert abs(worker["megapixel_steps_per_second"] - mp_steps / 10) < 0.1
    assert worker["batch_fill"] == 12 / 16 and not worker["stalled"]


def test_a_worker_that_stopped_finishing_jobs_is_flagged(broker: str, cli: Cli) -> None:
    client = redis.Redis.from_url(broker)
    record_stored(client, "stuck@host", "rf.float32.some/model", records(8, seq=0, slots=8))
    later = time.time() + STALL_SECONDS + 1
    assert fleet(client, {"rf.float32.some/model": 0}, now=later)[0]["stalled"] is False  # nothing to do
    assert fleet(client, {"rf.float32.some/model": 3}, now=later)[0]["stalled"] is True
    assert fleet(client, {"rf.float32.some/model": 3})[0]["stalled"] is False  # its last batch was just now
    client.hset("rf:fleet:stuck@host", "last_batch", time.time() - STALL_SECONDS - 5)
    submit(["a", "b", "c"], model="some/model", campaign="st", seed=0, broker=broker)
    code, out, _ = cli("status", "st", "--json", "--broker", broker)
    report = json.loads(out)
    assert [w["node"] for w in report["workers"] if w["stalled"]] == ["stuck@host"]
    assert any(w.startswith("worker stuck@host has finished no job for") for w in report["warnings"])
    code, out, _ = cli("status", "st", "--broker", broker)
    assert "stuck@host: 8 images, batches 100% full, last batch 0:05:0" in out and "STALLED" in out
