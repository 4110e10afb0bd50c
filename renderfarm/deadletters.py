"""Dead letters: messages a worker could not take, kept per queue with the reason.

A message that is not a valid job (its envelope, or its job fields) is acknowledged so it is
never delivered again, and moved here: the operator sees how many (`renderfarm status`),
reads why (`renderfarm deadletters`), and can put them back on their queue once the cause is
fixed (`--requeue`) or drop them (`--purge`). Each queue keeps its newest MAX_KEPT entries
(older ones are dropped; the count of all stays), and a message over KEPT_MESSAGE_BYTES is
kept cut, so hostile traffic cannot fill Redis.

Keys:
  rf:dead:QUEUE   list of JSON entries, newest first
  rf:dead         hash queue -> messages dead-lettered so far
"""

from __future__ import annotations

import base64
import json
import socket
import time
from typing import Any

import redis

from renderfarm.jobs import JobError, check_campaign
from renderfarm.progress import REQUEUE, key
from renderfarm.queue import priority_list, redis_priority

COUNTS = "rf:dead"
MAX_KEPT = 1000
KEPT_MESSAGE_BYTES = 64 * 1024  # what a dead letter keeps of its message (the worker refuses over 1 MiB)
NO_CAMPAIGN = "-"  # stands for a letter's campaign where it has none (lua/requeue.lua then reads no campaign key)


def entries_key(queue: str) -> str:
    return f"{COUNTS}:{queue}"


def entry(queue: str, reason: str, message: bytes, job_id: str | None = None) -> str:
    """One dead letter as stored: when, where, why, and the message (base64, maybe cut)."""
    return json.dumps({
        "at": time.time(),
        "queue": queue,
        "reason": reason,
        "job_id": job_id,
        "worker": socket.gethostname(),
        "bytes": len(message),
        "truncated": len(message) > KEPT_MESSAGE_BYTES,
        "message": base64.b64encode(message[:KEPT_MESSAGE_BYTES]).decode("ascii"),
    })


def add(pipe: Any, queue: str, reason: str, message: bytes, job_id: str | None = None) -> None:
    """Queue the commands that keep one dead letter on `pipe` (a redis-py pipeline), so a
    caller can make them one transaction with the message's acknowledgement."""
    pipe.lpush(entries_key(queue), entry(queue, reason, message, job_id))
    pipe.ltrim(entries_key(queue), 0, MAX_KEPT - 1)
    pipe.hincrby(COUNTS, queue, 1)


class DeadLetters:
    """The operator's side: counts, entries, requeue, purge."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._requeue = client.register_script(REQUEUE)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per queue: dead-lettered so far, and kept now."""
        totals = {k.decode(): int(v) for k, v in self.r.hgetall(COUNTS).items()}
        pipe = self.r.pipeline(transaction=False)
        for queue in totals:
            pipe.llen(entries_key(queue))
        return {queue: {"total": total, "kept": kept} for (queue, total), kept in zip(totals.items(), pipe.execute())}

    def entries(self, queue: str, limit: int = 100) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.r.lrange(entries_key(queue), 0, limit - 1)]

    def requeue(self, queue: str) -> tuple[int, int]:
        """Put the kept messages of `queue` back on it, oldest first (a worker checks them
        again), each moved in one script (lua/requeue.lua): a letter of a windowed campaign
        becomes open, as its feeder's admit makes a job, so a run of the campaign does not
        send it again, and one a run sent again meanwhile is not pushed twice. Cut ones
        cannot be requeued and are dropped. Only the letters kept when it starts are moved
        (at most as many, and none after the newest of them): a worker that refuses a
        requeued message again dead-letters it anew, and that letter waits for the next
        requeue instead of making this one run for ever. Returns (requeued, dropped)."""
        requeued = dropped = 0
        letters = entries_key(queue)
        pipe = self.r.pipeline()  # MULTI/EXEC: the count and the newest of one moment
        pipe.llen(letters)
        pipe.lindex(letters, 0)
        left, newest = pipe.execute()
        while left and (raw := self.r.lindex(letters, -1)) is not None:
            letter = json.loads(raw)
            message = base64.b64decode(letter["message"])
            campaign, job_id = _job(message, letter.get("job_id"))
            keys = [letters, priority_list(queue, _priority(message)),
                    *(key(campaign or NO_CAMPAIGN, what) for what in ("open", "counts", "failed", "attempts"))]
            # -1: the letter is gone already (taken by another requeue or a purge, or by this
            # script itself, sent again after its reply was lost): one fewer to move all the same
            moved = self._requeue(keys=keys, args=[raw, b"" if letter["truncated"] else message, job_id or ""])
            requeued += moved == 1
            dropped += moved == 0 and letter["truncated"]
            left -= 1
            if raw == newest:
                break
        return requeued, dropped

    def purge(self, queue: str) -> int:
        pipe = self.r.pipeline()
        pipe.llen(entries_key(queue))
        pipe.delete(entries_key(queue))
        pipe.hdel(COUNTS, queue)
        return int(pipe.execute()[0])


def _priority(message: bytes) -> int:
    """The priority step a message was sent with (that of a job without one, if unreadable)."""
    try:
        step = json.loads(message)["properties"]["priority"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return redis_priority(None)
    return step if type(step) is int and 0 <= step <= 9 else redis_priority(None)


def _job(message: bytes, job_id: object) -> tuple[str | None, str | None]:
    """The campaign and job id of a dead letter's message, (None, None) unless both are
    readable: a letter without them goes back on its queue without any campaign's books."""
    try:
        envelope = json.loads(message)
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        campaign = check_campaign(json.loads(body)[1]["campaign"])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError, JobError):
        return None, None
    return (campaign, job_id) if isinstance(job_id, str) else (None, None)
