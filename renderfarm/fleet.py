"""What each worker has done, in Redis, so `renderfarm status` can show the fleet.

The jobs a worker stores add to its hash (`rf:fleet:NODE`), a bundle's at a time: images,
megapixel-steps (the throughput unit AI Horde uses across sizes: width x height / 1e6 x
steps per image), jobs and slots (how full its batches ran), the time of its first and last
batch, and the queue it serves. One pipelined round trip a bundle; a hash expires a week
after its last batch, so workers long gone leave nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

PREFIX = "rf:fleet:"
NODES = "rf:fleet"
KEEP_SECONDS = 7 * 24 * 3600
STALL_SECONDS = 300.0  # a worker whose queue has jobs and that finished none for this long is flagged


def record_stored(client: redis.Redis, node: str, queue: str, records: Iterable[Mapping[str, Any]]) -> None:
    """Add stored jobs (their sidecars: a bundle's, from one batch or several) to `node`'s totals."""
    records = list(records)
    if not records:
        return
    now = time.time()
    mp_steps = sum(r["width"] * r["height"] / 1e6 * r["spec"]["steps"] for r in records)
    batches = {(r["batch"]["seq"], r["batch"]["jobs"], r["batch"]["slots"]) for r in records}
    pipe = client.pipeline(transaction=False)
    name = PREFIX + node
    pipe.hincrby(name, "images", len(records))
    pipe.hincrbyfloat(name, "megapixel_steps", mp_steps)
    pipe.hincrby(name, "jobs", sum(jobs for _, jobs, _ in batches))
    pipe.hincrby(name, "slots", sum(slots for _, _, slots in batches))
    pipe.hsetnx(name, "first_batch", now)
    pipe.hset(name, mapping={"last_batch": now, "queue": queue})
    pipe.expire(name, KEEP_SECONDS)
    pipe.sadd(NODES, node)
    pipe.execute()


def fleet(client: redis.Redis, waiting: Mapping[str, int], now: float | None = None) -> list[dict[str, Any]]:
    """Each worker that has stored a batch in the last week: images, images/s and
    megapixel-steps/s (from its first batch to its last), batch fill, seconds since its last
    batch, and `stalled` when its queue has jobs (`waiting`: queue -> jobs) and it has
    finished none for STALL_SECONDS."""
    now = time.time() if now is None else now
    nodes = sorted(n.decode() for n in client.smembers(NODES))
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.hgetall(PREFIX + node)
    workers = []
    for node, raw in zip(nodes, pipe.execute()):
        if not raw:
            client.srem(NODES, node)  # expired
            continue
        h = {k.decode(): v.decode() for k, v in raw.items()}
        first, last = float(h["first_batch"]), float(h["last_batch"])
        span = last - first
        since = now - last
        images, mp_steps = int(h["images"]), float(h["megapixel_steps"])
        workers.append({
            "node": node, "queue": h["queue"], "images": images,
            "images_per_second": images / span if span > 0 else None,
            "megapixel_steps_per_second": mp_steps / span if span > 0 else None,
            "batch_fill": int(h["jobs"]) / int(h["slots"]),
            "seconds_since_last_batch": since,
            "stalled": since > STALL_SECONDS and waiting.get(h["queue"], 0) > 0,
        })
    return workers
