"""kombu's Redis transport with acknowledgements written in batches, on one client.

Stock kombu removes each acked message from the unacked index in its own Redis round
trip, on a redis-py client built for that call; a worker that stores a batch of jobs acks
them together, so here they go to Redis in one pipeline per event-loop tick. A worker that dies between the ack and the flush
leaves those messages in the unacked index; they are redelivered after the visibility
timeout and the worker that gets them finds their results stored (at-least-once, as
before).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from kombu.transport import redis, virtual


class QoS(redis.QoS):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []

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
