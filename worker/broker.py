"""kombu's Redis transport, with messages popped and recorded as unacked in one atomic step,
several at a time, and less Redis work per message for a worker that acks a bundle of jobs at once.

- Deliveries: stock kombu BRPOPs one message, then records it in the unacked hash and index
  from Python; a worker killed between the two loses the message. Here a Lua script
  (lua/pop_and_record.lua, sent as EVALSHA, atomic) pops up to the prefetch credit (at most
  MAX_POP) from the queue's priority lists and records each one before returning them all,
  so a message is always either in its queue or in the unacked hash, from where kombu's
  restore brings it back after the visibility timeout. One round trip per pop of several
  messages instead of two per message.
- Tags: stock kombu records a message under the delivery tag it carries, so a message pushed
  with the tag of one held unacked overwrites that one's record, which is then never
  restored. The pop script gives such a message a fresh tag (`TAG#TIME.N`) and the message
  is delivered with it, so every held message has a record of its own, acknowledged or
  restored on its own.
- Waiting: a script cannot block. After an empty reply the next EVAL is pipelined behind
  `BLMOVE list list RIGHT RIGHT wait` on the list jobs without a priority land on
  (renderfarm.queue.redis_priority): a server-side wait that leaves the list as it is and
  returns as soon as a job lands there. Jobs of other priorities are seen when the wait
  ends; it starts at FIRST_WAIT once the queue drains and doubles up to `brpop_timeout`
  (1 s). So an idle worker sends a wait and a pop a second (stock kombu: one BRPOP), a
  lone default-priority job wakes it at once, and one of another priority waits at most
  `brpop_timeout` (tests/test_broker.py checks all three). The other way, a client-side
  back-off with no command in flight between polls, costs one EVAL a second but makes
  every lone job wait up to the back-off (0.5 s on average), and kombu's blocking
  `drain_events()` would wait on a socket with nothing to answer. The wait keeps
  `maybe_check_brpop_health` quiet: a reply is due within `brpop_timeout`, as for BRPOP.
- Acks: stock kombu removes each acked message from the unacked index in its own round
  trip; a worker acks a stored bundle together, so here they go in one pipeline per
  event-loop tick. A worker that dies between an ack and the flush leaves those messages
  unacked; they are delivered again after the visibility timeout and the worker that gets
  them finds their results stored (at least once, as before).
- The door: each popped item is checked (worker.envelope) before kombu decodes it or Celery
  reads its headers. One that fails is acknowledged and moved to its queue's dead letters
  (renderfarm.deadletters) in one transaction; stock kombu would stop the consumer on it,
  the message would go back to the head of the queue and stop the next worker too.
- Held messages stay fresh: a thread re-stamps the unacked index entries of the messages
  this channel holds every quarter of the visibility timeout, and the channel's own restore
  scan stamps them first, so only a dead worker's messages age past it. A slow batch, a
  compile, a long prefetch or a paused process never causes a redelivery, and the timeout
  can be short: it bounds how long a dead worker's jobs wait. A popped message is recorded
  as popped at the end of the server-side wait it was sent behind, never earlier.
- One redis-py client serves the channel's bookkeeping; stock kombu builds one per call.

With `global_keyprefix` set the channel consumes as stock kombu does (BRPOP). The transport
extends kombu internals, so kombu is pinned to the minor version they were written against
(tests/test_broker.py checks each one it relies on).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from queue import Empty
from typing import Any

from kombu.transport import redis, virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps
from redis.exceptions import NoScriptError

from renderfarm import deadletters
from renderfarm.queue import redis_priority
from worker.envelope import Rejected, open_envelope

log = logging.getLogger(__name__)

MAX_POP = 64  # messages per round trip, when the prefetch credit allows as many
FIRST_WAIT = 0.05  # seconds of the first server-side wait once the queue is drained

# Sent as EVALSHA; loaded once per connection, and again after NOSCRIPT (a restarted Redis).
POP_AND_RECORD = (Path(__file__).parent / "lua" / "pop_and_record.lua").read_text()
POP_AND_RECORD_SHA = hashlib.sha1(POP_AND_RECORD.encode()).hexdigest()


class QoS(redis.QoS):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []
        self.prerecorded: set[str] = set()  # tags the pop script recorded, not yet appended

    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's record of a delivered message, unless the pop script wrote it already;
        in a plain pipeline: MULTI/EXEC buys nothing here (the restore scan only takes
        entries older than the visibility timeout, never one being written)."""
        if delivery_tag in self.prerecorded:
            self.prerecorded.discard(delivery_tag)
        else:
            delivery = message.delivery_info
            record = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
            self.channel._shared_client.pipeline(transaction=False) \
                .zadd(self.unacked_index_key, {delivery_tag: time.time()}) \
                .hset(self.unacked_key, delivery_tag, record) \
                .execute()
        virtual.QoS.append(self, message, delivery_tag)

    def pop_limit(self) -> int:
        """How many messages one pop may take: the prefetch credit, at most MAX_POP."""
        credit = self.can_consume_max_estimate()
        return MAX_POP if credit is None else max(1, min(credit, MAX_POP))

    def ack(self, delivery_tag: str) -> None:
        self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # bookkeeping only; Redis on the next flush

    def restore_visible(self, start: int = 0, num: int | None = 10, interval: int = 10) -> None:
        """kombu's restore scan, once this channel's own held messages are stamped: a worker
        never restores what it holds, even when the keeper thread ran late (the process was
        paused, or a message was popped since its last stamp)."""
        self.channel.stamp_held()
        super().restore_visible(start, num, interval)

    def flush_acks(self) -> None:
        if not self._acked:
            return
        tags, self._acked = self._acked, []
        with self.pipe_or_acquire() as pipe:
            for tag in tags:
                self._remove_from_indices(tag, pipe)
            pipe.execute()


class Channel(redis.Channel):
    QoS = QoS

    _idle_wait = 0.0  # seconds the next pop waits server-side first (0: the last one got messages)
    _sent: tuple[str, ...] = ()  # the commands whose replies the next read parses
    _refused_until = 0.0  # monotonic time before which no pop is sent (Redis refused the last)
    _script_loaded = False  # on this connection's server
    _keeper: threading.Thread | None = None  # re-stamps the held messages (keep_held)

    @cached_property
    def _shared_client(self) -> Any:
        return self._create_client()

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """One client (its pool is thread-safe) instead of a new one per call: building a
        redis-py client costs more than the pipelined write it is made for."""
        yield client or self._shared_client

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Send the pop script over the priority lists in kombu's order (after an empty
        reply, behind a server-side wait); `_brpop_read` reads what it returns."""
        if self.global_keyprefix:
            return super()._brpop_start(timeout)
        if time.monotonic() < self._refused_until:
            return None
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return None
        if not self._script_loaded:
            self._shared_client.script_load(POP_AND_RECORD)
            self._script_loaded = True
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep_held, name="keep-held", daemon=True)
            self._keeper.start()
        keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        # Recorded as popped at the end of the wait the script may run behind: never older
        # than it is, so no restore scan takes a message popped a moment ago.
        popped_at = time.time() + self._idle_wait
        commands = [("EVALSHA", POP_AND_RECORD_SHA, len(keys) + 2, *keys, self.unacked_index_key,
                     self.unacked_key, popped_at, self.qos.pop_limit())]
        if self._idle_wait:
            wait_on = self._q_for_pri(queues[0], redis_priority(None))
            commands.insert(0, ("BLMOVE", wait_on, wait_on, "RIGHT", "RIGHT", self._idle_wait))
        connection = self.client.connection
        self._in_poll, self._brpop_sent_at = connection, time.monotonic()
        self._sent = tuple(command[0] for command in commands)
        connection.send_packed_command(connection.pack_commands(commands))
        return None

    def _brpop_read(self, **options: Any) -> bool:
        """Deliver every message the pop script returned; each is already recorded as
        unacked, so QoS.append does not write it again."""
        if self.global_keyprefix:
            return super()._brpop_read(**options)
        try:
            replies = self._read_replies()
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()  # the connection is idle: the moment kombu uses
        if isinstance(replies[-1], NoScriptError):
            self._script_loaded = False  # a restarted Redis: loaded again before the next pop
            replies[-1] = []
        popped = [] if isinstance(replies[-1], self.ResponseError) else replies[-1]
        self._idle_wait = 0.0 if popped else min(max(2 * self._idle_wait, FIRST_WAIT), self.brpop_timeout)
        self._hold_if_refused(replies)
        if not popped:
            raise Empty()
        self.qos.prerecorded.update(bytes_to_str(tag) for _, _, tag in popped if tag)
        for key, item, tag in popped:
            self._deliver_popped(bytes_to_str(key), item, bytes_to_str(tag))
        return True

    def _read_replies(self) -> list[Any]:
        """The replies to what `_brpop_start` sent, an error reply as its ResponseError."""
        connection, replies = self.client.connection, []
        try:
            for command in self._sent:
                try:
                    replies.append(self.client.parse_response(connection, command))
                except self.ResponseError as error:
                    replies.append(error)
        except self.connection_errors:
            connection.disconnect()  # the next poll reconnects
            raise
        return replies

    def _hold_if_refused(self, replies: list[Any]) -> None:
        """A refused command (a server out of memory refuses the wait and the script, and
        then waits no time at all) holds the next pop back for the idle wait, so it
        cannot spin; the messages stay in their lists meanwhile."""
        refused = [reply for reply in replies if isinstance(reply, self.ResponseError)]
        if refused:
            log.warning("Redis refused the pop, retried in %.2fs: %s", self._idle_wait, refused[0])
            self._refused_until = time.monotonic() + self._idle_wait

    def _deliver_popped(self, key: str, item: bytes, tag: str) -> None:
        """Hand one popped message to its consumer, under the tag the pop script recorded it
        by, once worker.envelope has passed it; one it rejects is acknowledged and
        dead-lettered with the reason, in one transaction."""
        queue = key.rsplit(self.sep, 1)[0]
        try:
            payload = open_envelope(item)
        except Rejected as why:
            log.error("dead-lettered a message of %r: %s", queue, why)
            pipe = self._shared_client.pipeline()  # MULTI/EXEC: kept and released together
            deadletters.add(pipe, queue, f"message rejected: {why}", item)
            if tag:
                self.qos._remove_from_indices(tag, pipe)
            pipe.execute()
            self.qos.prerecorded.discard(tag)
            return
        if tag:
            payload["properties"]["delivery_tag"] = tag
        self._queue_cycle.rotate(queue)
        self.connection._deliver(payload, queue)

    def _keep_held(self) -> None:
        """Every quarter of the visibility timeout, re-stamp the messages this channel holds,
        so kombu's restore, which takes entries older than the timeout, never takes a live
        worker's."""
        interval = max(0.2, self.visibility_timeout / 4)
        while not self.closed and not self._closing.wait(interval):
            self.stamp_held()

    def stamp_held(self) -> None:
        """Stamp the unacked index entries of the messages this channel holds with the time
        now (only those still there: XX)."""
        tags = list(self.qos._delivered)  # copied in one step: the consumer's thread adds to it
        if not tags:
            return
        now = time.time()
        try:
            self._shared_client.zadd(self.unacked_index_key, dict.fromkeys(tags, now), xx=True)
        except self.connection_errors + (self.ResponseError,) as err:
            log.warning("could not re-stamp %d held messages: %s", len(tags), err)

    @cached_property
    def _closing(self) -> threading.Event:
        return threading.Event()

    def close(self) -> None:
        if not self.closed:
            self._closing.set()
            with contextlib.suppress(*self.connection.connection_errors):
                self.qos.flush_acks()  # else redelivered after the visibility timeout
        super().close()


class Transport(redis.Transport):
    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self._flush_acks)

    def _flush_acks(self) -> None:
        for channel in self.channels:
            channel.qos.flush_acks()


def transport_for(broker_url: str) -> str:
    """The transport a worker uses for `broker_url` (`redis://` or `rediss://`: TLS is set up
    from the URL's `ssl_*` parameters by renderfarm.queue.make_app)."""
    if not broker_url.startswith(("redis://", "rediss://")):
        raise ValueError("the worker's broker must be a redis:// or rediss:// URL")
    return f"{__name__}:Transport"
