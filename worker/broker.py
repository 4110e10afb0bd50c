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
  restored, and a message restored and delivered again has the tag of its last delivery, whose
  late acknowledgement (or requeue) would drop (or push a second copy of) the new holder's.
  The pop script gives every delivery a tag of its own (`TAG#TIME.N`) and the message is
  delivered with it, so every held message has a record of its own, acknowledged or restored
  on its own, and only by its holder.
- Routes: stock kombu records a message with the exchange and routing key it names, and its
  restore (the visibility timeout's scan, a close, `reject(requeue=True)`) pushes it to the
  list those name: a message naming a new routing key would land on a list no worker
  consumes (a new Redis key per message), one naming an exchange with no binding nowhere.
  Here every record is routed to the queue the message was taken from (exchange '',
  routing key the queue), by the pop script and by QoS.append alike.
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
- A lost connection puts back nothing: stock kombu, closing the channel, puts back every
  message it delivered and the application has not settled, which the worker is still
  rendering; they would be delivered again at once and rendered twice. The worker keeps
  them: a keeper of its own (HeldKeeper) stamps every message the worker took and has not
  settled, on whichever connection it came, and so does each channel's restore scan before it
  runs (the transport option `held_tags`); an acknowledgement of a closed channel's message goes
  straight to Redis. Each delivery has a tag of its own (the pop script's), so a late
  acknowledgement or requeue of a message since restored and delivered again never touches
  its new holder's record.
- One redis-py client serves the channel's bookkeeping; stock kombu builds one per call.
- Behind Sentinel (`sentinel://` URLs, renderfarm/connections.py) the same channel runs on
  kombu's Sentinel connections (SentinelChannel/SentinelTransport): every connection asks the
  sentinels for the current master, so after a failover the pops, records and acks go to the
  promoted replica. That server may not hold the pop script: its NOSCRIPT reply loads it
  again before the next pop, as after a restart.

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
from collections.abc import Callable, Iterator
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


HELD_OPTION = "held_tags"  # transport option: a callable giving the tags the application still holds


class QoS(redis.QoS):
    # kombu puts back every message a channel delivered and the application has not settled
    # when the channel closes, as it does when a connection to Redis is lost: the worker, which
    # goes on rendering them, would find them delivered again at once (to itself or another
    # worker) and rendered twice. A lost connection puts back nothing: the worker keeps what it
    # holds (stamped whatever the connection, HeldKeeper) and settles it; a dead worker's messages
    # come back after the visibility timeout, a stopping worker's through its drain (HeldKeeper).
    restore_at_shutdown = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []
        self.prerecorded: set[str] = set()  # tags the pop script recorded, not yet appended

    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's record of a delivered message, unless the pop script wrote it already;
        in a plain pipeline: MULTI/EXEC buys nothing here (the restore scan only takes
        entries older than the visibility timeout, never one being written). Routed, as the
        pop script routes its records, to the queue the message was delivered from, not to
        the exchange and routing key it names (kombu's restore would put it on their list,
        one no worker may consume); a message taken without a delivery (`basic_get`) keeps
        kombu's route."""
        if delivery_tag in self.prerecorded:
            self.prerecorded.discard(delivery_tag)
        else:
            queue = self.channel.connection.delivering_from
            delivery = message.delivery_info
            route = ["", queue] if queue is not None else [delivery["exchange"], delivery["routing_key"]]
            record = dumps([message._raw, *route])
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
        if self.channel.closed:  # a message of a connection since lost: no tick flushes this channel
            self._remove_from_indices(delivery_tag, self.channel._shared_client.pipeline(transaction=False)).execute()
        else:
            self._acked.append(delivery_tag)  # Redis on the next flush
        virtual.QoS.ack(self, delivery_tag)

    def restore_visible(self, start: int = 0, num: int | None = 10, interval: int = 10) -> None:
        """kombu's restore scan, once the messages this worker holds are stamped: a worker
        never restores what it holds, even when a keeper thread ran late (the process was
        paused, a message was popped since the last stamp, the connection was made again)."""
        self.channel.stamp_held(everything=True)
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
        lists = [(self._q_for_pri(queue, pri), queue) for pri in self.priority_steps for queue in queues]
        keys, of_queue = [name for name, _ in lists], [queue for _, queue in lists]
        # Recorded as popped at the end of the wait the script may run behind: never older
        # than it is, so no restore scan takes a message popped a moment ago.
        popped_at = time.time() + self._idle_wait
        commands = [("EVALSHA", POP_AND_RECORD_SHA, len(keys) + 2, *keys, self.unacked_index_key,
                     self.unacked_key, popped_at, self.qos.pop_limit(), *of_queue)]
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
        while not self.closed and not self._stop_keeping.wait(interval):
            self.stamp_held()

    def stamp_held(self, everything: bool = False) -> None:
        """Stamp the unacked index entries of the messages this channel holds with the time
        now (only those still there: XX): those delivered, and those popped and not delivered
        yet (the consumer handles a pop's messages one after another, and one may hold it up:
        a bundle that waits for the store threads). With `everything` (before a restore scan),
        also those the application says it holds (HELD_OPTION: delivered on an earlier
        connection too, which HeldKeeper keeps fresh between scans), so that the scan takes
        none of them."""
        # each copied in one step: the consumer's thread adds to them
        tags = [*self.qos._delivered, *self.qos.prerecorded.copy()]
        held = self.connection.client.transport_options.get(HELD_OPTION) if everything else None
        if held is not None:
            tags = list(dict.fromkeys([*tags, *held()]))
        if not tags:
            return
        now = time.time()
        try:
            self._shared_client.zadd(self.unacked_index_key, dict.fromkeys(tags, now), xx=True)
        except self.connection_errors + (self.ResponseError,) as err:
            log.warning("could not re-stamp %d held messages: %s", len(tags), err)

    @cached_property
    def _stop_keeping(self) -> threading.Event:
        """Set by close. Not kombu's `_closing`, a flag its close sets before it may fail
        (a broker gone): a close tried again would find a bool there."""
        return threading.Event()

    def close(self) -> None:
        if not self.closed:
            self._stop_keeping.set()
            with contextlib.suppress(*self.connection.connection_errors):
                self.qos.flush_acks()  # else redelivered after the visibility timeout
        super().close()


class Transport(redis.Transport):
    Channel = Channel

    delivering_from: str | None = None  # the queue of the message being handed to its consumer

    def _deliver(self, message: Any, queue: str) -> None:
        """Hand a message to its queue's consumer, which records it (QoS.append) as taken
        from that queue: both ways of popping (the pop script's, and stock kombu's BRPOP with
        a `global_keyprefix`) deliver through here."""
        self.delivering_from = queue
        try:
            super()._deliver(message, queue)
        finally:
            self.delivering_from = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self._flush_acks)

    def _flush_acks(self) -> None:
        for channel in self.channels:
            channel.qos.flush_acks()


class SentinelChannel(Channel, redis.SentinelChannel):
    """The farm's channel on kombu's Sentinel connections: kombu's SentinelChannel builds the
    pools (each connection to the master the sentinels name at that moment), the farm's
    Channel does everything else."""


class SentinelTransport(Transport, redis.SentinelTransport):
    Channel = SentinelChannel


class HeldKeeper:
    """Stamps the unacked index entries of every message the application holds (`held`: their
    delivery tags) every quarter of the visibility timeout, on a Redis client and a thread of
    its own: a channel's keeper ends with its connection, and until the next connection's keeper
    runs, another worker's restore scan could take what this one is still rendering."""

    def __init__(self, client: Any, held: Callable[[], list[str]], visibility_timeout: float,
                 index: str = redis.Channel.unacked_index_key) -> None:
        self.client, self.held, self.index = client, held, index
        self.interval = max(0.2, visibility_timeout / 4)
        threading.Thread(target=self._keep, name="keep-held-jobs", daemon=True).start()  # for the process's life

    def _keep(self) -> None:
        while True:
            time.sleep(self.interval)
            tags = self.held()
            if not tags:
                continue
            try:
                self.client.zadd(self.index, dict.fromkeys(tags, time.time()), xx=True)
            except Exception as err:  # noqa: BLE001 - Redis away: the next round tries again
                log.warning("could not re-stamp %d held jobs: %s", len(tags), err)


def transport_for(broker_url: str) -> str:
    """The transport a worker uses for `broker_url`: `redis://` or `rediss://` (TLS is set up
    from the URL's `ssl_*` parameters by renderfarm.queue.make_app), or `sentinel://`."""
    if broker_url.startswith("sentinel://"):
        return f"{__name__}:SentinelTransport"
    if not broker_url.startswith(("redis://", "rediss://")):
        raise ValueError("the worker's broker must be a redis://, rediss:// or sentinel:// URL")
    return f"{__name__}:Transport"
