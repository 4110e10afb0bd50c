"""One bundle's life as one object: the jobs the worker gathered for one batch, and the state
they are in.

    GATHERED ──> COMPILING ──> READING ──> RENDERING ──> STORING ──> SETTLED
        │            │                         ^
        └────────────┴─────────────────────────┘  its program compiled, its sources read already
    and from any state to SETTLED once it holds no job.

A job belongs to exactly one bundle from the moment it is gathered until its outcome is
recorded (acknowledged or put back on the queue): whoever records it takes it out of its
bundle first (`release`, `stored`, `unstored`, `release_all`), and a bundle that holds no
job any more is SETTLED. So a warm shutdown asks the bundles what they still hold, and a
stored result finds its job in its own bundle.

What else happens on a state change (metrics, the fleet's hash, galleries, the rate log)
is a `BundleHook`, one concern each (worker/hooks.py); the worker's Processor only drives
the bundles.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery.worker.request import Request

    from renderfarm.jobs import JobSpec
    from worker.engine import Batch, InFlight, Rendered, ShapeKey

log = logging.getLogger("renderfarm.worker")


@dataclasses.dataclass(eq=False)
class Job:
    """A delivered job that is valid here; only `Processor.receive` makes one."""

    request: Request
    spec: JobSpec
    key: ShapeKey
    attempt: int = 0
    started: float = dataclasses.field(default_factory=time.time)

    @property
    def campaign(self) -> str:
        return self.spec.campaign

    @property
    def redelivered(self) -> bool:
        """Whether its message came back to the queue before (put back by a worker, or restored
        after the visibility timeout): a worker may have stored it, its attempt refunded."""
        return bool((self.request.delivery_info or {}).get("redelivered"))

    @property
    def ident(self) -> tuple[str, str]:
        """A job is a spec in a campaign: the same spec in two campaigns is two jobs."""
        return self.spec.campaign, self.spec.job_id


class State(enum.Enum):
    GATHERED = "gathered"  # waiting in the gatherer for its bundle to fill (or to be due)
    COMPILING = "compiling"  # admitted; its shape's program compiles on the compile thread
    READING = "reading"  # its program is ready; its image jobs' sources are still being read
    RENDERING = "rendering"  # on the devices (or its jobs one by one, after its batch raised)
    STORING = "storing"  # rendered; on the writer's store threads
    SETTLED = "settled"  # it holds no job: each went on to be acknowledged or put back on the queue


NEXT: dict[State, frozenset[State]] = {
    State.GATHERED: frozenset({State.COMPILING, State.READING, State.RENDERING, State.SETTLED}),
    State.COMPILING: frozenset({State.READING, State.RENDERING, State.SETTLED}),
    State.READING: frozenset({State.RENDERING, State.SETTLED}),
    State.RENDERING: frozenset({State.STORING, State.SETTLED}),
    State.STORING: frozenset({State.SETTLED}),
    State.SETTLED: frozenset(),
}


class BundleHook:
    """Something to do when a bundle changes state, besides its jobs' own outcomes. Override
    the events you need; a hook that raises is logged and never fails the bundle's jobs."""

    def admitted(self, bundle: Bundle) -> None:
        """It left GATHERED for the devices (COMPILING, READING or RENDERING): `bundle.jobs` were admitted."""

    def rendered(self, bundle: Bundle) -> None:
        """It entered STORING: `bundle.rendered` holds its images."""

    def settled(self, bundle: Bundle) -> None:
        """It entered SETTLED: `bundle.records` holds the sidecars of the jobs it stored, if any."""

    def polled(self, busy: bool) -> None:
        """The consumer's timer: `busy` while a bundle is rendering or storing."""


class Bundle:
    """The jobs the worker gathered for one batch (one shape key), from gathering to settling:
    rendered as that batch, or one by one (each its own batch) after it raised."""

    def __init__(self, key: ShapeKey, hooks: Sequence[BundleHook] = ()) -> None:
        self.key, self.hooks = key, hooks
        self.jobs: list[Job] = []  # the jobs it holds: neither acknowledged nor put back yet
        self.state = State.GATHERED
        self.entered: dict[State, float] = {State.GATHERED: time.monotonic()}  # when it entered each state
        self.inflight: InFlight | None = None  # while RENDERING on the devices
        self.rendered: list[Rendered] = []  # once STORING
        self.records: list[dict[str, Any]] = []  # the sidecars of its jobs stored so far

    def __repr__(self) -> str:
        return f"<Bundle {self.key} {self.state.value}: {len(self.jobs)} jobs>"

    @property
    def batches(self) -> list[Batch]:
        """The batches its images came from: one, or one per job rendered one by one."""
        return list({result.batch.seq: result.batch for result in self.rendered}.values())

    # -- moving on -------------------------------------------------------------------------

    def add(self, job: Job) -> None:
        if self.state is not State.GATHERED:
            raise RuntimeError(f"{self!r}: jobs are added while it is gathered only")
        self.jobs.append(job)

    def compiling(self) -> None:
        self._move(State.COMPILING)

    def reading(self) -> None:
        if self.state is not State.READING:
            self._move(State.READING)

    def rendering(self, inflight: InFlight | None) -> None:
        """On the devices (`inflight`), or None: its jobs rendered one by one, synchronously
        (also after its batch raised on the devices, when it is rendering already)."""
        self.inflight = inflight
        if self.state is not State.RENDERING:
            self._move(State.RENDERING)

    def storing(self, rendered: list[Rendered]) -> None:
        self.inflight, self.rendered = None, rendered
        self._move(State.STORING)

    # -- letting jobs go: the caller records each one's outcome -------------------------------

    def release(self, job: Job) -> Job:
        """Take `job` out of the bundle, to be acknowledged or put back on the queue."""
        self.jobs.remove(job)
        self._settle_if_empty()
        return job

    def release_all(self) -> list[Job]:
        """Every job it still holds (none once settled); it is settled."""
        jobs, self.jobs = self.jobs, []
        if self.state is not State.SETTLED:
            self._move(State.SETTLED)
        return jobs

    def stored(self, records: list[dict[str, Any]]) -> list[tuple[Job, dict[str, Any]]]:
        """Its jobs whose sidecars these are, taken out of it, each with its sidecar. A job
        given up on meanwhile (a drain put it back on the queue) is not among them."""
        self.records += records
        done = []
        for record in records:
            job = self._find(record["spec"]["campaign"], record["job_id"])
            if job is not None:
                self.jobs.remove(job)
                done.append((job, record))
        self._settle_if_empty()
        return done

    def unstored(self, result: Rendered) -> Job | None:
        """Its job whose result could not be stored, taken out of it (None: given up on already)."""
        job = self._find(result.spec.campaign, result.spec.job_id)
        return None if job is None else self.release(job)

    # -- inside ------------------------------------------------------------------------------

    def _find(self, campaign: str, job_id: str) -> Job | None:
        """The first of its jobs with this id (a message delivered twice is two jobs, one result each)."""
        return next((job for job in self.jobs if job.ident == (campaign, job_id)), None)

    def _settle_if_empty(self) -> None:
        if not self.jobs and self.state is not State.SETTLED:
            self._move(State.SETTLED)

    def _move(self, state: State) -> None:
        if state not in NEXT[self.state]:
            raise RuntimeError(f"{self!r} cannot become {state.value}")
        before, self.state = self.state, state
        self.entered[state] = time.monotonic()
        for hook in self.hooks:
            try:
                if before is State.GATHERED and state is not State.SETTLED:
                    hook.admitted(self)
                if state is State.STORING:
                    hook.rendered(self)
                if state is State.SETTLED:
                    hook.settled(self)
            except Exception:  # noqa: BLE001 - metrics or a gallery must not fail jobs
                log.warning("%s: hook %s failed on %s", self, type(hook).__name__, state.value, exc_info=True)
