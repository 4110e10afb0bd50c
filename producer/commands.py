"""The farm subcommands of `renderfarm` (submit, status, cancel). Producer side: no JAX."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import redis
from kombu.exceptions import KombuError

from producer.status import campaign_status, cancel_campaign, farm_queues, format_status
from producer.submit import WaitTimeout, submit, wait_for
from renderfarm.settings import Settings

Handler = Callable[[argparse.Namespace], int]


def _broker_errors(handler: Handler) -> Handler:
    """A broker that cannot be reached is an operator's error message, not a traceback."""
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (redis.RedisError, KombuError, OSError) as err:
            url = Settings.from_env(broker_url=args.broker).broker_url
            print(f"renderfarm: error: broker {url}: {err}", file=sys.stderr)
            return 1
    return run


@_broker_errors
def cmd_submit(args: argparse.Namespace) -> int:
    from renderfarm.cli import job_defaults

    submission = submit(args.prompts_args, prompts_file=args.prompts, seed=args.seed,
                        priority=args.priority, broker=args.broker, **job_defaults(args))
    print(submission.summary())
    if not (args.wait or args.timeout is not None):
        return 0
    try:
        counts = wait_for(submission, args.timeout)
    except WaitTimeout as err:
        print(f"renderfarm: {err}", file=sys.stderr)
        for queue in farm_queues(args.broker):
            if queue.name in submission.queues and queue.warning:
                print(f"renderfarm: warning: {queue.warning}", file=sys.stderr)
        return 1
    print(f"finished: {counts['done']} done, {counts['failed']} failed, {counts['cancelled']} cancelled")
    if counts["failed"]:
        print(f"renderfarm status {args.campaign} lists why jobs failed", file=sys.stderr)
        return 1
    return 0


@_broker_errors
def cmd_status(args: argparse.Namespace) -> int:
    report = campaign_status(args.campaign, args.broker)
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


@_broker_errors
def cmd_cancel(args: argparse.Namespace) -> int:
    report = cancel_campaign(args.campaign, args.broker)
    print(f"campaign {args.campaign} cancelled: workers skip its {report['queued']} queued jobs "
          f"as they reach them; {report['running']} running jobs finish "
          f"({report['done']} done so far). Submitting to it again lifts the cancel.")
    return 0


def _broker_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", metavar="URL",
                        help="Redis broker URL (default: $RENDERFARM_BROKER_URL or redis://localhost:6379/0)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add submit, status and cancel to the `renderfarm` command's subparsers."""
    from renderfarm.cli import job_flags  # cli.py calls register: import it only then

    submit_parser = sub.add_parser("submit", help="enqueue jobs for the farm's workers")
    job_flags(submit_parser)
    submit_parser.add_argument("--priority", type=int, choices=range(10), metavar="0-9",
                               help="9 is the most urgent (default: 5); a .jsonl line may set its own")
    submit_parser.add_argument("--wait", action="store_true",
                               help="show progress until every job of this submission is finished")
    submit_parser.add_argument("--timeout", type=float, metavar="S",
                               help="give up waiting after S seconds, exit 1 (implies --wait)")
    _broker_flag(submit_parser)
    submit_parser.set_defaults(handler=cmd_submit)

    status = sub.add_parser("status", help="a campaign's progress, failures, rate, ETA and queues")
    status.add_argument("campaign", metavar="CAMPAIGN")
    status.add_argument("--json", action="store_true", help="one JSON object")
    _broker_flag(status)
    status.set_defaults(handler=cmd_status)

    cancel = sub.add_parser("cancel", help="skip a campaign's queued jobs")
    cancel.add_argument("campaign", metavar="CAMPAIGN")
    _broker_flag(cancel)
    cancel.set_defaults(handler=cmd_cancel)
