"""kombu's Redis transport, with less Redis work per message for a worker that acks in batches.

- Acks: stock kombu removes each acked message from the unacked index in its own round
  trip; a worker acks a stored batch together, so here they go in one pipeline per
  event-loop tick. A worker that dies between an ack and the flush leaves those messages
  unacked; they are delivered again after the visibility timeout and the worker that gets
  them finds their results stored (at least once, as before).
- Deliveries are recorded in the unacked index without MULTI/EXEC.
- One redis-py client serves the channel's bookkeeping; stock kombu builds one per call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from kombu.transport import redis, virtual
from kombu.utils.json import dumps


class QoS(redis.QoS):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []

    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's record of a delivered message, in a plain pipeline: MULTI/EXEC buys
        nothing here (the restore scan only takes entries older than the visibility
        timeout, never one being written)."""
        delivery = message.delivery_info
        self.channel._shared_client.pipeline(transaction=False) \
            .zadd(self.unacked_index_key, {delivery_tag: time.time()}) \
            .hset(self.unacked_key, delivery_tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]])) \
            .execute()
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # bookkeeping only; Redis on the next flush

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

    @cached_property
    def _shared_client(self) -> Any:
        return self._create_client()

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """One client (its pool is thread-safe) instead of a new one per call: building a
        redis-py client costs more than the pipelined write it is made for."""
        yield client or self._shared_client

    def close(self) -> None:
        if not self.closed:
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


def transport_for(broker_url: str) -> str | None:
    """The transport a worker uses for `broker_url`: this one for plain `redis://`; for
    `rediss://` kombu's own, which also sets up TLS from the URL."""
    return f"{__name__}:Transport" if broker_url.startswith("redis://") else None
