"""Scheduled campaigns: cron or interval schedules in Redis (celery-redbeat), fired by
`renderfarm beat`, each fire its own campaign instance.

A schedule is a RedBeatSchedulerEntry under `rf:beat:NAME` whose task, `renderfarm.campaign`,
carries the whole campaign spec (`CampaignSpec.to_dict()`, absolute paths) and goes to the
control queue `rf.control`. `renderfarm beat` is one process with two parts: the beat
(a thread; redbeat's Redis lock lets one beat of many schedule) and a Celery worker (solo
pool, no JAX) that consumes `rf.control` and submits each fire's jobs with `run_campaign`.
A spec with a `window` makes each fire a windowed run (producer/window.py), which holds that
worker until the instance is fed: run as many beats as windowed instances may overlap.
Schedules are read from Redis on every tick, so `schedule add/remove` reach a running beat
within BEAT_INTERVAL seconds, without a restart.

A fire of schedule NAME at time T (UTC) runs campaign instance `NAME-YYYYMMDDTHHMM`
(`...THHMMSS` when the schedule is an interval under a minute), with base seed
`instance_seed(spec.base_seed, instance)`: runs never share a folder, and each is
reproducible from its name.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from celery import Celery
from celery.schedules import crontab, schedule
from redbeat import RedBeatScheduler, RedBeatSchedulerEntry
from redbeat.schedulers import ensure_conf, get_redis

from renderfarm.connections import redbeat_settings, redis_client
from renderfarm.jobs import SEED_LIMIT, JobError
from renderfarm.queue import make_app
from renderfarm.settings import Settings

CAMPAIGN_TASK = "renderfarm.campaign"
CONTROL_QUEUE = "rf.control"
KEY_PREFIX = "rf:beat:"  # entries rf:beat:NAME; redbeat's own keys rf:beat::schedule, ::lock
CLAIM_PREFIX = KEY_PREFIX + ":run:"  # rf:beat::run:INSTANCE, see run_instance
# Seconds a beat sleeps at most between two looks at the schedules: a schedule added or
# removed takes effect within this; a standby beat tries the lock this often.
BEAT_INTERVAL = 2
# The scheduling beat renews its lock every tick (at most BEAT_INTERVAL apart). If it dies
# without releasing it (SIGKILL, host lost), a standby beat takes over after this many seconds.
LOCK_TIMEOUT = 10
# Instance base seeds lie in [0, 2**31), so a campaign of up to 2**31 jobs keeps every seed
# (base + i * images_per_prompt + k) below the job contract's 2**32.
SEED_SPAN = SEED_LIMIT // 2
STAMP_SECONDS = "%Y%m%dT%H%M%S"
STAMP_MINUTES = "%Y%m%dT%H%M"
MAX_NAME = 128 - len("-YYYYMMDDTHHMMSS")  # the job contract's campaign names stop at 128

log = logging.getLogger("renderfarm.schedules")


# -- the contract of a fire: instance name and seeds ---------------------------------------

def instance_name(name: str, fired_at: dt.datetime, every: schedule | crontab) -> str:
    """The campaign a fire runs: NAME-YYYYMMDDTHHMM in UTC, with seconds only for intervals
    under a minute (two fires of any other schedule never fall in the same minute)."""
    sub_minute = type(every) is schedule and every.run_every.total_seconds() < 60
    stamp = fired_at.astimezone(dt.timezone.utc).strftime(STAMP_SECONDS if sub_minute else STAMP_MINUTES)
    return f"{name}-{stamp}"


def instance_seed(base_seed: int, instance: str) -> int:
    """The base seed of a campaign instance: sha256 of "BASE_SEED:INSTANCE", mod 2**31.
    Deterministic (re-running an instance resumes it) and different for every run."""
    digest = hashlib.sha256(f"{base_seed}:{instance}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_SPAN


def cron_schedule(expr: str) -> crontab:
    """A cron expression the campaign spec's rule has accepted (see CampaignSpec.schedule)."""
    return crontab.from_string(" ".join(expr.split()))


def parse_every(seconds: float) -> schedule:
    if not seconds > 0:
        raise JobError("every", seconds, "must be a number of seconds > 0")
    return schedule(dt.timedelta(seconds=seconds))


def describe(every: schedule | crontab) -> str:
    if isinstance(every, crontab):
        parts = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return "cron " + " ".join(str(getattr(every, f"_orig_{part}")) for part in parts)
    return f"every {every.run_every.total_seconds():g}s"


# -- the Celery side: app, scheduler, task --------------------------------------------------

class CampaignScheduler(RedBeatScheduler):
    """RedBeat, plus the fire's instance name in the message: computed when beat fires, so
    the worker that runs it later (or again, after a crash) runs the same instance."""

    def reserve(self, entry: RedBeatSchedulerEntry) -> RedBeatSchedulerEntry:
        fired = super().reserve(entry)  # last_run_at = now, stored in Redis
        fired.kwargs = {**fired.kwargs, "instance": instance_name(entry.name, fired.last_run_at, fired.schedule)}
        return fired


def schedule_app(settings: Settings) -> Celery:
    """The farm's app with redbeat configured on the broker's Redis and the campaign task."""
    app = make_app(settings)
    app.conf.update(
        **redbeat_settings(settings.broker_url),  # its own client, not the broker's transport options
        redbeat_key_prefix=KEY_PREFIX,
        redbeat_lock_timeout=LOCK_TIMEOUT,
        beat_max_loop_interval=BEAT_INTERVAL,
        worker_prefetch_multiplier=1,  # a busy beat leaves the next fire to another one
    )

    @app.task(name=CAMPAIGN_TASK)
    def campaign_task(spec: dict[str, Any], instance: str) -> None:
        run_instance(spec, instance, settings)

    ensure_conf(app)
    return app


def run_instance(spec: dict[str, Any], instance: str, settings: Settings) -> None:
    """Submit one fire's campaign instance. The claim (kept for the visibility timeout) makes
    a second message for the same instance a no-op while the first may still be running; a
    message redelivered after a crash comes later than that and resumes the instance."""
    from producer.campaigns import parse_spec, run_campaign
    from producer.window import FeederBusy

    parsed = parse_spec(spec)  # its paths are absolute
    client = redis_client(settings.broker_url)
    claim = CLAIM_PREFIX + instance
    if not client.set(claim, 1, nx=True, ex=settings.visibility_timeout):
        log.warning("campaign instance %s already ran or runs: not running it twice", instance)
        return
    seed = instance_seed(parsed.base_seed, instance)
    log.info("scheduled campaign %s: instance %s, base seed %d", parsed.name, instance, seed)
    try:
        run = run_campaign(dataclasses.replace(parsed, name=instance, base_seed=seed), settings=settings)
    except FeederBusy as err:  # a windowed instance still fed by the run this message came from first
        log.warning("%s", err)
        return
    except BaseException:
        client.delete(claim)  # it did not run: a retry or a redelivery may run it
        raise
    log.info("%s", run.summary())


# -- managing schedules ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    name: str
    schedule: str
    next_run: dt.datetime
    last_run: dt.datetime | None  # None until it first fires
    last_instance: str | None
    spec: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        def iso(t: dt.datetime | None) -> str | None:
            return None if t is None else t.astimezone(dt.timezone.utc).isoformat(timespec="seconds")
        return {"name": self.name, "schedule": self.schedule, "next_run": iso(self.next_run),
                "last_run": iso(self.last_run), "last_instance": self.last_instance,
                "model": self.spec.get("model")}


def _info(entry: RedBeatSchedulerEntry) -> ScheduleInfo:
    """What `schedule list` shows. The next run is the schedule's own estimate (redbeat's
    `due_at` is off by the seconds between the last run and now for cron schedules)."""
    fired = bool(entry.total_run_count)  # the add itself sets last_run_at, without a run
    remaining = entry.schedule.remaining_estimate(entry.last_run_at)
    return ScheduleInfo(entry.name, describe(entry.schedule),
                        entry.default_now() + max(remaining, dt.timedelta(0)),
                        entry.last_run_at if fired else None,
                        instance_name(entry.name, entry.last_run_at, entry.schedule) if fired else None,
                        entry.kwargs.get("spec", {}))


def add_schedule(spec_path: str | Path, cron: str | None = None, every: float | None = None,
                 settings: Settings | None = None) -> ScheduleInfo:
    """Schedule the campaign of SPEC (replacing a schedule of the same name): cron defaults
    to the spec's own `schedule`. Validates everything before writing anything."""
    from producer.campaigns import load_spec

    spec = load_spec(spec_path)
    if cron is not None and every is not None:
        raise JobError("schedule", f"--cron {cron} --every {every}", "give --cron or --every, not both")
    if cron is not None:
        spec = dataclasses.replace(spec, schedule=cron)  # validated by the spec's own cron rule
    if every is not None:
        when: schedule | crontab = parse_every(every)
    elif spec.schedule is not None:
        when = cron_schedule(spec.schedule)
    else:
        raise JobError("schedule", None, "give --cron EXPR or --every SECONDS, or set `schedule:` in the spec")
    if len(spec.name) > MAX_NAME:
        raise JobError("name", spec.name, f"must be at most {MAX_NAME} characters to be scheduled "
                       "(instance names add -YYYYMMDDTHHMM[SS] and campaign names stop at 128)")
    app = schedule_app(settings or Settings.from_env())
    entry = RedBeatSchedulerEntry(spec.name, CAMPAIGN_TASK, when, kwargs={"spec": spec.to_dict()},
                                  options={"queue": CONTROL_QUEUE}, app=app)
    entry.save()
    return _info(RedBeatSchedulerEntry.from_key(entry.key, app=app))


def list_schedules(settings: Settings | None = None) -> list[ScheduleInfo]:
    app = schedule_app(settings or Settings.from_env())
    infos = []
    for key in get_redis(app).zrange(app.redbeat_conf.schedule_key, 0, -1):
        try:
            infos.append(_info(RedBeatSchedulerEntry.from_key(key, app=app)))
        except KeyError:  # removed between the two reads
            continue
    return sorted(infos, key=lambda i: i.name)


def remove_schedule(name: str, settings: Settings | None = None) -> None:
    app = schedule_app(settings or Settings.from_env())
    try:
        entry = RedBeatSchedulerEntry.from_key(RedBeatSchedulerEntry.generate_key(app, name), app=app)
    except KeyError:
        known = ", ".join(i.name for i in list_schedules(settings)) or "none"
        raise JobError("name", name, f"must be the name of a schedule (schedules: {known})") from None
    entry.delete()


# -- running beat ---------------------------------------------------------------------------

def run_beat(settings: Settings, loglevel: str = "INFO") -> int:
    """Beat (thread) + control worker (main thread) in one process; if the beat stops on its
    own (Redis gone, lock lost) the process exits non-zero so its supervisor restarts it."""
    from celery.apps.worker import Worker
    from celery.beat import Service
    from celery.platforms import EX_FAILURE
    from celery.worker import state

    app = schedule_app(settings)
    service = Service(app, scheduler_cls=CampaignScheduler)  # ticks <= beat_max_loop_interval
    stopping = threading.Event()

    def beat() -> None:
        app.set_current()
        try:
            service.start()  # blocks on redbeat's lock while another beat schedules
        except Exception:
            log.exception("beat failed")
        if not stopping.is_set():
            log.error("beat stopped: shutting down so that a supervisor restarts this process")
            state.should_stop = EX_FAILURE

    thread = threading.Thread(target=beat, name="beat", daemon=True)
    thread.start()
    worker = Worker(app=app, hostname=f"beat-{os.getpid()}@{socket.gethostname()}", pool_cls="solo",
                    concurrency=1, queues=[CONTROL_QUEUE], loglevel=loglevel, without_mingle=True,
                    without_gossip=True, task_events=True, redirect_stdouts=False)
    try:
        worker.start()
    finally:
        stopping.set()
        service.stop()
        scheduler = service.__dict__.get("scheduler")  # made by the beat thread, if it got that far
        if scheduler is not None and scheduler.lock is not None:
            thread.join(BEAT_INTERVAL + 5)  # it releases the lock: a standby takes over at once
        # else a standby, blocked in the lock's acquire: holds nothing, dies with the process
    return int(worker.exitcode or 0)


# -- the command line ------------------------------------------------------------------------

def _when(t: dt.datetime | None) -> str:
    return "-" if t is None else t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_add(args: argparse.Namespace) -> int:
    info = add_schedule(args.spec, args.cron, args.every, Settings.from_env(broker_url=args.broker))
    print(f"schedule {info.name}: {info.schedule}, next run {_when(info.next_run)} "
          f"(each run is its own campaign, {info.name}-YYYYMMDDTHHMM[SS]); "
          "`renderfarm beat` runs it")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    infos = list_schedules(Settings.from_env(broker_url=args.broker))
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return 0
    rows = [("NAME", "SCHEDULE", "NEXT RUN", "LAST RUN", "LAST INSTANCE")]
    rows += [(i.name, i.schedule, _when(i.next_run), _when(i.last_run), i.last_instance or "-") for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    remove_schedule(args.name, Settings.from_env(broker_url=args.broker))
    print(f"schedule {args.name} removed (running beats stop firing it within {BEAT_INTERVAL} s)")
    return 0


def cmd_beat(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_beat(Settings.from_env(broker_url=args.broker), args.loglevel.upper())


def register(sub: argparse._SubParsersAction) -> None:
    """Add `schedule add|list|remove` and `beat` to the `renderfarm` command's subcommands."""
    from producer.commands import broker_errors
    from renderfarm.flags import broker_flag

    schedule_parser = sub.add_parser("schedule", help="scheduled campaigns: add, list, remove")
    actions = schedule_parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="run a campaign on a schedule (replaces one of the same name)")
    add.add_argument("spec", metavar="SPEC", help="campaign spec (YAML)")
    when = add.add_mutually_exclusive_group()
    when.add_argument("--cron", metavar="EXPR", help="5-field cron expression in UTC (default: the spec's schedule)")
    when.add_argument("--every", type=float, metavar="SECONDS", help="a fixed interval in seconds instead of cron")
    broker_flag(add)
    add.set_defaults(handler=broker_errors(cmd_add))
    listing = actions.add_parser("list", help="schedules with their next and last run")
    listing.add_argument("--json", action="store_true", help="a JSON list")
    broker_flag(listing)
    listing.set_defaults(handler=broker_errors(cmd_list))
    remove = actions.add_parser("remove", help="delete a schedule (running beats stop firing it)")
    remove.add_argument("name", metavar="NAME", help="the schedule's name (its campaign spec's name)")
    broker_flag(remove)
    remove.set_defaults(handler=broker_errors(cmd_remove))

    beat = sub.add_parser("beat", help="run the scheduler and submit scheduled campaigns (several may run)")
    broker_flag(beat)
    beat.add_argument("--loglevel", default="info", choices=("debug", "info", "warning", "error"),
                      help="the least severe log lines shown (default info)")
    beat.set_defaults(handler=cmd_beat)
