"""The producer side's commands of `renderfarm` (submit, status, cancel, deadletters, campaign,
gallery). No JAX."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import signal
import sys
from collections.abc import Callable

import redis
from kombu.exceptions import KombuError

from producer.status import (
    campaign_failures,
    campaign_status,
    cancel_campaign,
    device_time,
    farm_queues,
    format_status,
)
from producer.submit import Submission, WaitTimeout, submit, wait_for
from renderfarm.connections import redis_client
from renderfarm.flags import broker_flag, job_defaults, job_flags
from renderfarm.gallery import DEFAULT_LIMIT, DEFAULT_TILES, refresh
from renderfarm.progress import FAILURES_SHOWN, Progress
from renderfarm.settings import Settings, redacted
from renderfarm.storage import open_storage

Handler = Callable[[argparse.Namespace], int]


def broker_errors(handler: Handler) -> Handler:
    """A broker that cannot be reached is an operator's error message, not a traceback."""
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (redis.RedisError, KombuError, OSError) as err:
            url = Settings.from_env(broker_url=args.broker).broker_url
            print(f"renderfarm: error: broker {redacted(url)}: {redacted(str(err))}", file=sys.stderr)
            return 1
    return run


@broker_errors
def cmd_submit(args: argparse.Namespace) -> int:
    submission = submit(args.prompts_args, prompts_file=args.prompts, seed=args.seed,
                        priority=args.priority, broker=args.broker, **job_defaults(args))
    print(submission.summary())
    return _follow(args, submission, args.campaign)


def _follow(args: argparse.Namespace, submission: Submission, campaign: str) -> int:
    """With --wait or --timeout: a progress bar until the submission's jobs are finished."""
    if not (args.wait or args.timeout is not None):
        return 0
    try:
        if submission.window is None:
            counts = wait_for(submission, args.timeout)
        else:  # a windowed run follows its campaign: it keeps no per-submission set
            from producer.window import follow

            counts = follow(campaign, submission.broker_url, args.timeout)
    except WaitTimeout as err:
        print(f"renderfarm: {err}", file=sys.stderr)
        for queue in farm_queues(args.broker):
            if queue.name in submission.queues and queue.warning:
                print(f"renderfarm: warning: {queue.warning}", file=sys.stderr)
        return 1
    print(f"finished: {counts['done']} done, {counts['failed']} failed, {counts['cancelled']} cancelled")
    with redis_client(Settings.from_env(broker_url=args.broker).broker_url) as client:
        totals = Progress(client).status(campaign)  # the whole campaign's, this submission's included
    if totals["device_seconds"]:
        print(f"campaign {campaign}: {device_time(totals)}")
    if counts["failed"]:
        print(f"renderfarm status {campaign} lists why jobs failed", file=sys.stderr)
        return 1
    return 0


def cmd_campaign_validate(args: argparse.Namespace) -> int:
    from producer.campaigns import load_spec, scan_campaign

    spec = load_spec(args.spec)
    scan = scan_campaign(spec)
    print(f"campaign {spec.name}: {scan.rows} rows from {spec.source}, {scan.jobs} jobs "
          f"({spec.images_per_prompt} per row), seeds {spec.base_seed}.."
          f"{spec.base_seed + max(scan.rows * spec.images_per_prompt - 1, 0)}, output {spec.output}")
    print("shapes (model, width, height, steps, scheduler, guidance; a worker compiles a program for each, "
          "one for both guidance rows of a guidance-distilled model such as Flux):")
    for (model, width, height, steps, sampler, guided, image), jobs in scan.shapes.most_common():
        print(f"  {model} {width or 'default'}x{height or 'default'} {steps} steps "
              f"{sampler}{'' if guided else ' cfg-free'}{' img2img' if image else ''}: {jobs} jobs")
    if scan.ignored_columns:
        print(f"ignored columns (not job fields): {', '.join(scan.ignored_columns)}")
    if spec.schedule:
        print(f"schedule: {spec.schedule}")
    if scan.bad_rows:
        print(f"{scan.bad_rows} bad rows (skipped by `campaign run`; --strict refuses to run):")
        print("\n".join(f"  {row}" for row in scan.first_bad))
        if scan.bad_rows > len(scan.first_bad):
            print(f"  ... and {scan.bad_rows - len(scan.first_bad)} more")
        return 1
    if not scan.jobs:
        print("invalid: the source gives no job", file=sys.stderr)
        return 1
    print("valid")
    return 0


@broker_errors
def cmd_campaign_run(args: argparse.Namespace) -> int:
    from producer.campaigns import StrictError, load_spec, run_campaign

    spec = load_spec(args.spec)
    if args.window is not None:
        spec = dataclasses.replace(spec, window=args.window)  # validated by the spec's own rule
    # A feeder told to stop (a pod's SIGTERM) unwinds: it frees its campaign's lock at once.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        run = run_campaign(spec, settings=Settings.from_env(broker_url=args.broker), strict=args.strict,
                           progress=True)
    except StrictError as err:
        print(f"renderfarm: error: {err}", file=sys.stderr)
        print("\n".join(f"  bad {row}" for row in err.scan.first_bad), file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(run.summary())
    return 0 if run.submission is None else _follow(args, run.submission, spec.name)


PRICE_ENV = "RENDERFARM_PRICE_PER_DEVICE_HOUR"


def price_per_device_hour(flag: float | None) -> float | None:
    """The flag's price, else the environment's, else None; a price must be a finite number >= 0."""
    name, value = ("--price-per-device-hour", flag) if flag is not None else (PRICE_ENV, os.environ.get(PRICE_ENV))
    if value is None or value == "":
        return None
    try:
        price = float(value)
    except ValueError:
        price = math.nan
    if not (math.isfinite(price) and price >= 0):
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0 (a device-hour's price)")
    return price


@broker_errors
def cmd_status(args: argparse.Namespace) -> int:
    try:
        price = price_per_device_hour(args.price_per_device_hour)
    except ValueError as err:
        print(f"renderfarm status: error: {err}", file=sys.stderr)
        return 2
    if args.failures:  # streamed, one line each: a campaign may have failed a million jobs
        for job_id, reason in campaign_failures(args.campaign, args.broker):
            print(json.dumps({"job_id": job_id, "reason": reason}) if args.json else f"{job_id}: {reason}")
        return 0
    report = campaign_status(args.campaign, args.broker, price)
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


@broker_errors
def cmd_cancel(args: argparse.Namespace) -> int:
    report = cancel_campaign(args.campaign, args.broker)
    print(f"campaign {args.campaign} cancelled: workers skip its {report['queued']} queued jobs "
          f"as they reach them; {report['running']} running jobs finish "
          f"({report['done']} done so far). Submitting to it again lifts the cancel.")
    return 0


@broker_errors
def cmd_deadletters(args: argparse.Namespace) -> int:
    from renderfarm.deadletters import DeadLetters
    from renderfarm.progress import retrying_client

    with retrying_client(Settings.from_env(broker_url=args.broker).broker_url) as client:
        letters = DeadLetters(client)
        counts = letters.counts()
        queues = [args.queue] if args.queue else sorted(counts)
        if args.requeue or args.purge:
            if not args.queue:
                print("renderfarm: error: --requeue and --purge need --queue QUEUE", file=sys.stderr)
                return 2
            if args.requeue:
                requeued, dropped = letters.requeue(args.queue)
                print(f"{args.queue}: requeued {requeued}, dropped {dropped} cut messages")
            else:
                print(f"{args.queue}: purged {letters.purge(args.queue)} dead letters")
            return 0
        report = {queue: {**counts.get(queue, {"total": 0, "kept": 0}),
                          "entries": letters.entries(queue, args.limit)} for queue in queues}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not report:
        print("no dead letters")
    for queue, found in report.items():
        print(f"{queue}: {found['total']} dead letters ({found['kept']} kept)")
        for entry in found["entries"]:
            when = datetime.datetime.fromtimestamp(entry["at"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            print(f"  {when}  {entry['reason']}")
    return 0


def cmd_gallery(args: argparse.Namespace) -> int:
    gallery = refresh(open_storage(args.source), args.campaign, limit=args.limit, tiles=args.tiles,
                      make_thumbnails=True)
    print(gallery.summary())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the producer side's commands to the `renderfarm` command's subparsers."""
    submit_parser = sub.add_parser("submit", help="enqueue jobs for the farm's workers")
    job_flags(submit_parser)
    submit_parser.add_argument("--priority", type=int, choices=range(10), metavar="0-9",
                               help="9 is the most urgent (default: 5); a .jsonl line may set its own")
    submit_parser.add_argument("--wait", action="store_true",
                               help="show progress until every job of this submission is finished")
    submit_parser.add_argument("--timeout", type=float, metavar="S",
                               help="give up waiting after S seconds, exit 1 (implies --wait)")
    broker_flag(submit_parser)
    submit_parser.set_defaults(handler=cmd_submit)

    status = sub.add_parser("status", help="a campaign's progress, failures, rate, ETA and queues")
    status.add_argument("campaign", metavar="CAMPAIGN", help="the campaign's name")
    status.add_argument("--json", action="store_true",
                        help="one JSON object (with --failures: one a line); its failures are a sample of "
                             f"at most {FAILURES_SHOWN} (failures_cut says there are more)")
    status.add_argument("--failures", action="store_true",
                        help="list every failure instead, `JOB_ID: REASON` a line, streamed from Redis")
    status.add_argument("--price-per-device-hour", type=float, metavar="PRICE",
                        help="what one device costs an hour (a TPU chip, a GPU), in any currency: status "
                             f"then shows the cost per 1,000 images (default: ${PRICE_ENV}, "
                             "else no cost)")
    broker_flag(status)
    status.set_defaults(handler=cmd_status)

    cancel = sub.add_parser("cancel", help="skip a campaign's queued jobs")
    cancel.add_argument("campaign", metavar="CAMPAIGN", help="the campaign's name")
    broker_flag(cancel)
    cancel.set_defaults(handler=cmd_cancel)

    dead = sub.add_parser("deadletters", help="messages workers could not take, with the reason; requeue or purge")
    dead.add_argument("--queue", help="one queue (default: every queue with dead letters)")
    dead.add_argument("--limit", type=int, default=20, help="entries listed per queue, newest first (default 20)")
    action = dead.add_mutually_exclusive_group()
    action.add_argument("--requeue", action="store_true", help="put the queue's kept messages back on it")
    action.add_argument("--purge", action="store_true", help="drop the queue's dead letters")
    dead.add_argument("--json", action="store_true", help="one JSON object")
    broker_flag(dead)
    dead.set_defaults(handler=cmd_deadletters)

    campaign = sub.add_parser("campaign", help="check or run a campaign spec (YAML; docs/campaigns.md)")
    actions = campaign.add_subparsers(dest="action", required=True)
    validate = actions.add_parser("validate", help="check the spec and every row; count jobs; list bad rows")
    validate.add_argument("spec", metavar="SPEC", help="campaign spec (YAML)")
    validate.set_defaults(handler=cmd_campaign_validate)
    run = actions.add_parser("run", help="submit the jobs whose results are not in storage yet")
    run.add_argument("spec", metavar="SPEC", help="campaign spec (YAML)")
    run.add_argument("--strict", action="store_true", help="enqueue nothing if any row is bad")
    run.add_argument("--window", type=int, metavar="N",
                     help="keep at most N of the campaign's jobs queued or running, refilling as they finish "
                          "(bounded Redis memory; default: the spec's `window`, else submit all at once)")
    run.add_argument("--wait", action="store_true", help="show progress until every job submitted is finished")
    run.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds, exit 1 (implies --wait)")
    broker_flag(run)
    run.set_defaults(handler=cmd_campaign_run)

    gallery = sub.add_parser("gallery", help="rebuild a campaign's index.html and preview.png")
    gallery.add_argument("campaign", metavar="CAMPAIGN", help="the campaign's name (its folder under --from)")
    gallery.add_argument("--from", dest="source", required=True, metavar="URL",
                         help="storage root the campaign is in (local folder or gs://bucket/prefix)")
    gallery.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                         help=f"images listed on the page, newest first (default {DEFAULT_LIMIT})")
    gallery.add_argument("--tiles", type=int, default=DEFAULT_TILES, metavar="N",
                         help=f"thumbnails on the contact sheet (default {DEFAULT_TILES})")
    gallery.set_defaults(handler=cmd_gallery)
