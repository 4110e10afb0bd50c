"""Warm shutdown (SIGTERM, SIGINT; a spot VM's 30 s notice): the held jobs are stored or put
back on their queue within `--drain-seconds`, whatever the main thread is doing."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from celery import bootsteps, signals

from worker.processing import Processor

log = logging.getLogger("renderfarm.worker")

WARM_STOPS = frozenset({signal.SIGTERM, signal.SIGINT})  # Celery's warm shutdown
# Of the drain window, what putting the held jobs back and Celery's own exit get.
SETTLE_SECONDS = 1.0


class StopDeadline:
    """A warm shutdown's deadline, held whatever the main thread is doing. Python runs a
    signal's handler on the main thread, between bytecodes: while that thread waits on the
    devices (a dispatch can block until the batch before is done), a one-by-one render or
    a slow call, Celery does not even hear of the signal, and a batch can take longer than
    the whole drain window. The interpreter's C handler writes each signal to the wakeup
    fd at once; a thread of this class reads it there. The drain (main thread) stores what
    it can until SETTLE_SECONDS before the deadline (the signal + `drain_seconds`), then
    puts the rest back; if by then it has not, this thread does (a batch still on the
    devices included: its results are dropped) and ends the process at once, else it
    ends it at the deadline. One lock: whichever comes first settles."""

    def __init__(self, processor: Processor, drain_seconds: float) -> None:
        self.processor, self.drain_seconds = processor, drain_seconds
        self.deadline: float | None = None  # monotonic, from the first stop signal
        self.consumer: Any = None  # Celery's consumer: its event loop and channel send the acks
        self._settling = threading.Lock()
        self._signals: int | None = None  # the read end of the wakeup fd

    def watch(self, consumer: Any) -> None:
        """Hear stop signals from now on (on the main thread: the wakeup fd is set there)."""
        self.consumer = consumer
        if self._signals is not None:  # a reconnection: the same consumer, watched already
            return
        self._signals, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="stop-deadline", daemon=True).start()

    def begin(self) -> None:
        """A stop signal came (the watching thread or Celery's handler, whichever runs
        first, notes it): the deadline is set, and every wait for the devices or the
        writer ends."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.drain_seconds
        self.processor.writer.stopping.set()

    def settle(self, wait: float = -1) -> bool:
        """Put back every job the processor still holds, unless the drain did, then send
        the acks and requeues waiting on Celery's event loop, which no longer turns.
        Whether it put jobs back (False too if another thread held the lock for `wait` s)."""
        if not self._settling.acquire(timeout=wait):
            return False
        try:
            gave_back = not self.processor.drained
            if gave_back:
                self.processor.give_back()
            c = self.consumer
            for settle in c.hub._pop_ready() if c.hub is not None else ():
                settle()
            channel = c.task_consumer.channel if c.task_consumer else None
            if channel is not None:
                channel.qos.flush_acks()
            return gave_back
        finally:
            self._settling.release()

    def _watch(self) -> None:
        while self.deadline is None:
            if WARM_STOPS & set(os.read(self._signals, 64)):
                self.begin()
        time.sleep(max(0.0, self.deadline - SETTLE_SECONDS - time.monotonic()))
        if self.settle(wait=SETTLE_SECONDS):  # the main thread is held up: nothing else will
            log.warning("drain deadline: every job held went back on its queue; the worker exits, "
                        "whatever the devices are doing")
        else:  # the drain settled: Celery's own exit gets until the deadline
            time.sleep(max(0.0, self.deadline - time.monotonic()))
        os._exit(0)


def drain_step(stop: StopDeadline) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep that drains the processor on warm shutdown. It stops before the
    task consumer (it requires it), so the channel is still open to ack and requeue."""

    @signals.worker_shutting_down.connect(weak=False)
    def shutting_down(**_: Any) -> None:  # in the signal handler
        stop.begin()

    class Drain(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c: Any) -> None:
            stop.watch(c)

        def shutdown(self, c: Any) -> None:
            if stop.deadline is None:  # a reconnection, not a shutdown: nothing to drain
                return
            stop.processor.drain(stop.deadline - SETTLE_SECONDS)
            stop.settle()

    return Drain
