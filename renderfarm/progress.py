"""Campaign progress in Redis: what was submitted, what runs, what is done, failed or
cancelled. Sets of job ids, so a redelivered job is never counted twice.

A campaign fed through a window (`campaign run --window N`, producer/window.py) is counted
instead: it keeps the ids of its open jobs (queued or running, at most about N) and counts
the rest, so its Redis memory is set by the window, not by its size. Its jobs are recorded
open in the same atomic step that pushes their messages (lua/admit.lua), so an open job
always has its message. A job is newly done when it leaves the open set, or the failed or cancelled
records (lua/finish.lua). A campaign is one kind or the other for good. In both kinds a job
counts once, in the state it ends in: done, failed or cancelled (lua/settle.lua).

A worker writes only for jobs on their campaign's books (in its submitted set; a counted
campaign's, in its open set): a message may name any campaign and job id, and one that nobody
submitted creates no key and no field (lua/start.lua, finish.lua, settle.lua).

Keys (CAMPAIGN is validated by the job contract, so it cannot reach outside its prefix):
  rf:c:CAMPAIGN:submitted   set of job ids
  rf:c:CAMPAIGN:running     set of job ids a worker has started
  rf:c:CAMPAIGN:done        set of job ids stored
  rf:c:CAMPAIGN:failed      hash job id -> reason (failed for good)
  rf:c:CAMPAIGN:cancelled   set of job ids skipped because the campaign was cancelled
  rf:c:CAMPAIGN:cancel      flag: queued jobs of the campaign are skipped
  rf:c:CAMPAIGN:times       hash: first_submitted, first_done, last_done (unix seconds), and
                            device_seconds (the devices' time its done images took)
  rf:c:CAMPAIGN:scores      hash: safety (done images safety-checked), nsfw (those flagged),
                            gated (done images with a gate), passed (those that passed it)
  rf:c:CAMPAIGN:attempts    hash job id -> attempts started (the same spec in two campaigns is
                            two jobs: each has its own attempts); expires ATTEMPTS_TTL after
                            its last start (a counted campaign's instead forgets each job as
                            it ends)
  rf:c:CAMPAIGN:refunds     hash job id -> attempts refunded for storage or the broker being away
                            (lua/release.lua: at most the bound a job, then they count); expires
                            ATTEMPTS_TTL after its last write
  rf:c:CAMPAIGN:submission:ID  set of the job ids one submission sent (expires after 7 days)
Counted (windowed) campaigns have no submitted, done or submission sets; instead:
  rf:c:CAMPAIGN:open        set of job ids queued or running
  rf:c:CAMPAIGN:counts      hash: window (marks the campaign counted), jobs (its total),
                            submitted, done, fed (1 once a run has submitted every job),
                            admit (the last admit's token and how many jobs it opened: an
                            admit sent again finds it and does nothing)
  rf:c:CAMPAIGN:feeder      the feeding run's lock (host:pid), expiring unless renewed;
                            renewed or released only by its holder (lua/renew_lock.lua,
                            lua/release_lock.lua, run by producer/window.py); an admit
                            (lua/admit.lua) and every other write of a feeder
                            (lua/fenced.lua) check it, so a stalled run writes nothing
  rf:queues                 set of queue names producers have used
  the queues' lists         kombu's priority lists (renderfarm/queue.py): `admit` pushes a
                            counted campaign's messages onto them with its record
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from renderfarm.connections import redis_client

QUEUES = "rf:queues"
# What `Progress.started` answers for a job not on its campaign's books (lua/start.lua), for
# which it recorded nothing: a job of a campaign not fed through a window that was never
# submitted to it, and a job of a counted campaign that is not open (done, failed for good,
# or never admitted).
NOT_SUBMITTED = 0
NOT_OPEN = -1
# An uncounted campaign's attempts hash lasts this long after its last start, and any campaign's
# refunds hash after its last write.
ATTEMPTS_TTL = 7 * 24 * 3600
FAILURES_SHOWN = 100  # the failures `status` reads (a sample of them, when there are more)


def _lua(name: str) -> str:
    return (Path(__file__).parent / "lua" / name).read_text()


START, FINISH, SETTLE, ADMIT = _lua("start.lua"), _lua("finish.lua"), _lua("settle.lua"), _lua("admit.lua")
RELEASE = _lua("release.lua")  # jobs back on their queue, attempts counted or refunded
REQUEUE = _lua("requeue.lua")  # a dead letter back on its queue (renderfarm/deadletters.py)
RENEW_LOCK, RELEASE_LOCK = _lua("renew_lock.lua"), _lua("release_lock.lua")  # the feeder's lock
FENCED = _lua("fenced.lua")  # a feeder's write of its campaign's books, while it holds the lock
FAILED_AMONG = _lua("failed_among.lua")  # a submission's failed jobs (producer/submit.py)


def retrying_client(url: str) -> redis.Redis:
    """A client that sends a command again when its connection drops before the reply came
    (three times, backing off), as redis-py's clients made from arguments do and those made
    from a URL do not. Only for callers whose every command may run twice: the windowed feeder
    (its admits and lock scripts are idempotent) and the dead letters' requeue."""
    return redis_client(url, retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=2), 3),
                        retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def key(campaign: str, what: str) -> str:
    return f"rf:c:{campaign}:{what}"


def cancel_keys(campaign: str) -> tuple[str, str]:
    """What lifting a cancel deletes: the campaign's cancel flag and its cancelled set."""
    return key(campaign, "cancel"), key(campaign, "cancelled")


class Progress:
    """Reads and writes campaign progress; every write is one pipelined round trip."""

    def __init__(self, client: redis.Redis) -> None:
        self._start = client.register_script(START)
        self._finish = client.register_script(FINISH)
        self._settle = client.register_script(SETTLE)
        self._admit = client.register_script(ADMIT)
        self._release = client.register_script(RELEASE)
        self.r = client

    @classmethod
    def from_url(cls, url: str) -> Progress:
        return cls(redis_client(url))

    # -- producer side -------------------------------------------------------------

    def submitted(self, campaign: str, job_ids: list[str], queue: str | None = None) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(key(campaign, "submitted"), *job_ids)
        pipe.hsetnx(key(campaign, "times"), "first_submitted", time.time())
        if queue is not None:
            pipe.sadd(QUEUES, queue)
        pipe.execute()

    def restart(self, campaign: str, job_ids: list[str]) -> None:
        """Jobs submitted again start afresh: no stale failure, a full set of attempts and refunds."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(key(campaign, "failed"), *job_ids)
        pipe.hdel(key(campaign, "attempts"), *job_ids)
        pipe.hdel(key(campaign, "refunds"), *job_ids)
        pipe.execute()

    def counted(self, campaign: str) -> bool:
        """Whether the campaign is fed through a window (counts, not sets of ids)."""
        return bool(self.r.hexists(key(campaign, "counts"), "window"))

    def admit(self, campaign: str, jobs: list[tuple[str, str, str]], queues: list[str], holder: str,
              token: str) -> tuple[str, int]:
        """A counted campaign's (job id, Redis list, stored message) jobs into its open set and
        onto their lists, in one atomic script (lua/admit.lua): a feeder that dies or loses
        Redis leaves no open job without a message. Only for the run holding the feeder lock
        (`holder`, its token) and only while the campaign is not cancelled; idempotent by
        `token` (fresh per admit), and a job already open is not pushed again. Returns the
        outcome ('ok', 'lock' or 'cancelled') and how many jobs became open."""
        lists = list(dict.fromkeys(name for _, name, _ in jobs))
        where = {name: n for n, name in enumerate(lists, 1)}
        keys = [key(campaign, "open"), key(campaign, "counts"), key(campaign, "failed"),
                key(campaign, "attempts"), key(campaign, "times"), QUEUES, key(campaign, "feeder"),
                key(campaign, "cancel"), key(campaign, "refunds"), *lists]
        args: list[Any] = [time.time(), token, holder, len(queues), *queues]
        for job_id, name, message in jobs:
            args += [job_id, where[name], message]
        outcome, newly = self._admit(keys=keys, args=args)
        return outcome.decode(), int(newly)

    def done_among(self, campaign: str, job_ids: list[str]) -> list[bool]:
        """Which of these jobs are already stored (a re-submission skips them)."""
        if not job_ids:
            return []
        return [bool(x) for x in self.r.smismember(key(campaign, "done"), job_ids)]

    def cancel(self, campaign: str) -> None:
        self.r.set(key(campaign, "cancel"), 1)

    def resume(self, campaign: str) -> None:
        """Lift a cancel: a new run of the campaign renders what is still missing. One command,
        so no job is recorded cancelled in between (lua/settle.lua records one only while the
        flag stands)."""
        self.r.delete(*cancel_keys(campaign))

    # -- worker side ---------------------------------------------------------------

    def is_cancelled(self, campaign: str) -> bool:
        return bool(self.r.exists(key(campaign, "cancel")))

    def cancelled_among(self, campaigns: Iterable[str]) -> set[str]:
        """Which of these campaigns are cancelled, in one round trip."""
        campaigns = sorted(campaigns)
        pipe = self.r.pipeline(transaction=False)
        for campaign in campaigns:
            pipe.exists(key(campaign, "cancel"))
        return {c for c, flag in zip(campaigns, pipe.execute()) if flag}

    def started(self, jobs: Iterable[tuple[str, str]]) -> list[int]:
        """Mark (campaign, job id) pairs running, in one round trip; returns each job's attempt
        number (1 or more). Only a job on its campaign's books is recorded (lua/start.lua), as
        any message may name any campaign and job id: for another, nothing is written and the
        answer is NOT_SUBMITTED (a campaign not fed through a window, the job not submitted to
        it) or NOT_OPEN (a counted campaign, the job not open: done, failed for good, or never
        admitted; a counted campaign forgets a job when it ends)."""
        jobs = list(jobs)
        if not jobs:
            return []
        by_campaign = _by_campaign(jobs)
        pipe = self.r.pipeline(transaction=False)
        for campaign, ids in by_campaign.items():
            self._start(keys=[key(campaign, what) for what in ("attempts", "running", "counts", "open", "submitted")],
                        args=[ATTEMPTS_TTL, *ids], client=pipe)
        answers = {campaign: iter(reply) for campaign, reply in zip(by_campaign, pipe.execute())}
        return [int(next(answers[campaign])) for campaign, _ in jobs]

    def finished(self, jobs: Iterable[tuple[str, str]], device_seconds: Iterable[float] | None = None,
                 verdicts: Iterable[tuple[bool | None, bool | None]] | None = None) -> None:
        """Mark (campaign, job id) pairs done, in one round trip, a few commands a campaign;
        `device_seconds` (one per job: its share of its batch's device time) add up per
        campaign, and so do the `verdicts` (one per job: whether the safety checker flagged
        it, whether it passed its gate; None where it has no such score or gate), once per
        job however often it is finished; the times of the first and last newly done jobs
        too. A job not on its campaign's books records nothing (lua/finish.lua)."""
        jobs = list(jobs)
        seconds = dict(zip(jobs, device_seconds if device_seconds is not None else [0.0] * len(jobs)))
        judged = dict(zip(jobs, verdicts if verdicts is not None else [(None, None)] * len(jobs)))
        now = repr(time.time())
        pipe = self.r.pipeline(transaction=False)
        for campaign, ids in _by_campaign(jobs).items():
            pipe.srem(key(campaign, "running"), *ids)
            self._finish(keys=[key(campaign, what) for what in ("done", "times", "open", "counts", "attempts",
                                                                  "failed", "cancelled", "scores", "submitted",
                                                                  "refunds")],
                         args=[now, *(x for job_id in ids for x in (job_id, repr(float(seconds[(campaign, job_id)])),
                                                                    _verdicts(*judged[(campaign, job_id)])))],
                         client=pipe)
        pipe.execute()

    def failed(self, campaign: str, job_id: str, reason: str) -> None:
        self._settled(campaign, job_id, "failed", reason)

    def released(self, jobs: Iterable[tuple[str, str]], refund: str = "count", bound: int = 0) -> list[int]:
        """(campaign, job id) pairs go back to the queue (to be tried again), in one round
        trip, so a stopping worker puts back all it holds at once (lua/release.lua). `refund`:
        "count" (the attempt counts: the job's own failure), "refund" (it does not: the worker
        is stopping) or "bounded" (storage or the broker was away: refunded while the job has
        had at most `bound` such refunds). Returns each job's refunds so far ("bounded"), else 0."""
        jobs = list(jobs)
        by_campaign = _by_campaign(jobs)
        pipe = self.r.pipeline(transaction=False)
        for campaign, ids in by_campaign.items():
            self._release(keys=[key(campaign, what) for what in ("running", "attempts", "refunds")],
                          args=[refund, bound, ATTEMPTS_TTL, *ids], client=pipe)
        refunds = {}
        for (campaign, ids), counts in zip(by_campaign.items(), pipe.execute()):
            refunds.update(((campaign, job_id), int(n)) for job_id, n in zip(ids, counts))
        return [refunds[job] for job in jobs]

    def skipped(self, campaign: str, job_id: str) -> bool:
        """Recorded as skipped, its campaign being cancelled; False if a run lifted the cancel
        since the worker looked (the job is to go back on its queue)."""
        return self._settled(campaign, job_id, "cancelled") >= 0

    def _settled(self, campaign: str, job_id: str, outcome: str, reason: str = "") -> int:
        """Failed or skipped, unless done already: lua/settle.lua counts the job once, and
        records nothing for a job not on its campaign's books."""
        return int(self._settle(keys=[key(campaign, what) for what in (
            "running", "open", "done", "failed", "cancelled", "counts", "attempts", "cancel", "submitted",
            "refunds")],
            args=[job_id, outcome, reason]))

    # -- status --------------------------------------------------------------------

    def failures(self, campaign: str) -> Iterator[tuple[str, str]]:
        """Every failure of the campaign (job id, reason), streamed: HSCAN pages of
        FAILURES_SHOWN, so neither side holds the whole hash (one that changes meanwhile may
        yield a job twice, as HSCAN does)."""
        for job_id, reason in self.r.hscan_iter(key(campaign, "failed"), count=FAILURES_SHOWN):
            yield job_id.decode(), reason.decode()

    def _failure_sample(self, campaign: str, cursor: int, page: dict[bytes, bytes]) -> dict[str, str]:
        """At most FAILURES_SHOWN failures, from the first HSCAN page and, while it holds fewer
        and the scan is not over, the next ones."""
        sample = _decoded(page)
        while cursor and len(sample) < FAILURES_SHOWN:
            cursor, page = self.r.hscan(key(campaign, "failed"), cursor, count=FAILURES_SHOWN)
            sample.update(_decoded(page))
        return dict(itertools.islice(sample.items(), FAILURES_SHOWN))

    def status(self, campaign: str) -> dict[str, Any]:
        """The campaign's counts, rate, ETA and totals, in a few commands of bounded size
        whatever its size: `status` runs every second while a run is followed, so the failures
        are counted (`failed`) and their reasons read only as a sample of at most
        FAILURES_SHOWN (`failures`, job id -> reason; `failures_cut` when there are more:
        `failures()` streams them all)."""
        pipe = self.r.pipeline(transaction=False)
        for what in ("submitted", "running", "done", "cancelled", "open"):
            pipe.scard(key(campaign, what))
        pipe.hlen(key(campaign, "failed"))
        pipe.hscan(key(campaign, "failed"), 0, count=FAILURES_SHOWN)
        pipe.hgetall(key(campaign, "times"))
        pipe.exists(key(campaign, "cancel"))
        pipe.hgetall(key(campaign, "counts"))
        pipe.hgetall(key(campaign, "scores"))
        (submitted, running, done, cancelled, open_jobs, failed, (cursor, sample), times, cancel, counts,
         scores) = pipe.execute()
        checked, flagged, gated, passed = (int(scores.get(f, 0)) for f in (b"safety", b"nsfw", b"gated", b"passed"))
        failures = self._failure_sample(campaign, cursor, sample)
        counts = {k.decode(): int(v) for k, v in counts.items() if k != b"admit"}
        window = counts.get("window")
        if window is None:
            queued = max(0, submitted - running - done - cancelled - failed)
        else:
            submitted, done = counts.get("submitted", 0), counts.get("done", 0)
            queued = max(0, open_jobs - running)
        submitted_at, first, last, device_seconds = (
            float(times.get(k, 0)) for k in (b"first_submitted", b"first_done", b"last_done", b"device_seconds"))
        rate = _rate(done, submitted_at, first, last)
        left = queued + running if window is None else \
            max(queued + running, counts.get("jobs", 0) - done - failed - cancelled)
        # A counted campaign is finished once a run has fed it all, not when its window runs dry.
        finished = bool(submitted) and queued + running == 0 and (window is None or bool(counts.get("fed")))
        return {
            "campaign": campaign,
            "submitted": submitted,
            "queued": queued,
            "running": running,
            "done": done,
            "failed": failed,
            # at most FAILURES_SHOWN of them, job id -> reason; cut: there are more (`failures()`)
            "failures": failures,
            "failures_cut": failed > len(failures),
            "cancelled": cancelled,
            "cancel_requested": bool(cancel),
            "images_per_second": rate,
            "eta_seconds": left / rate if rate else None,
            "finished": finished,
            # first submission to last image: a finished campaign's wall time
            "elapsed_seconds": last - submitted_at if done and submitted_at else None,
            # the devices' time the done images took (each its share of its batch)
            "device_seconds": device_seconds,
            "images_per_device_hour": done * 3600 / device_seconds if device_seconds else None,
            # fed through a window: at most `window` jobs queued or running; `jobs`: the done
            # count when the campaign is finished (its done jobs and those storage lacks)
            "window": window,
            "jobs": counts.get("jobs"),
            # done images the safety checker saw, those it flagged, and the share that passed
            "safety_checked": checked,
            "nsfw": flagged,
            "safety_pass_rate": 1 - flagged / checked if checked else None,
            # done images that had a gate, those whose kept image passed it, and their share
            "gated": gated,
            "gate_passed": passed,
            "gate_pass_rate": passed / gated if gated else None,
        }


def _decoded(page: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in page.items()}


def _rate(done: int, submitted_at: float, first: float, last: float) -> float | None:
    """Images per second between the first and the last images stored; while every done image
    came in one store (a first batch, or batches stored together), over the time since the
    first submission instead, so a running campaign has a rate as soon as it has an image."""
    if done > 1 and last > first:
        return (done - 1) / (last - first)
    if done and submitted_at and last > submitted_at:
        return done / (last - submitted_at)
    return None


def _verdicts(nsfw: bool | None, passed: bool | None) -> str:
    """A job's safety and gate as lua/finish.lua takes them: a character each."""
    return "".join("-" if verdict is None else str(int(verdict)) for verdict in (nsfw, passed))


def _by_campaign(jobs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for campaign, job_id in jobs:
        grouped.setdefault(campaign, []).append(job_id)
    return grouped
