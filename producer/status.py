"""What operators ask of a campaign: how far it is, what failed and why, how fast it goes, and
whether any queue holds jobs that no worker consumes (a model nobody serves), and cancelling it.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import Counter
from collections.abc import Iterator
from typing import Any

from kombu.exceptions import ChannelError

from renderfarm.connections import redis_client
from renderfarm.deadletters import DeadLetters
from renderfarm.fleet import fleet
from renderfarm.jobs import check_campaign
from renderfarm.progress import QUEUES, Progress
from renderfarm.queue import make_app
from renderfarm.settings import Settings

INSPECT_SECONDS = 1.0  # how long workers get to say which queues they consume
SHOWN_FAILURES = 10


@dataclasses.dataclass(frozen=True)
class QueueInfo:
    name: str
    jobs: int
    consumers: int
    dead_letters: int = 0  # messages workers could not take (`renderfarm deadletters`)

    @property
    def warning(self) -> str | None:
        """Jobs that no worker will ever take unless one is started for this queue."""
        if self.jobs and not self.consumers:
            return f"queue {self.name} has {self.jobs} jobs and no worker consumes it"
        return None


def farm_queues(broker: str | None = None) -> list[QueueInfo]:
    """Every queue producers have used, its waiting jobs over all priority sub-queues (as
    kombu counts them), how many live workers consume it (they answer over the broker) and
    its dead letters."""
    settings = Settings.from_env(broker_url=broker)
    with redis_client(settings.broker_url) as client:
        names = sorted(name.decode() for name in client.smembers(QUEUES))
        dead = {queue: count["total"] for queue, count in DeadLetters(client).counts().items()}
    names = sorted(set(names) | set(dead))
    if not names:
        return []
    # The broadcast and its replies go over this call's own connection: one from kombu's pools,
    # which a process shares between its apps, may be a socket of a Redis since restarted.
    with make_app(settings) as app, app.connection_for_read() as connection:
        replies = app.control.inspect(timeout=INSPECT_SECONDS, connection=connection).active_queues() or {}
        consumers = Counter(q["name"] for queues in replies.values() for q in queues)
        channel = connection.default_channel
        return [QueueInfo(name, _waiting(channel, name), consumers[name], dead.get(name, 0)) for name in names]


def _waiting(channel: Any, queue: str) -> int:
    try:
        return channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:  # no message in any of its priority sub-queues
        return 0


def campaign_status(campaign: str, broker: str | None = None,
                    price_per_device_hour: float | None = None) -> dict[str, Any]:
    """Progress counts, the failures' count and a sample of them (job id -> reason:
    renderfarm.progress.FAILURES_SHOWN at most; `failures_cut` when there are more),
    images/s, ETA, device time and, given a price per device-hour, the cost per 1,000 images;
    and the queues with their consumers (`warnings` lists the queues with jobs and no worker)."""
    check_campaign(campaign)
    with redis_client(Settings.from_env(broker_url=broker).broker_url) as client:
        report = Progress(client).status(campaign)
    per_hour = report["images_per_device_hour"]
    report["price_per_device_hour"] = price_per_device_hour
    report["cost_per_1000_images"] = (1000 * price_per_device_hour / per_hour
                                      if price_per_device_hour is not None and per_hour else None)
    queues = farm_queues(broker)
    report["queues"] = [dataclasses.asdict(q) for q in queues]
    with redis_client(Settings.from_env(broker_url=broker).broker_url) as client:
        report["workers"] = fleet(client, {q.name: q.jobs for q in queues})
    report["warnings"] = [q.warning for q in queues if q.warning] + [
        f"worker {w['node']} has finished no job for {w['seconds_since_last_batch']:.0f} s while its queue "
        f"{w['queue']} has jobs" for w in report["workers"] if w["stalled"]]
    return report


def campaign_failures(campaign: str, broker: str | None = None) -> Iterator[tuple[str, str]]:
    """Every failure of the campaign (job id, reason), streamed from Redis page by page, so
    listing a million costs neither side the whole hash at once."""
    check_campaign(campaign)
    with redis_client(Settings.from_env(broker_url=broker).broker_url) as client:
        yield from Progress(client).failures(campaign)


def cancel_campaign(campaign: str, broker: str | None = None) -> dict[str, Any]:
    """Set the campaign's cancel flag: workers skip its queued jobs as they reach them (they
    count as cancelled); running jobs finish. Returns the progress counts at that moment."""
    check_campaign(campaign)
    settings = Settings.from_env(broker_url=broker)
    with redis_client(settings.broker_url) as client:
        progress = Progress(client)
        progress.cancel(campaign)
        return progress.status(campaign)


def _duration(seconds: float | None) -> str:
    return "-" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def _running_lines(report: dict[str, Any]) -> list[str]:
    rate = report["images_per_second"]
    return [f"  {'rate':<10} {'-' if rate is None else f'{rate:.2f} images/s':>8}",
            f"  {'ETA':<10} {_duration(report['eta_seconds']):>8}"]


def _finished_lines(report: dict[str, Any]) -> list[str]:
    """A finished campaign's totals: its wall time from first submission to last image, and
    the images per second over that time."""
    elapsed, done = report["elapsed_seconds"], report["done"]
    if not elapsed:
        return [f"  {'finished':<10} {done:>8} images"]
    return [f"  {'finished':<10} {done:>8} images in {_duration(elapsed)}, {done / elapsed:.2f} images/s"]


def device_time(report: dict[str, Any]) -> str:
    """What the done images took of the devices, e.g. `0.250 device-hours, 1,800 images per device-hour`."""
    return (f"{report['device_seconds'] / 3600:.3f} device-hours, "
            f"{report['images_per_device_hour']:,.0f} images per device-hour")


def _cost_lines(report: dict[str, Any]) -> list[str]:
    """What the done images cost in device time and, given a price, in money."""
    if not report["device_seconds"]:
        return []
    lines = [f"  {'devices':<10} {device_time(report)}"]
    if report["cost_per_1000_images"] is not None:
        lines.append(f"  {'cost':<10} {report['cost_per_1000_images']:>8.4f} per 1,000 images "
                     f"at {report['price_per_device_hour']:g} per device-hour")
    return lines


def format_status(report: dict[str, Any]) -> str:
    """The report for a terminal: counts, rate and ETA, a few failures, queues, the workers,
    warnings."""
    lines = [f"campaign {report['campaign']}"
             + (" (cancel requested)" if report["cancel_requested"] else ""),
             *(f"  {name:<10} {report[name]:>8}"
               for name in ("submitted", "queued", "running", "done", "failed", "cancelled"))]
    if report["window"] is not None:
        lines.append(f"  {'window':<10} {report['window']:>8} jobs queued or running at most, "
                     f"{report['jobs']} jobs in all")
    lines += _finished_lines(report) if report["finished"] else _running_lines(report)
    lines += _cost_lines(report)
    if report["safety_checked"]:
        lines.append(f"  {'safety':<10} {report['safety_checked']:>8} done images checked, {report['nsfw']} "
                     f"flagged nsfw ({report['safety_pass_rate']:.1%} passed)")
    if report["gated"]:
        lines.append(f"  {'gate':<10} {report['gated']:>8} done images gated, {report['gate_passed']} passed "
                     f"({report['gate_pass_rate']:.1%})")
    if report["failed"]:
        shown = list(report["failures"].items())[:SHOWN_FAILURES]
        lines.append(f"failures ({report['failed']}):")
        lines += [f"  {job_id}: {reason}" for job_id, reason in shown]
        if report["failed"] > len(shown):
            lines.append(f"  ... and {report['failed'] - len(shown)} more "
                         f"(renderfarm status {report['campaign']} --failures lists all)")
    if report["queues"]:
        lines.append("queues:")
        lines += [f"  {q['name']}: {q['jobs']} jobs, {q['consumers']} consumers"
                  + (f", {q['dead_letters']} dead letters (renderfarm deadletters)" if q["dead_letters"] else "")
                  for q in report["queues"]]
    if report["workers"]:
        lines.append("workers (since their first batch):")
        lines += [_worker_line(w) for w in report["workers"]]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def _worker_line(worker: dict[str, Any]) -> str:
    rate, mp = worker["images_per_second"], worker["megapixel_steps_per_second"]
    return (f"  {worker['node']}: {worker['images']} images"
            + ("" if rate is None else f", {rate:.2f} images/s, {mp:.1f} megapixel-steps/s")
            + f", batches {worker['batch_fill']:.0%} full, last batch {_duration(worker['seconds_since_last_batch'])} ago"
            + (" STALLED" if worker["stalled"] else ""))
