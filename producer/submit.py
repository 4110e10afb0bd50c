"""Submission: validated jobs into their models' queues as real Celery task messages, fast.

Two streaming passes over the input keep memory flat in its size and enqueue nothing from a
bad file: the first only validates, the second enqueues in chunks. A chunk costs a handful of
Redis round trips, not one per job: which jobs are already done, the campaign bookkeeping,
and the messages (one LPUSH per queue and priority; a windowed campaign's bookkeeping and
messages go in one atomic script, Progress.admit). Building a message through Celery and
kombu for each job (`as_task_v2`, `send_task_message`, `Producer.publish`) cost most of a
submit's time, so `_TaskMessages` builds one message per queue and priority with
placeholders, and each job fills in its id, kwargs and delivery tag. The message keeps only
what a worker reads (see _TaskMessages), so a queued job costs Redis less than half of what
`send_task` writes; tests/test_producer.py checks that Celery reads both the same way.

A submission records its job ids per campaign (`rf:c:CAMPAIGN:submission:ID`, expiring), so
`wait` follows exactly its jobs and a job given twice in one input is sent once.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu import Producer
from kombu.serialization import dumps as serialize
from kombu.utils.json import JSONEncoder
from kombu.utils.uuid import uuid
from tqdm import tqdm

from renderfarm.connections import redis_client
from renderfarm.ingest import build_jobs, prompt_rows
from renderfarm.jobs import JobError, JobSpec
from renderfarm.progress import FAILED_AMONG, Progress, key
from renderfarm.queue import ENQUEUED_HEADER, TASK_NAME, job_message, make_app
from renderfarm.settings import Settings

CHUNK = 1000  # jobs per round trip: big enough to amortise it, small enough to stay flat
SUBMISSION_TTL = 7 * 24 * 3600  # how long `wait` can follow a submission (as results live)
POLL_SECONDS = 1.0


def _members_key(campaign: str, submission_id: str) -> str:
    """The set of the job ids one submission sent to one campaign."""
    return key(campaign, f"submission:{submission_id}")


@dataclasses.dataclass(frozen=True)
class Submission:
    """What one submit did; `wait` follows its jobs, and only its jobs, to the end."""

    id: str
    broker_url: str = dataclasses.field(repr=False)  # it may hold the broker's password
    enqueued: int
    already_done: int
    duplicates: int
    campaigns: tuple[str, ...]
    queues: tuple[str, ...]
    resumed: tuple[str, ...]  # cancelled campaigns this submission lifted the cancel of
    seconds: float
    window: int | None = None  # fed through a window (producer/window.py)
    already_queued: int = 0  # a windowed run's jobs that an earlier run had queued
    stopped: str | None = None  # why a windowed run stopped before feeding every job

    @property
    def jobs_per_second(self) -> float:
        return self.enqueued / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = [f"enqueued {self.enqueued} jobs for campaign {', '.join(self.campaigns) or '-'} "
                 f"on queue {', '.join(self.queues) or '-'} "
                 f"in {self.seconds:.2f} s ({self.jobs_per_second:,.0f} jobs/s)"]
        if self.window is not None:
            lines[0] += f", through a window of {self.window} jobs"
        if self.already_done:
            lines.append(f"skipped {self.already_done} jobs already done in this campaign")
        if self.already_queued:
            lines.append(f"skipped {self.already_queued} jobs already queued by an earlier run")
        if self.duplicates:
            lines.append(f"skipped {self.duplicates} duplicate jobs (the same job id again in the input)")
        lines += [f"campaign {c} was cancelled: this submission lifted the cancel, so its queued jobs "
                  "render again" for c in self.resumed]
        if self.stopped:
            lines.append(f"stopped feeding: {self.stopped}")
        return "\n".join(lines)


class Refused(JobError):
    """A windowed campaign's admit refused a chunk, which was not sent: the campaign was
    cancelled (`why` 'cancelled'), or this run no longer holds its feeder lock ('lock')."""

    def __init__(self, campaign: str, why: str) -> None:
        rule = ("was cancelled; run it again to resume it" if why == "cancelled" else
                "lost its feeder lock (another run took over while this one stalled); this run sent nothing more")
        super().__init__("campaign", campaign, rule)
        self.why = why


class WaitTimeout(TimeoutError):
    """The submission's jobs did not all finish in time; the message says how far they got."""


class _TaskMessages:
    """Jobs' Celery task messages in the form kombu's Redis transport stores them (its JSON
    envelope), with the list each goes to. One message per queue and priority is built with
    placeholders for what differs between jobs; a job's message is that template filled in,
    at a fraction of the cost of Celery and kombu building each.

    Every queued job is Redis memory, so the message holds what a worker reads and no more:
    of Celery's headers the task and its id (a worker reads every other one as its default
    when it is absent), an empty embed (no callbacks), the properties kombu routes and
    acknowledges by, and the body as JSON text rather than base64 (kombu decodes a body
    without `body_encoding` as it is). The argument reprs Flower shows, a second copy of the
    job, are written back by the worker's door (worker/envelope.py). bench/window.py
    measures the bytes."""

    KWARGS = {"rf-slot": "kwargs"}  # stands for a job's kwargs in the body
    SLOTS = {"id": "rf-slot-id", "body": "rf-slot-body", "tag": "rf-slot-delivery-tag",
             "enqueued": "rf-slot-enqueued"}  # stand for the rest in the envelope

    def __init__(self, app: Celery, producer: Producer) -> None:
        self.app, self.channel = app, producer.channel
        self.json = JSONEncoder()  # kombu's JSON, made once rather than once per call
        self.templates: dict[tuple[str, int], tuple[str, str, str, str]] = {}

    def serialize(self, message: dict[str, Any]) -> tuple[str, str]:
        """(Redis list, stored message) of a `job_message`."""
        target = (message["queue"], message["priority"])
        template = self.templates.get(target) or self._template(*target)
        key, body_head, body_tail, envelope = template
        encode = self.json.encode
        body = body_head + encode(message["kwargs"]) + body_tail
        return key, envelope.format(id=encode(message["task_id"]), body=encode(body), tag=encode(uuid()),
                                    enqueued=repr(time.time()))

    def _template(self, queue_name: str, priority: int) -> tuple[str, str, str, str]:
        """The message `send_task` would store for a job of this queue and priority, less what a
        worker does not read, with slots; and the priority list kombu puts it in."""
        channel, slots = self.channel, self.SLOTS
        # the queue wait's start (worker/metrics.py): Celery's messages carry no enqueue time
        headers = {"task": TASK_NAME, "id": slots["id"], ENQUEUED_HEADER: slots["enqueued"]}
        content_type, content_encoding, payload = serialize(((), self.KWARGS, {}),
                                                            serializer=self.app.conf.task_serializer)
        body_head, body_tail = payload.split(self.json.encode(self.KWARGS))
        message = {"body": slots["body"], "content-encoding": content_encoding, "content-type": content_type,
                   "headers": headers,
                   "properties": {"delivery_info": {"exchange": "", "routing_key": queue_name},
                                  "priority": priority, "delivery_tag": slots["tag"]}}
        text = self.json.encode(message).replace("{", "{{").replace("}", "}}")
        for name, slot in slots.items():
            text = text.replace(self.json.encode(slot), f"{{{name}}}")
        key = channel._q_for_pri(queue_name, channel._get_message_priority(message, reverse=False))
        self.templates[(queue_name, priority)] = template = (key, body_head, body_tail, text)
        return template


def pushing(messages: list[dict[str, Any]]) -> None:
    """Called with a chunk's messages just before they go to Redis: where tests stop a
    feeder, or Redis, to show that a chunk is sent whole or not at all."""


class _Enqueuer:
    """Sends chunks of validated jobs and counts what it did; remembers the (few) campaigns
    and queues it touched, never the jobs. With a `holder` (the token of a windowed campaign's
    feeder lock) the jobs are that campaign's (renderfarm.progress), booked in its open set as
    they are pushed rather than per submission, and only while the run holds the lock."""

    def __init__(self, app: Celery, producer: Producer, progress: Progress, holder: str | None = None) -> None:
        self.app, self.producer, self.progress, self.holder = app, producer, progress, holder
        self.counted = holder is not None
        self.messages = _TaskMessages(app, producer)
        self.id = secrets.token_hex(8)
        self.enqueued = self.already_done = self.duplicates = self.already_queued = 0
        self.campaigns: dict[str, None] = {}  # ordered sets
        self.queues: dict[str, None] = {}
        self.resumed: list[str] = []

    def send(self, chunk: list[JobSpec]) -> None:
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for spec in chunk:
            message = job_message(spec)
            groups.setdefault((spec.campaign, str(message["queue"])), []).append(message)
        outgoing = [m for (campaign, queue), messages in groups.items()
                    for m in self._book(campaign, queue, messages)]
        if not outgoing:
            return
        pushing(outgoing)
        if self.counted:
            self._admit(outgoing)
        else:
            self._publish(outgoing)

    def _book(self, campaign: str, queue: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Drop jobs already done or already in this submission; record the rest as submitted."""
        if campaign not in self.campaigns:
            if not self.counted and self.progress.counted(campaign):
                raise JobError("campaign", campaign, "is fed through a window (`renderfarm campaign run "
                               "--window N`): run its spec again to resume it, or submit to another campaign")
            self.campaigns[campaign] = None
            # A windowed campaign's cancel is lifted by its feeder, before it reads the open jobs.
            if not self.counted and self.progress.is_cancelled(campaign):
                self.progress.resume(campaign)
                self.resumed.append(campaign)
        if queue not in self.queues:
            self.queues[queue] = None
            self.producer.maybe_declare(self.app.amqp.queues[queue])  # the binding kombu writes
        if self.counted:
            return messages  # booked as they are pushed (_admit)
        done = self.progress.done_among(campaign, [m["task_id"] for m in messages])
        todo = [m for m, is_done in zip(messages, done) if not is_done]
        self.already_done += len(messages) - len(todo)
        if not todo:
            return []
        ids = [m["task_id"] for m in todo]
        pipe = self.progress.r.pipeline(transaction=False)
        members = _members_key(campaign, self.id)
        pipe.smismember(members, ids)  # sent in an earlier chunk of this submission?
        pipe.sadd(members, *ids)
        pipe.expire(members, SUBMISSION_TTL)
        sent_before = pipe.execute()[0]
        self.progress.restart(campaign, ids)
        new, seen = [], set()  # of a job given twice in this chunk, the first goes
        for message, sent in zip(todo, sent_before):
            if not sent and message["task_id"] not in seen:
                seen.add(message["task_id"])
                new.append(message)
        self.duplicates += len(todo) - len(new)
        if new:
            self.progress.submitted(campaign, [m["task_id"] for m in new], queue)
        return new

    def _lists(self, messages: list[dict[str, Any]]) -> dict[str, list[str]]:
        """The messages in stored form, by the Redis list each goes to."""
        lists: dict[str, list[str]] = {}
        for m in messages:
            name, stored = self.messages.serialize(m)
            lists.setdefault(name, []).append(stored)
        return lists

    def _admit(self, messages: list[dict[str, Any]]) -> None:
        """A counted campaign's jobs recorded open and pushed in one atomic script a campaign
        (Progress.admit), so a feeder that dies or loses Redis in between leaves no open job
        without its message. A retry of the script (redis-py's, on a dropped connection) does
        nothing twice; a later run sends what is not open. Raises Refused when the run no
        longer holds the campaign's lock or the campaign is cancelled: nothing was sent."""
        assert self.holder is not None
        by_campaign: dict[str, list[dict[str, Any]]] = {}
        for m in messages:
            by_campaign.setdefault(m["kwargs"]["campaign"], []).append(m)
        for campaign, mine in by_campaign.items():
            queues = list(dict.fromkeys(m["queue"] for m in mine))
            jobs = [(m["task_id"], *self.messages.serialize(m)) for m in mine]
            outcome, newly = self.progress.admit(campaign, jobs, queues, self.holder, secrets.token_hex(8))
            if outcome != "ok":
                raise Refused(campaign, outcome)
            self.enqueued += newly
            self.already_queued += len(mine) - newly

    def _publish(self, messages: list[dict[str, Any]]) -> None:
        """One LPUSH per list, in one round trip: the same lists, in the same order, as one
        LPUSH per message. No retry: a failed write raises, and nothing is lost by submitting
        again (done jobs are skipped, a job sent twice renders the same)."""
        lists = self._lists(messages)
        with self.messages.channel.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            for name, stored_messages in lists.items():
                pipe.lpush(name, *stored_messages)
            pipe.execute()
        self.enqueued += len(messages)

    def result(self, broker_url: str, seconds: float, window: int | None = None,
               stopped: str | None = None) -> Submission:
        return Submission(self.id, broker_url, self.enqueued, self.already_done, self.duplicates,
                          tuple(self.campaigns), tuple(self.queues), tuple(self.resumed), seconds,
                          window, self.already_queued, stopped)


def submit_jobs(jobs: Callable[[], Iterable[JobSpec]], settings: Settings | None = None,
                chunk_size: int = CHUNK) -> Submission:
    """Validate every job, then enqueue them chunk by chunk. `jobs` is called twice (two
    streaming passes), so a bad row anywhere raises before anything is enqueued."""
    started = time.perf_counter()
    if not sum(1 for _ in jobs()):  # the validating pass; keeps no job
        raise JobError("prompts", None, "give at least one PROMPT or --prompts FILE")
    return enqueue_jobs(jobs(), settings, chunk_size, started)


def enqueue_jobs(jobs: Iterable[JobSpec], settings: Settings | None = None, chunk_size: int = CHUNK,
                 started: float | None = None) -> Submission:
    """Enqueue already validated jobs chunk by chunk, in one streaming pass (campaigns validate
    in their own pass). `started` (a perf_counter time) counts earlier passes in the rate."""
    started = time.perf_counter() if started is None else started
    settings = settings or Settings.from_env()
    with (redis_client(settings.broker_url) as client, make_app(settings) as app,
          app.producer_or_acquire() as producer):
        enqueuer = _Enqueuer(app, producer, Progress(client))
        stream = iter(jobs)
        while chunk := list(itertools.islice(stream, chunk_size)):
            enqueuer.send(chunk)
    return enqueuer.result(settings.broker_url, time.perf_counter() - started)


def submit(prompts: Iterable[str] | str = (), *, model: str, campaign: str = "local",
           prompts_file: str | Path | None = None, seed: int | None = None,
           steps: int | None = None, guidance_scale: float | None = None,
           negative_prompt: str | None = None, width: int | None = None, height: int | None = None,
           scheduler: str | None = None, timestep_spacing: str | None = None, karras: bool | None = None,
           dtype: str = "float32", variant: str | None = None, base: str | None = None,
           loras: list[str] | None = None, scores: list[str] | None = None, gate: str | None = None,
           rerolls: int | None = None, on_nsfw: str | None = None, priority: int | None = None,
           init_image: str | None = None, strength: float | None = None, mask_image: str | None = None,
           broker: str | None = None, wait: bool = False, timeout: float | None = None,
           progress: bool = True) -> Submission:
    """Enqueue jobs for the farm, as `renderfarm submit` does: the given prompts, then the
    lines of `prompts_file` (.txt or .jsonl, whose fields win over these arguments); job i
    gets seed `seed + i`. Raises JobError (with the line) before enqueuing anything if any
    job is invalid; with `wait`, follows the jobs and raises WaitTimeout after `timeout` s."""
    given = [prompts] if isinstance(prompts, str) else list(prompts)
    defaults = {"model": model, "campaign": campaign, "steps": steps, "guidance_scale": guidance_scale,
                "negative_prompt": negative_prompt, "width": width, "height": height,
                "scheduler": scheduler, "timestep_spacing": timestep_spacing, "karras": karras, "dtype": dtype,
                "variant": variant, "base": base, "loras": loras, "scores": scores, "gate": gate,
                "rerolls": rerolls, "on_nsfw": on_nsfw, "priority": priority, "init_image": init_image,
                "strength": strength, "mask_image": mask_image}
    submission = submit_jobs(lambda: build_jobs(prompt_rows(given, prompts_file), defaults, seed),
                             Settings.from_env(broker_url=broker))
    if wait:
        wait_for(submission, timeout, progress)
    return submission


def _finished_counts(client: redis.Redis, submission: Submission) -> dict[str, int]:
    """How many of the submission's jobs are done, failed or cancelled, counted in Redis (set
    intersections, and lua/failed_among.lua for the failed hash) in one round trip, so
    following a million jobs, or a campaign with a million failures, costs no memory here and
    moves three numbers a campaign."""
    failed_among = client.register_script(FAILED_AMONG)
    pipe = client.pipeline(transaction=False)
    for campaign in submission.campaigns:
        mine, done, cancelled = (_members_key(campaign, submission.id), key(campaign, "done"),
                                 key(campaign, "cancelled"))
        pipe.sintercard(2, [mine, done])
        pipe.sintercard(2, [mine, cancelled])
        pipe.sintercard(3, [mine, cancelled, done])
        failed_among(keys=[mine, key(campaign, "failed")], client=pipe)
    replies = pipe.execute()
    counts = {"done": 0, "failed": 0, "cancelled": 0}
    for i in range(len(submission.campaigns)):
        done, cancelled, both, failed = replies[4 * i:4 * i + 4]
        counts["done"] += done
        counts["cancelled"] += cancelled - both
        counts["failed"] += failed
    return counts


def wait_for(submission: Submission, timeout: float | None = None, progress: bool = True,
             poll: float = POLL_SECONDS) -> dict[str, int]:
    """Follow the submission until each of its jobs is done, failed or cancelled, with a
    progress bar (counts and ETA) on stderr; raise WaitTimeout after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    total = submission.enqueued
    with (redis_client(submission.broker_url) as client,
          tqdm(total=total, unit="job", desc=f"campaign {', '.join(submission.campaigns)}",
               disable=not progress) as bar):
        while True:
            counts = _finished_counts(client, submission)
            finished = sum(counts.values())
            bar.set_postfix(counts, refresh=False)
            bar.n = finished  # jobs finish in batches: the ETA uses the mean rate, not the last step
            bar.refresh()
            if finished >= total:
                return counts
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(
                    f"timed out after {timeout:g} s: {finished} of {total} jobs finished "
                    f"({counts['done']} done, {counts['failed']} failed, "
                    f"{counts['cancelled']} cancelled); the rest are still queued or running")
            time.sleep(poll if left is None else min(poll, left))
