"""The worker's Redis transport (worker.broker) through real kombu connections against a real
redis-server: what it delivers, what it records as unacked and when, what it costs Redis."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub

from harness.farm import wait_for
from harness.redis_server import RedisServer
from renderfarm import deadletters
from renderfarm.queue import PRIORITY_STEPS, TASK_NAME, redis_priority

TRANSPORT = "worker.broker:Transport"
# As renderfarm.queue configures it, with a short visibility timeout and a restore scan on
# every empty poll (the sync path) so restores show within seconds.
OPTIONS = {"priority_steps": PRIORITY_STEPS, "queue_order_strategy": "priority",
           "visibility_timeout": 1, "unacked_restore_throttle": 1}
QUEUE = Queue("jobs", Exchange("jobs"), "jobs")


@contextmanager
def connect(url: str, transport: str = TRANSPORT, **options: Any) -> Iterator[Connection]:
    with Connection(url, transport=transport, transport_options={**OPTIONS, **options}) as conn:
        yield conn


def publish(url: str, messages: list[tuple[str, int | None]]) -> None:
    """As a producer does: stock kombu, one render-task message per (name, priority); the
    transport's door (worker.envelope) lets only such messages through."""
    with connect(url, transport="redis") as conn:
        producer = conn.Producer()
        for name, priority in messages:
            producer.publish([[], {"name": name}, {}], exchange=QUEUE.exchange, routing_key=QUEUE.routing_key,
                             declare=[QUEUE], priority=priority, serializer="json",
                             headers={"task": TASK_NAME, "id": name})


def name(message: Any) -> str:
    return message.payload[1]["name"]


def queued(r: redis.Redis) -> int:
    return sum(r.llen(key) for key in r.scan_iter(f"{QUEUE.name}*"))


def calls(r: redis.Redis, *commands: str) -> int:
    """Commands Redis has run or refused (a script's own calls count under their names)."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{command}", {}).get(count, 0)
               for command in commands for count in ("calls", "rejected_calls"))


def drain(conn: Connection, until: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.2)
        except socket.timeout:
            pass


def run_hub(hub: Hub, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
    loop, deadline = hub.create_loop(), time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        next(loop)


@contextmanager
def hub_consumer(url: str, on_message: Callable[[Any, Any], None], **options: Any) -> Iterator[Hub]:
    """A consumer on kombu's event loop, as in a Celery worker (whose timer ticks every 50 ms)."""
    with connect(url, **options) as conn, conn.Consumer(QUEUE, callbacks=[on_message]):
        hub = Hub()
        hub.call_repeatedly(0.05, lambda: None)
        conn.register_with_event_loop(hub)
        try:
            yield hub
        finally:
            hub.close()


def test_priority_order_fifo_and_recorded_as_unacked_when_delivered(broker: str, redis_server: RedisServer) -> None:
    r = redis_server.client()
    sent = [(f"m{i}", priority) for i, priority in enumerate([5, 0, 9, 5, 0, None, 9, 4])]
    publish(broker, sent)
    seen = []

    def on_message(body: str, message: Any) -> None:
        record = r.hget("unacked", message.delivery_tag)
        assert record is not None and r.zscore("unacked_index", message.delivery_tag) is not None
        # what kombu's restore reads: the message as it was queued (the door adds Flower's reprs,
        # the pop script this delivery's own tag: the message's own and the pop's time)
        queued_tag, _, pop = message.delivery_tag.partition("#")
        raw = {**message._raw, "headers": {k: v for k, v in message._raw["headers"].items()
                                           if k not in ("argsrepr", "kwargsrepr")},
               "properties": {**message._raw["properties"], "delivery_tag": queued_tag}}
        assert pop and json.loads(record) == [raw, "", "jobs"]  # routed to the queue it was popped from
        seen.append(message)

    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[on_message]) as consumer:
        drain(conn, lambda: len(seen) == len(sent), 5)
        assert [name(m) for m in seen] == [body for body, _ in sorted(sent, key=lambda s: s[1] or 0)]
        for message in seen[:5]:
            message.ack()
        consumer.channel.qos.flush_acks()
        assert set(r.hkeys("unacked")) == {m.delivery_tag.encode() for m in seen[5:]}
        assert r.zcard("unacked_index") == 3
        assert consumer.channel.qos.prerecorded == set()


def test_many_messages_in_one_round_trip_within_the_prefetch(broker: str, redis_server: RedisServer) -> None:
    r = redis_server.client()
    publish(broker, [(f"m{i}", i % 3) for i in range(40)])
    received: list[Any] = []
    acking = False

    def on_message(_: str, message: Any) -> None:
        received.append(message)
        if acking:
            message.ack()

    before = calls(r, "evalsha", "brpop", "hset")
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[on_message], prefetch_count=16):
        conn.drain_events(timeout=2)
        assert len(received) == 16 and queued(r) == 24  # one reply, as many as the prefetch allows
        # one EVALSHA, each message recorded once (by the script; QoS.append does not write again)
        assert calls(r, "evalsha", "brpop", "hset") - before == 1 + 16
        for message in received:
            message.ack()
        acking = True
        drain(conn, lambda: len(received) == 40, 5)
    assert len(received) == 40


def test_popped_by_a_consumer_killed_before_it_reads_the_reply_comes_back(broker: str,
                                                                          redis_server: RedisServer) -> None:
    """The gap stock kombu has: a consumer killed with popped messages still in its socket."""
    r = redis_server.client()
    publish(broker, [(f"m{i}", None) for i in range(5)])
    victim = textwrap.dedent(f"""
        import os, signal, time
        import redis
        from kombu import Connection, Exchange, Queue
        r = redis.Redis(port={redis_server.port})
        queue = Queue({QUEUE.name!r}, Exchange({QUEUE.exchange.name!r}), {QUEUE.routing_key!r})
        with Connection({broker!r}, transport={TRANSPORT!r}, transport_options={OPTIONS!r}) as conn:
            with conn.Consumer(queue, callbacks=[]) as consumer:
                conn.transport.cycle._register_BRPOP(consumer.channel)  # sends the pop; never read
                while sum(r.llen(k) for k in r.scan_iter("jobs*")):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert subprocess.run([sys.executable, "-c", victim], timeout=60).returncode == -9
    assert queued(r) == 0 and r.hlen("unacked") == 5
    received: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]) as consumer:
        drain(conn, lambda: len(received) == 5, 10)  # after the visibility timeout (1 s)
        assert sorted(name(m) for m in received) == [f"m{i}" for i in range(5)]
        assert all(m.delivery_info["redelivered"] for m in received)
        for message in received:
            message.ack()
        consumer.channel.qos.flush_acks()
    assert r.hlen("unacked") == r.zcard("unacked_index") == 0


def test_rejected_message_is_requeued_and_delivered_again(broker: str, redis_server: RedisServer) -> None:
    publish(broker, [("again", None)])
    received: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]):
        drain(conn, lambda: len(received) == 1, 5)
        received[0].reject(requeue=True)
        drain(conn, lambda: len(received) == 2, 5)
    assert [name(m) for m in received] == ["again", "again"]
    assert received[1].delivery_info["redelivered"]


@pytest.mark.parametrize("prefix", ["", "pfx:"], ids=["popped-by-the-script", "global-key-prefix"])
@pytest.mark.parametrize("back", ["rejected", "restored"])
@pytest.mark.parametrize("named", [{"exchange": "", "routing_key": "nowhere"},
                                   {"exchange": "elsewhere", "routing_key": "nowhere"}],
                         ids=["another-routing-key", "another-exchange"])
def test_a_message_put_back_returns_to_the_queue_it_was_taken_from(
        broker: str, redis_server: RedisServer, named: dict[str, str], back: str, prefix: str) -> None:
    """A message may name any exchange and routing key: rejected with requeue, or restored
    (here by its consumer's close, as by the visibility timeout's scan), it goes back on the
    queue it was popped from, not to a list its route names (a new key no worker consumes) or
    nowhere (an exchange with no binding)."""
    r = redis_server.client()
    received: list[Any] = []
    with connect(broker, global_keyprefix=prefix) as conn, \
            conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]) as consumer:
        conn.Producer().publish([[], {"name": "routed"}, {}], exchange=QUEUE.exchange, routing_key=QUEUE.routing_key,
                                serializer="json", headers={"task": TASK_NAME, "id": "routed"})
        [key] = r.keys(f"{prefix}{QUEUE.name}*")
        payload = json.loads(r.lindex(key, 0))
        payload["properties"]["delivery_info"].update(named)
        r.lset(key, 0, json.dumps(payload))
        before = set(r.keys())
        drain(conn, lambda: len(received) == 1, 5)
        assert received[0].delivery_info["routing_key"] == "nowhere" and r.llen(key) == 0
        if back == "rejected":
            received[0].reject(requeue=True)
        else:
            consumer.channel.qos.restore_unacked()
        assert json.loads(r.lindex(key, 0))["headers"]["id"] == "routed"
        assert set(r.keys()) == before and r.llen(key) == 1 and r.hlen(f"{prefix}unacked") == 0


def publish_with_tag(url: str, r: redis.Redis, message: str, tag: str) -> None:
    """A render-task message whose delivery tag is `tag`: a producer chooses its own (stock kombu
    records a message under it)."""
    publish(url, [(message, None)])
    key = next(k for k in r.scan_iter(f"{QUEUE.name}*") if r.type(k) == b"list" and r.llen(k))
    payload = json.loads(r.lindex(key, 0))
    payload["properties"]["delivery_tag"] = tag
    r.lset(key, 0, json.dumps(payload))


def test_a_lost_connection_puts_back_nothing_the_worker_still_holds(broker: str, redis_server: RedisServer) -> None:
    """Stock kombu, closing a channel (as Celery does when its connection to Redis is lost),
    pushes every message it delivered and the application has not settled back onto the queue,
    where another worker takes what this one is still rendering. Here they stay recorded as
    held: the worker settles them, or they come back after the visibility timeout if it died."""
    r = redis_server.client()
    publish(broker, [("m0", None), ("m1", None)])
    held: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: held.append(m)]):
        drain(conn, lambda: len(held) == 2, 5)
        conn.default_channel.close()  # what a lost connection's clean-up does
        assert queued(r) == 0 and r.hlen("unacked") == 2
        for message in held:  # settled through the closed channel: straight to Redis
            message.ack()
        assert r.hlen("unacked") == r.zcard("unacked_index") == 0


def test_messages_popped_and_not_handed_over_yet_are_kept_fresh(broker: str, redis_server: RedisServer) -> None:
    """The consumer handles a pop's messages one after another, and one may hold it up for
    longer than the visibility timeout (a full bundle waiting for the store threads): the rest
    of that pop, recorded as taken but not delivered yet, are stamped too, so another worker's
    restore scan takes none of them."""
    r = redis_server.client()
    publish(broker, [(f"m{i}", None) for i in range(4)])
    held: list[Any] = []

    def slow(_: Any, message: Any) -> None:
        held.append(message)
        if len(held) == 1:
            time.sleep(3)  # three visibility timeouts, the other three messages popped with this one

    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[slow]):
        holder = threading.Thread(target=drain, args=(conn, lambda: len(held) == 4, 10))
        holder.start()
        wait_for(lambda: len(held) == 1, 5, "the first delivery")
        restored: list[Any] = []
        with connect(broker) as other, other.Consumer(QUEUE, callbacks=[lambda _, m: restored.append(m)]):
            drain(other, lambda: False, 2.5)  # its restore scans run on every empty poll
        holder.join()
        assert restored == [] and len(held) == 4 and r.hlen("unacked") == 4


def test_a_late_settle_of_a_message_delivered_again_leaves_its_new_holder_alone(
        broker: str, redis_server: RedisServer) -> None:
    """A worker whose message a restore took (its keeper late, its connection lost) may still
    settle it after another worker got it again: its acknowledgement or requeue finds no record
    of its own delivery, and neither drops the new holder's record nor pushes a second copy."""
    r = redis_server.client()
    publish(broker, [("m0", None), ("m1", None)])
    first: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: first.append(m)]) as consumer:
        drain(conn, lambda: len(first) == 2, 5)
        consumer.channel._stop_keeping.set()  # its keeper stops: the messages age past the timeout
        consumer.channel._keeper.join(5)
        again: list[Any] = []
        with connect(broker) as other, other.Consumer(QUEUE, callbacks=[lambda _, m: again.append(m)]) as second:
            drain(other, lambda: len(again) == 2, 10)  # restored by its scan, and delivered again
            assert sorted(name(m) for m in again) == ["m0", "m1"]
            late_ack, late_requeue = sorted(first, key=name)
            late_ack.ack()
            consumer.channel.qos.flush_acks()
            late_requeue.reject(requeue=True)
            assert queued(r) == 0  # no second copy
            assert set(r.hkeys("unacked")) == {m.delivery_tag.encode() for m in again}  # their records kept
            for message in again:
                message.ack()
            second.channel.qos.flush_acks()
    assert r.hlen("unacked") == r.zcard("unacked_index") == queued(r) == 0


@pytest.mark.parametrize("pops", ["in one pop", "one held, the others popped later"])
def test_messages_with_the_same_delivery_tag_are_held_acked_and_restored_apart(
        broker: str, redis_server: RedisServer, pops: str) -> None:
    """A pushed message may carry the tag of one held unacked: each delivery is recorded under a
    tag of its own, so none overwrites another's record, and each is acked or put back alone;
    a message put back and delivered again has another tag than its first delivery."""
    r = redis_server.client()
    received: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]) as consumer:
        publish_with_tag(broker, r, "a", "same")
        if pops != "in one pop":
            drain(conn, lambda: len(received) == 1, 5)
        publish_with_tag(broker, r, "b", "same")
        publish_with_tag(broker, r, "c", "same")
        drain(conn, lambda: len(received) == 3, 5)
        a, b, c = sorted(received, key=name)
        assert [name(m) for m in (a, b, c)] == ["a", "b", "c"] and queued(r) == 0
        assert all(m.delivery_tag.startswith("same#") for m in (a, b, c))
        assert len({a.delivery_tag, b.delivery_tag, c.delivery_tag}) == 3
        for message in (a, b, c):  # each recorded under its own tag: the message as it was queued
            record = json.loads(r.hget("unacked", message.delivery_tag))
            assert record[0]["properties"]["delivery_tag"] == "same" and record[0]["headers"]["id"] == name(message)
            assert r.zscore("unacked_index", message.delivery_tag) is not None
        assert r.hlen("unacked") == r.zcard("unacked_index") == 3
        a.ack()
        c.ack()
        consumer.channel.qos.flush_acks()
        assert r.hkeys("unacked") == [b.delivery_tag.encode()]
        b.reject(requeue=True)
        assert r.hlen("unacked") == 0 and queued(r) == 1
        drain(conn, lambda: len(received) == 4, 5)
        again = received[3]
        assert name(again) == "b" and again.delivery_info["redelivered"]
        assert again.delivery_tag.startswith("same#") and again.delivery_tag != b.delivery_tag
        again.ack()
        consumer.channel.qos.flush_acks()
    assert r.hlen("unacked") == r.zcard("unacked_index") == queued(r) == 0


def test_items_that_are_not_job_messages_are_dead_lettered_and_the_rest_delivered(
        broker: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    r = redis_server.client()
    publish(broker, [("first", None)])
    # garbage, no delivery tag, one only Lua's JSON decoder accepts (hex): recorded, then released,
    # and a kombu message that is not a render task
    lenient = ('{"properties": {"delivery_tag": "hex", "delivery_info": {"exchange": "jobs", "routing_key": "jobs"}},'
               ' "x": 0x10}')
    r.lpush(QUEUE.name, b'{"not json', b'{"properties": {}}', lenient)
    with connect(broker, transport="redis") as conn:
        conn.Producer().publish("plain text", exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
    publish(broker, [("last", None)])
    received: list[Any] = []
    with caplog.at_level(logging.ERROR, "worker.broker"), connect(broker) as conn, \
            conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]):
        drain(conn, lambda: len(received) == 2, 5)
        assert [name(m) for m in received] == ["first", "last"]
        assert queued(r) == 0
        assert set(r.hkeys("unacked")) == {m.delivery_tag.encode() for m in received}
        assert r.zscore("unacked_index", "hex") is None
    assert sum("dead-lettered" in record.message for record in caplog.records) == 4
    letters = deadletters.DeadLetters(r).entries(QUEUE.name)
    assert len(letters) == 4 and all(letter["reason"].startswith("message rejected: ") for letter in letters)
    assert deadletters.DeadLetters(r).counts() == {QUEUE.name: {"total": 4, "kept": 4}}


def test_idle_consumer_waits_in_redis_and_wakes_for_a_job(broker: str, redis_server: RedisServer) -> None:
    r = redis_server.client()
    received: list[tuple[float, str]] = []
    with hub_consumer(broker, lambda _, m: (received.append((time.monotonic(), name(m))), m.ack())) as hub:
        run_hub(hub, 3)  # the waits grow to 1 s
        before = calls(r, "evalsha", "blmove", "brpop")
        run_hub(hub, 4)
        assert calls(r, "evalsha", "blmove", "brpop") - before <= 10  # a wait and a pop a second
        # A job on the waited list wakes the wait (the waits are 1 s long by now); one of another
        # priority is seen when the wait ends. Bounds with room for a loaded machine.
        for priority, latency in ((redis_priority(None), 0.5), (0, 2.5)):
            sent = time.monotonic()
            publish(broker, [(f"p{priority}", priority)])
            run_hub(hub, 3, until=lambda p=priority: bool(received) and received[-1][1] == f"p{p}")
            assert received[-1][1] == f"p{priority}" and received[-1][0] - sent < latency
            run_hub(hub, 2.5)


def test_a_server_out_of_memory_keeps_the_messages_queued_and_is_not_hammered(
        broker: str, redis_server: RedisServer) -> None:
    r = redis_server.client()
    publish(broker, [(f"m{i}", None) for i in range(3)])
    received: list[Any] = []
    with hub_consumer(broker, lambda _, m: received.append(m), unacked_restore_interval=60) as hub:
        r.config_set("maxmemory", 1)
        try:
            before = calls(r, "evalsha", "blmove")
            run_hub(hub, 3)
            assert received == [] and queued(r) == 3
            assert 1 <= calls(r, "evalsha", "blmove") - before <= 20  # refused at once, retried after a wait
        finally:
            r.config_set("maxmemory", 0)
        run_hub(hub, 3, until=lambda: len(received) == 3)
    assert len(received) == 3


def test_with_a_global_key_prefix_it_consumes_as_stock_kombu(broker: str, redis_server: RedisServer) -> None:
    r = redis_server.client()
    received: list[Any] = []
    with connect(broker, global_keyprefix="pfx:") as conn, \
            conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]):
        conn.Producer().publish("hello", exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        evals, brpops = calls(r, "evalsha"), calls(r, "brpop")
        drain(conn, lambda: bool(received), 5)
        assert [m.payload for m in received] == ["hello"]
        assert r.hexists("pfx:unacked", received[0].delivery_tag)
        assert calls(r, "evalsha") == evals and calls(r, "brpop") > brpops


def test_the_pop_script_is_loaded_again_after_a_restart_forgets_it(broker: str, redis_server: RedisServer) -> None:
    """The script goes as EVALSHA; a Redis that restarted (here: SCRIPT FLUSH) answers
    NOSCRIPT, and the next pop loads it again instead of failing."""
    r = redis_server.client()
    received: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: received.append(m)]):
        publish(broker, [("before", None)])
        drain(conn, lambda: len(received) == 1, 5)
        r.script_flush()
        publish(broker, [("after", None)])
        drain(conn, lambda: len(received) == 2, 5)
    assert [name(m) for m in received] == ["before", "after"]
    assert calls(r, "evalsha") >= 2


def test_held_messages_are_kept_fresh_and_a_dead_consumers_come_back(broker: str, redis_server: RedisServer) -> None:
    """A consumer that holds messages past the visibility timeout (a long batch, a compile)
    keeps them: its channel re-stamps their unacked entries. Once it is gone, they age and
    come back."""
    r = redis_server.client()
    publish(broker, [(f"m{i}", None) for i in range(3)])
    held: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: held.append(m)]) as consumer:
        drain(conn, lambda: len(held) == 3, 5)
        stamped = {tag: r.zscore("unacked_index", tag) for tag in (m.delivery_tag for m in held)}
        with connect(broker) as other, other.Consumer(QUEUE, callbacks=[lambda _, m: held.append(m)]):
            drain(other, lambda: False, 3)  # three visibility timeouts: its restore scans run
        assert len(held) == 3 and queued(r) == 0  # nothing restored while they are held
        assert all(r.zscore("unacked_index", tag) > score for tag, score in stamped.items())
        consumer.channel._stop_keeping.set()  # as if the holder died: no more stamps
        consumer.channel._keeper.join(5)
        assert not consumer.channel._keeper.is_alive()
        returned: list[Any] = []
        with connect(broker) as other, other.Consumer(QUEUE, callbacks=[lambda _, m: returned.append(m)]):
            drain(other, lambda: len(returned) == 3, 10)
        assert sorted(name(m) for m in returned) == ["m0", "m1", "m2"]


def test_a_consumer_whose_keeper_ran_late_does_not_restore_what_it_holds(broker: str,
                                                                          redis_server: RedisServer) -> None:
    """A paused process wakes with its held messages past the visibility timeout; its own
    restore scan, which may run before the keeper thread does, stamps them first."""
    r = redis_server.client()
    publish(broker, [(f"m{i}", None) for i in range(3)])
    held: list[Any] = []
    with connect(broker) as conn, conn.Consumer(QUEUE, callbacks=[lambda _, m: held.append(m)]) as consumer:
        drain(conn, lambda: len(held) == 3, 5)
        consumer.channel._stop_keeping.set()  # the keeper stops: it is late from here on
        consumer.channel._keeper.join(5)
        time.sleep(1.5)  # past the visibility timeout (1 s)
        drain(conn, lambda: False, 2)  # its restore scans run on every empty poll
        assert len(held) == 3 and queued(r) == 0 and r.hlen("unacked") == 3


def test_a_message_popped_after_a_wait_is_recorded_no_older_than_it_is(broker: str,
                                                                      redis_server: RedisServer) -> None:
    """The pop script runs behind a server-side wait of up to a second: the message it pops is
    recorded as popped at the wait's end, not when the wait was sent, so a restore scan
    (another worker's) cannot take a message popped a moment ago. A long visibility timeout
    keeps the keeper from re-stamping it."""
    r = redis_server.client()
    stamps: list[float] = []

    def on_message(_: Any, message: Any) -> None:
        stamps.append(r.zscore("unacked_index", message.delivery_tag))

    with hub_consumer(broker, on_message, visibility_timeout=3600) as hub:
        run_hub(hub, 3)  # the waits grow to 1 s
        published = time.time()
        publish(broker, [("m", None)])
        run_hub(hub, 3, until=lambda: bool(stamps))
    assert stamps and stamps[0] >= published


def test_the_kombu_internals_the_transport_extends_are_those_it_was_written_for() -> None:
    """worker.broker overrides and calls kombu's Redis transport internals. kombu is pinned to
    the minor version they were read from; this fails loudly, naming what changed, if an
    upgrade moves any of them."""
    import inspect

    import kombu
    from kombu.asynchronous import Hub
    from kombu.transport import redis as kredis
    from kombu.transport import virtual

    assert kombu.VERSION[:2] == (5, 7), f"kombu {kombu.__version__}: re-read worker/broker.py against it"
    needed = {
        kredis.Channel: ["_brpop_start", "_brpop_read", "_q_for_pri", "_create_client", "conn_or_acquire",
                         "_flush_brpop_reauth", "close"],
        kredis.Transport: ["_deliver", "register_with_event_loop"],
        kredis.QoS: ["append", "ack", "reject", "pipe_or_acquire", "_remove_from_indices", "restore_by_tag",
                     "can_consume_max_estimate", "restore_visible"],
        virtual.QoS: ["append", "ack"],
        Hub: ["_pop_ready"],
    }
    for cls, names in needed.items():
        missing = [n for n in names if not callable(getattr(cls, n, None))]
        assert not missing, f"kombu {cls.__qualname__} lost {missing}"
    assert list(inspect.signature(kredis.Channel._brpop_start).parameters) == ["self", "timeout"]
    assert list(inspect.signature(kredis.QoS._remove_from_indices).parameters) == ["self", "delivery_tag", "pipe"]
    assert list(inspect.signature(kredis.QoS.append).parameters) == ["self", "message", "delivery_tag"]
    assert list(inspect.signature(kredis.Transport._deliver).parameters) == ["self", "message", "queue"]
    assert list(inspect.signature(kredis.QoS.restore_visible).parameters) == ["self", "start", "num", "interval"]
    attributes = ["unacked_key", "unacked_index_key", "priority_steps", "sep", "visibility_timeout",
                  "global_keyprefix"]
    assert all(hasattr(kredis.Channel, a) for a in attributes), attributes
    assert kredis.Channel.sep == "\x06\x16"  # renderfarm.queue.PRIORITY_SEP
    assert "_delivered" in inspect.getsource(virtual.QoS.__init__)
    source = inspect.getsource(kredis.Channel)
    assert all(f"self.{a}" in source for a in ("_brpop_sent_at", "_in_poll", "brpop_timeout", "_queue_cycle"))


def test_priority_lists_are_named_as_kombu_names_them(broker: str) -> None:
    from renderfarm.queue import priority_list, priority_lists

    with connect(broker) as conn:
        channel = conn.default_channel
        assert [channel._q_for_pri("q", step) for step in PRIORITY_STEPS] == priority_lists("q")
        assert priority_list("q", 0) == "q"
