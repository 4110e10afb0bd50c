"""Feeding a campaign through a window: at most N of its jobs queued or running at once,
refilled as the workers finish them, so Redis holds N jobs' messages and ids whatever the
campaign's size (`renderfarm campaign run SPEC --window N`, or `window: N` in the spec, which
scheduled runs use too).

The campaign is counted (renderfarm/progress.py): its open set holds the ids of the jobs
queued or running, and workers take a job out of it as they finish, fail or skip it. The
feeder streams the jobs storage lacks, and sends a chunk once the open set has room for it.
Resuming is running it again: a job storage holds is not submitted, one still open is not
sent twice, and a chunk is recorded open and pushed in one atomic step (Progress.admit), so
no open job lacks its message whenever a run dies; sent again (a dropped connection's retry),
the step does nothing twice. One feeder per campaign (a lock, `rf:c:CAMPAIGN:feeder`, renewed
while it runs and expiring if the feeder dies, renewed and freed only by its holder, and
checked by each admit, so a run that stalled past its expiry sends nothing more); feeders of
different campaigns run side by side. Running a cancelled campaign again lifts the cancel
before anything else; a cancel that comes while a run feeds stops it before its next chunk.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable

import redis
from tqdm import tqdm

from producer.submit import CHUNK, Refused, Submission, WaitTimeout, _Enqueuer
from renderfarm.connections import redis_client
from renderfarm.jobs import JobError, JobSpec
from renderfarm.progress import FENCED, RELEASE_LOCK, RENEW_LOCK, Progress, cancel_keys, key, retrying_client
from renderfarm.queue import make_app
from renderfarm.settings import Settings

LOCK_SECONDS = 30  # a dead feeder's lock lasts this long; a live one renews it every 5 s
POLL_SECONDS = 0.2  # how often a full window is looked at
MAX_WINDOW = 10**9


class FeederBusy(JobError):
    """Another run feeds this campaign now."""


class _Lock:
    """The campaign's feeder lock, held by host:pid and renewed by a thread while the run
    holds it (its scan of a large source takes longer than the lock lasts). Renewed and
    released by compare-and-set scripts: a run that stalled past the lock's expiry never
    extends or frees the lock of the run that took over."""

    def __init__(self, client: redis.Redis, campaign: str) -> None:
        self.client, self.campaign, self.name = client, campaign, key(campaign, "feeder")
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # (a SET sent again after its reply was lost finds the lock its first try took)
        if not client.set(self.name, self.token, nx=True, ex=LOCK_SECONDS) and \
                (holder := (client.get(self.name) or b"?").decode()) != self.token:
            raise FeederBusy("campaign", campaign, f"is being fed by another run ({holder}); one feeder per "
                             f"campaign (a run that died frees it within {LOCK_SECONDS} s)")
        self._renew, self._release = client.register_script(RENEW_LOCK), client.register_script(RELEASE_LOCK)
        self._fenced = client.register_script(FENCED)
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"feeder-lock-{campaign}", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while not self._stop.wait(LOCK_SECONDS / 6):
            try:
                if not self._renew(keys=[self.name], args=[self.token, LOCK_SECONDS]):
                    self.lost = True
                    return
            except redis.RedisError:
                continue  # the broker away for a moment: the next round tries again

    def check(self) -> None:
        if self.lost:
            raise FeederBusy("campaign", self.campaign, f"lost its feeder lock (not renewed for {LOCK_SECONDS} s: "
                             "Redis out of reach or the run stalled, and another run took over)")

    def write(self, fields: dict[str, int] | None = None, drop_fields: tuple[str, ...] = (),
              drop_keys: tuple[str, ...] = ()) -> None:
        """Set `fields` of the campaign's counts hash, then delete `drop_fields` of it and the
        `drop_keys`, in one step and only while this run holds the lock (lua/fenced.lua): a run
        that lost it raises FeederBusy, having written nothing over the live run's books."""
        pairs = [x for field, value in (fields or {}).items() for x in (field, value)]
        if not self._fenced(keys=[self.name, key(self.campaign, "counts"), *drop_keys],
                            args=[self.token, len(pairs) // 2, *pairs, *drop_fields]):
            self.lost = True
            raise FeederBusy("campaign", self.campaign, "lost its feeder lock (another run took the campaign "
                             "over while this one stalled); this run wrote nothing more")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._release(keys=[self.name], args=[self.token])
        except redis.RedisError:
            pass  # out of reach: the lock expires within LOCK_SECONDS, and the run's own error goes on


def check_window(window: object) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise JobError("window", window, f"must be a whole number of jobs from 1 to {MAX_WINDOW}")
    return window


class Feeder:
    """One run's hold on a counted campaign: its lock, and the ids of the jobs earlier runs left
    open (queued or running), which this run leaves to the workers, with the done count at the
    same moment. Taken before storage is listed, so a job finishing in between is either
    listed or left: never sent twice. A cancel is lifted first (`resumed`): jobs skipped
    before that are not open, so this run sends them again, and none is recorded cancelled
    after it (lua/settle.lua)."""

    def __init__(self, campaign: str, window: int, settings: Settings | None = None) -> None:
        self.campaign, self.window = campaign, check_window(window)
        self.settings = settings or Settings.from_env()
        self.client = retrying_client(self.settings.broker_url)  # a dropped connection is not the run's end
        try:
            self.lock = _Lock(self.client, campaign)
        except BaseException:
            self.client.close()
            raise
        try:
            progress = Progress(self.client)
            self.counted = progress.counted(campaign)  # an earlier run fed it through a window
            self._check_kind()
            self.resumed = progress.is_cancelled(campaign)
            if self.resumed:  # as Progress.resume does, in one step, and only while the lock holds
                self.lock.write(drop_keys=cancel_keys(campaign))
        except BaseException:
            self.__exit__()
            raise
        pipe = self.client.pipeline()  # a transaction: no job leaves the open set between the two
        pipe.smembers(key(campaign, "open"))
        pipe.hget(key(campaign, "counts"), "done")
        open_jobs, done = pipe.execute()
        self.queued, self.done = {i.decode() for i in open_jobs}, int(done or 0)

    def _check_kind(self) -> None:
        if not self.counted and \
                self.client.exists(key(self.campaign, "submitted"), key(self.campaign, "done")):
            raise JobError("window", self.window, f"campaign {self.campaign} was submitted without a window "
                           "(its progress is kept per job): run it without a window, or give the spec another name")

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        self.client.close()

    def feed(self, jobs: Iterable[JobSpec], todo: int, queued: int, started: float | None = None,
             progress: bool = True, poll: float = POLL_SECONDS) -> Submission:
        """Submit the campaign's validated jobs (`todo` of them: none stored or open; `queued`: the
        campaign's jobs that are open and storage lacks, left to the workers), keeping at most
        the window open. Returns when every job is sent, or when the campaign is cancelled (the
        Submission says so). Raises FeederBusy when another run took the campaign over."""
        started = time.perf_counter() if started is None else started
        campaign, window, client = self.campaign, self.window, self.client
        chunk_size = max(1, min(CHUNK, window // 2))  # room for one chunk opens while the other renders
        stopped = None
        with make_app(self.settings) as app, app.producer_or_acquire() as producer:
            enqueuer = _Enqueuer(app, producer, Progress(client), holder=self.lock.token)
            enqueuer.already_queued = queued
            if self.resumed:
                enqueuer.resumed.append(campaign)
            self._start(todo)
            stream = iter(jobs)
            with tqdm(total=todo, unit="job", desc=f"feeding {campaign} (window {window})",
                      disable=not progress) as bar:
                while chunk := list(itertools.islice(stream, chunk_size)):
                    stopped = self._wait_for_room(window - len(chunk), poll)
                    if stopped:
                        break
                    try:
                        enqueuer.send(chunk)
                    except Refused as refused:
                        if refused.why != "cancelled":
                            raise FeederBusy("campaign", campaign, refused.rule) from None
                        stopped = _cancelled(campaign)
                        break
                    bar.update(len(chunk))
            if not stopped:
                self.fed()
        return enqueuer.result(self.settings.broker_url, time.perf_counter() - started, window, stopped)

    def fed(self) -> None:
        """Mark the campaign fed to the end (status calls it finished once no job is open). A
        run with nothing to send calls it too: the run before may have died after its last
        chunk and before this mark. Only while this run holds the lock (else FeederBusy)."""
        self.lock.write({"fed": 1})

    def _start(self, todo: int) -> None:
        """Mark the campaign counted, with this run's window and its total: the jobs done, those
        open (each ends done, failed or cancelled, whether the spec still has it or not) and
        the `todo` ones this run sends. Only while this run holds the lock (else FeederBusy)."""
        self.lock.write({"window": self.window, "jobs": self.done + len(self.queued) + todo}, drop_fields=("fed",))

    def _wait_for_room(self, most: int, poll: float) -> str | None:
        """Wait until at most `most` of the campaign's jobs are open; the reason to stop instead."""
        while True:
            pipe = self.client.pipeline(transaction=False)
            pipe.scard(key(self.campaign, "open"))
            pipe.exists(key(self.campaign, "cancel"))
            open_jobs, cancelled = pipe.execute()
            if cancelled:
                return _cancelled(self.campaign)
            self.lock.check()
            if open_jobs <= max(most, 0):
                return None
            time.sleep(poll)


def _cancelled(campaign: str) -> str:
    return f"campaign {campaign} was cancelled; run it again to resume it"


def follow(campaign: str, broker_url: str, timeout: float | None = None, progress: bool = True,
           poll: float = 1.0) -> dict[str, int]:
    """Follow a counted campaign until none of its jobs is open (`campaign run --window --wait`):
    its done, failed and cancelled counts. Raises WaitTimeout after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with redis_client(broker_url) as client:
        state = Progress(client)
        report = state.status(campaign)
        with tqdm(total=report["jobs"], unit="job", desc=f"campaign {campaign}", disable=not progress) as bar:
            while True:
                counts = {name: report[name] for name in ("done", "failed", "cancelled")}
                bar.n = sum(counts.values())
                bar.set_postfix(counts, refresh=False)
                bar.refresh()
                if report["queued"] + report["running"] == 0:
                    return counts
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"timed out after {timeout:g} s: {counts['done']} done, {counts['failed']} "
                                       f"failed, {report['queued'] + report['running']} still queued or running")
                time.sleep(poll)
                report = state.status(campaign)
