"""The broker URL (RENDERFARM_BROKER_URL, --broker) read in one place, into what each part that
talks to Redis is given: a redis-py client of the current master, Celery's broker and result
backend settings, and redbeat's. For a single Redis (`redis://`, `rediss://`) the URL goes to
each as it is; a Redis behind Sentinel is named by its sentinels and its master's name:

    sentinel://:PASSWORD@s1:26379;sentinel://s2:26379;sentinel://s3:26379/0?master_name=renderfarm

kombu's form (`;` between the sentinels, port 26379 by default), with the name the sentinels
monitor the master by in the query. The password (and a user name) and the database are the
master's, given on any one sentinel's part or on several that agree; the sentinels themselves
are asked without a password. Every part asks the sentinels for the master again when its
connection fails or the server it reaches answers READONLY (a primary demoted since), so a
failover moves the whole farm to the promoted replica (docs/operations.md, "Behind Sentinel").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from renderfarm.errors import JobError
from renderfarm.settings import redacted

SCHEME = "sentinel://"
SENTINEL_PORT = 26379
# How the sentinels are asked, by every client (redis-py, kombu, Celery's backend, redbeat and
# Flower, whose asyncio client takes the same keys): a sentinel that is down or does not answer
# within 2 s is passed over for the next at once (`retry=None`: no retry; redis-py's default
# retries a refused connection ten times, about 4 s, before asking the next sentinel).
SENTINEL_KWARGS: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0, "retry": None}


@dataclasses.dataclass(frozen=True)
class Sentinels:
    """A Redis behind Sentinel: the sentinels' addresses, the master's name, database and
    credentials."""

    hosts: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        """The URL kombu and Celery's backend read: every sentinel, the credentials and database
        on the first one (the one both take them from), no query (both would pass its keys to
        redis-py as connection arguments)."""
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        elif self.username is not None:
            auth = f"{quote(self.username, safe='')}@"
        return ";".join(f"{SCHEME}{auth if n == 0 else ''}{host}:{port}/{self.db}"
                        for n, (host, port) in enumerate(self.hosts))

    @property
    def options(self) -> dict[str, Any]:
        """What kombu's Sentinel transport and Celery's Sentinel backend need beside the URL."""
        return {"master_name": self.master, "sentinel_kwargs": dict(SENTINEL_KWARGS)}

    def client(self, **options: Any) -> redis.Redis:
        """A client of the current master (redis_client says how it follows a failover)."""
        return Sentinel(self.hosts, sentinel_kwargs=dict(SENTINEL_KWARGS)).master_for(
            self.master, db=self.db, username=self.username, password=self.password, **options)


def sentinels_of(url: str) -> Sentinels | None:
    """The Sentinel set a `sentinel://` broker URL names (None for any other URL); a URL that
    does not name its master, or whose parts disagree, is refused with the rule it breaks (the
    URL shown without its password)."""
    if not url.startswith(SCHEME):
        return None
    hosts, found, query = [], {}, {}

    def refuse(rule: str) -> JobError:
        return JobError("broker", redacted(url), rule)

    for part in url.split(";"):
        if not part.startswith(SCHEME):
            raise refuse("each of a Sentinel URL's parts is sentinel://HOST[:PORT], separated by ';'")
        parts = urlsplit(part)
        try:
            port = parts.port or SENTINEL_PORT
        except ValueError:
            raise refuse("a sentinel's port must be a number") from None
        if not parts.hostname:
            raise refuse("each sentinel needs a host")
        hosts.append((parts.hostname, port))
        given = {"username": parts.username or None, "password": parts.password, "db": parts.path.strip("/") or None}
        for name, value in given.items():
            if value is not None and found.setdefault(name, unquote(value)) != unquote(value):
                raise refuse(f"the sentinels' parts give different {name}s: give it once")
        for name, values in parse_qs(parts.query).items():
            if query.setdefault(name, values[-1]) != values[-1]:
                raise refuse(f"the sentinels' parts give different {name}s: give it once")
    unknown = sorted(set(query) - {"master_name"})
    if unknown:
        raise refuse(f"a Sentinel URL's query takes master_name only, not {', '.join(unknown)}")
    if not query.get("master_name"):
        raise refuse("a Sentinel URL names the master its sentinels monitor: ...?master_name=NAME")
    db = found.get("db", "0")
    if not db.isdigit():
        raise refuse("the database is a number: sentinel://HOST:PORT/DB")
    return Sentinels(tuple(hosts), query["master_name"], int(db), found.get("username"), found.get("password"))


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A redis-py client of the broker's Redis (`options` as redis-py takes them). Behind
    Sentinel, of its current master: redis-py's SentinelConnectionPool asks the sentinels for
    the master's address at each new connection, drops its idle connections once the address
    changed, and turns a READONLY reply (a demoted primary) into a connection error, so the
    command's retry, or the next command, reaches the promoted replica."""
    sentinels = sentinels_of(url)
    return redis.Redis.from_url(url, **options) if sentinels is None else sentinels.client(**options)


class _StayPut:
    """kombu's failover strategy for a Sentinel URL: its `;` alternates are the sentinels, which
    kombu's Sentinel channel asks all of at each connection, not brokers to move on to. Moving
    on (kombu does it at every failed connection) would re-read the transport from the next
    part's scheme, so a worker would go on with kombu's stock Sentinel transport, not its own
    (worker/broker.py), and take the password and database from a part that may not carry
    them. kombu moves on only while its cycle is true; this one never is."""

    def __init__(self, urls: list[str]) -> None:
        self.first = urls[0]

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return self.first

    def __bool__(self) -> bool:
        return False


def celery_settings(url: str) -> dict[str, Any]:
    """The Celery settings that point an app at the broker URL: its broker and result backend
    URLs, the transport options both add to the farm's own (for Sentinel, the master's name
    and how to ask the sentinels), and, for Sentinel, the failover strategy that stays put."""
    sentinels = sentinels_of(url)
    if sentinels is None:
        return {"broker_url": url, "result_backend": url, "broker_transport_options": {},
                "result_backend_transport_options": {}, "broker_failover_strategy": None}
    return {"broker_url": sentinels.url, "result_backend": sentinels.url,
            "broker_transport_options": sentinels.options, "result_backend_transport_options": sentinels.options,
            "broker_failover_strategy": _StayPut}


def redbeat_settings(url: str) -> dict[str, Any]:
    """redbeat's settings for the broker URL: its own Redis client (not the broker's transport
    options), through Sentinel (`redis-sentinel://` with the sentinels in its options) when the
    broker is behind it."""
    sentinels = sentinels_of(url)
    if sentinels is None:
        return {"redbeat_redis_url": url, "redbeat_redis_options": {}}
    host, port = sentinels.hosts[0]
    return {"redbeat_redis_url": f"redis-sentinel://{host}:{port}/{sentinels.db}",  # what its banner shows
            "redbeat_redis_options": {"sentinels": list(sentinels.hosts), "service_name": sentinels.master,
                                      "db": sentinels.db, "username": sentinels.username,
                                      "password": sentinels.password, "sentinel_kwargs": dict(SENTINEL_KWARGS)}}
