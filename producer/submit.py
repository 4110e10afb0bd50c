"""Submission: validated jobs into their models' queues as real Celery task messages, fast.

Two streaming passes over the input keep memory flat in its size and enqueue nothing from a
bad file: the first only validates, the second enqueues in chunks. A chunk costs a handful of
Redis round trips, not one per job: which jobs are already done, the campaign bookkeeping,
and the messages. Celery builds each message (`as_task_v2`, `send_task_message`) and kombu's
own Redis publish batch (`Producer.batch`, kombu >= 5.7) writes it, so the bytes are what
`send_task` would write (minus the per-job round trip and the task-sent event).

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
from tqdm import tqdm

from producer.ingest import build_jobs, prompt_rows
from renderfarm.jobs import JobError, JobSpec
from renderfarm.progress import Progress, key
from renderfarm.queue import TASK_NAME, job_message, make_app
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
    broker_url: str
    enqueued: int
    already_done: int
    duplicates: int
    campaigns: tuple[str, ...]
    queues: tuple[str, ...]
    resumed: tuple[str, ...]  # cancelled campaigns this submission lifted the cancel of
    seconds: float

    @property
    def jobs_per_second(self) -> float:
        return self.enqueued / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = [f"enqueued {self.enqueued} jobs for campaign {', '.join(self.campaigns) or '-'} "
                 f"on queue {', '.join(self.queues) or '-'} "
                 f"in {self.seconds:.2f} s ({self.jobs_per_second:,.0f} jobs/s)"]
        if self.already_done:
            lines.append(f"skipped {self.already_done} jobs already done in this campaign")
        if self.duplicates:
            lines.append(f"skipped {self.duplicates} duplicate jobs (the same job id again in the input)")
        lines += [f"campaign {c} was cancelled: this submission lifted the cancel, so its queued jobs "
                  "render again" for c in self.resumed]
        return "\n".join(lines)


class WaitTimeout(TimeoutError):
    """The submission's jobs did not all finish in time; the message says how far they got."""


class _Enqueuer:
    """Sends chunks of validated jobs and counts what it did; remembers the (few) campaigns
    and queues it touched, never the jobs."""

    def __init__(self, app: Celery, producer: Producer, progress: Progress) -> None:
        self.app, self.producer, self.progress = app, producer, progress
        self.id = secrets.token_hex(8)
        self.enqueued = self.already_done = self.duplicates = 0
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
        if outgoing:
            self._publish(outgoing)

    def _book(self, campaign: str, queue: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Drop jobs already done or already in this submission; record the rest as submitted."""
        if campaign not in self.campaigns:
            self.campaigns[campaign] = None
            if self.progress.is_cancelled(campaign):
                self.progress.resume(campaign)
                self.resumed.append(campaign)
        if queue not in self.queues:
            self.queues[queue] = None
            self.producer.maybe_declare(self.app.amqp.queues[queue])  # the binding kombu writes
        done = self.progress.done_among(campaign, [m["task_id"] for m in messages])
        todo = [m for m, is_done in zip(messages, done) if not is_done]
        self.already_done += len(messages) - len(todo)
        if not todo:
            return []
        ids = [m["task_id"] for m in todo]
        pipe = self.progress.r.pipeline(transaction=False)
        members = _members_key(campaign, self.id)
        for job_id in ids:
            pipe.sadd(members, job_id)
        pipe.expire(members, SUBMISSION_TTL)
        added = pipe.execute()[:len(ids)]
        self.progress.restart(campaign, ids)
        new = [m for m, is_new in zip(todo, added) if is_new]
        self.duplicates += len(todo) - len(new)
        if new:
            self.progress.submitted(campaign, [m["task_id"] for m in new], queue)
        return new

    def _publish(self, messages: list[dict[str, Any]]) -> None:
        amqp = self.app.amqp
        with self.producer.batch(len(messages)):  # one pipelined flush for the chunk
            for m in messages:
                task = amqp.as_task_v2(m["task_id"], TASK_NAME, kwargs=m["kwargs"],
                                       kwargsrepr=self._kwargsrepr(m["kwargs"]))
                # No retry: a batch cannot replay; a failed flush raises and nothing is lost
                # by submitting again (done jobs are skipped, a job sent twice renders the same).
                amqp.send_task_message(self.producer, TASK_NAME, task, queue=m["queue"],
                                       priority=m["priority"], retry=False, declare=[])
                self.enqueued += 1

    def _kwargsrepr(self, kwargs: dict[str, Any]) -> str | None:
        """What Flower shows: the plain repr; Celery's saferepr (None) only when it must be
        cut to size, because it costs 30x a repr: a quarter of the whole submit's time."""
        shown = repr(kwargs)
        return shown if len(shown) <= self.app.amqp.kwargsrepr_maxsize else None

    def result(self, broker_url: str, seconds: float) -> Submission:
        return Submission(self.id, broker_url, self.enqueued, self.already_done, self.duplicates,
                          tuple(self.campaigns), tuple(self.queues), tuple(self.resumed), seconds)


def submit_jobs(jobs: Callable[[], Iterable[JobSpec]], settings: Settings | None = None,
                chunk_size: int = CHUNK) -> Submission:
    """Validate every job, then enqueue them chunk by chunk. `jobs` is called twice (two
    streaming passes), so a bad row anywhere raises before anything is enqueued."""
    started = time.perf_counter()
    if not sum(1 for _ in jobs()):  # the validating pass; keeps no job
        raise JobError("prompts", None, "give at least one PROMPT or --prompts FILE")
    settings = settings or Settings.from_env()
    with (redis.Redis.from_url(settings.broker_url) as client, make_app(settings) as app,
          app.producer_or_acquire() as producer):
        enqueuer = _Enqueuer(app, producer, Progress(client))
        stream = iter(jobs())
        while chunk := list(itertools.islice(stream, chunk_size)):
            enqueuer.send(chunk)
    return enqueuer.result(settings.broker_url, time.perf_counter() - started)


def submit(prompts: Iterable[str] | str = (), *, model: str, campaign: str = "local",
           prompts_file: str | Path | None = None, seed: int | None = None,
           steps: int | None = None, guidance_scale: float | None = None,
           negative_prompt: str | None = None, width: int | None = None, height: int | None = None,
           scheduler: str | None = None, dtype: str = "float32", priority: int | None = None,
           broker: str | None = None, wait: bool = False, timeout: float | None = None,
           progress: bool = True) -> Submission:
    """Enqueue jobs for the farm, as `renderfarm submit` does: the given prompts, then the
    lines of `prompts_file` (.txt or .jsonl, whose fields win over these arguments); job i
    gets seed `seed + i`. Raises JobError (with the line) before enqueuing anything if any
    job is invalid; with `wait`, follows the jobs and raises WaitTimeout after `timeout` s."""
    given = [prompts] if isinstance(prompts, str) else list(prompts)
    defaults = {"model": model, "campaign": campaign, "steps": steps, "guidance_scale": guidance_scale,
                "negative_prompt": negative_prompt, "width": width, "height": height,
                "scheduler": scheduler, "dtype": dtype, "priority": priority}
    submission = submit_jobs(lambda: build_jobs(prompt_rows(given, prompts_file), defaults, seed),
                             Settings.from_env(broker_url=broker))
    if wait:
        wait_for(submission, timeout, progress)
    return submission


def _finished_counts(client: redis.Redis, submission: Submission) -> dict[str, int]:
    """How many of the submission's jobs are done, failed or cancelled, counted in Redis
    (set intersections), so following a million jobs costs no memory here."""
    pipe = client.pipeline(transaction=False)
    for campaign in submission.campaigns:
        mine, done, cancelled = (_members_key(campaign, submission.id), key(campaign, "done"),
                                 key(campaign, "cancelled"))
        pipe.sintercard(2, [mine, done])
        pipe.sintercard(2, [mine, cancelled])
        pipe.sintercard(3, [mine, cancelled, done])
        pipe.hkeys(key(campaign, "failed"))
    replies = pipe.execute()
    counts = {"done": 0, "failed": 0, "cancelled": 0}
    for i, campaign in enumerate(submission.campaigns):
        done, cancelled, both, failed = replies[4 * i:4 * i + 4]
        counts["done"] += done
        counts["cancelled"] += cancelled - both
        if failed:
            counts["failed"] += sum(client.smismember(_members_key(campaign, submission.id), failed))
    return counts


def wait_for(submission: Submission, timeout: float | None = None, progress: bool = True,
             poll: float = POLL_SECONDS) -> dict[str, int]:
    """Follow the submission until each of its jobs is done, failed or cancelled, with a
    progress bar (counts and ETA) on stderr; raise WaitTimeout after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    total = submission.enqueued
    with (redis.Redis.from_url(submission.broker_url) as client,
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
