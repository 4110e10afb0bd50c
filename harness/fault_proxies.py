"""Proxies that let a fault test decide when the fault strikes, instead of racing the worker.

- GcsProxy: an HTTP proxy in front of the GCS emulator (the worker's STORAGE_EMULATOR_HOST).
  A rule matches requests by the object they name and can hold them until the test says go,
  answer them with an error, or run a hook once the emulator has answered (before the
  worker hears it). Every request is recorded, so a test can wait for the worker to reach
  a point ("its manifest part is being written") without guessing.
- TcpProxy: a byte pump in front of redis-server (the worker's broker URL) that a test can
  pause: while paused, nothing the worker sends reaches Redis and nothing comes back. It can
  also let a command reach Redis and drop the connection before the reply comes back (what
  a client then retries, Redis has already run once).

Both are real network hops: the worker's clients and the servers are the real ones.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness.redis_server import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length"}


@dataclasses.dataclass
class Seen:
    """One request the proxy saw: its method and the object it names (bucket-relative)."""

    method: str
    name: str


@dataclasses.dataclass
class Rule:
    """What to do with requests whose object name matches `pattern` (a regex, searched)."""

    pattern: str
    hold: bool = False  # keep them waiting until `release()`
    status: int | None = None  # answer this instead of forwarding
    landed: bool = False  # with status: forward first (the write lands), then answer status
    times: int | None = None  # apply to this many requests, then stop (None: until removed)
    method: str | None = None  # only requests of this HTTP method (None: any)
    after: Callable[[Seen], None] | None = None  # run once the emulator answered, before the worker hears
    held: threading.Event = dataclasses.field(default_factory=threading.Event)  # set: one is held
    go: threading.Event = dataclasses.field(default_factory=threading.Event)
    hits: list[Seen] = dataclasses.field(default_factory=list)

    @property
    def matched(self) -> int:
        return len(self.hits)

    def release(self) -> None:
        self.go.set()


def object_name(method: str, path: str, body: bytes) -> str:
    """The object a JSON-API request names: in the URL for reads, in the upload's metadata
    (the first part of a multipart body) for writes."""
    url = urllib.parse.urlsplit(path)
    match = re.search(r"/b/[^/]+/o/([^/?]+)", url.path)
    if match:
        return urllib.parse.unquote(match.group(1))
    if method == "POST" and body:
        found = re.search(rb'"name"\s*:\s*("(?:[^"\\]|\\.)*")', body)
        if found:
            return json.loads(found.group(1))
    query = urllib.parse.parse_qs(url.query)
    return query.get("name", query.get("prefix", [""]))[0]


class GcsProxy:
    def __init__(self, upstream: str) -> None:
        target = urllib.parse.urlsplit(upstream)
        self.upstream = (target.hostname, target.port)
        self.rules: list[Rule] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                seen = Seen(self.command, object_name(self.command, self.path, body))
                rule = proxy._rule_for(seen)
                if rule is not None and rule.hold:
                    rule.held.set()
                    rule.go.wait()
                if rule is not None and rule.status is not None:
                    if rule.landed:  # an answer lost on the way back: the worker hears a failure
                        proxy._forward(self.command, self.path, self.headers, body)
                    self._reply(rule.status, {"Content-Type": "application/json"},
                                json.dumps({"error": {"code": rule.status, "message": "injected"}}).encode())
                    return
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if rule is not None and rule.after is not None:
                    rule.after(seen)
                self._reply(status, headers, data)

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client is gone (a killed worker): nothing to answer
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            self.rules.remove(rule)
        rule.release()

    def _rule_for(self, seen: Seen) -> Rule | None:
        with self._lock:
            self.seen.append(seen)
            for rule in self.rules:
                if (re.search(rule.pattern, seen.name) and rule.method in (None, seen.method)
                        and (rule.times is None or rule.matched < rule.times)):
                    rule.hits.append(seen)
                    return rule
        return None

    def _forward(self, method: str, path: str, headers: object, body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}  # type: ignore[attr-defined]
            conn.request(method, path, body=body or None, headers=sent)
            response = conn.getresponse()
            data = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP}
            return response.status, kept, data
        finally:
            conn.close()

    def close(self) -> None:
        for rule in list(self.rules):
            rule.release()
        self.server.shutdown()
        self.server.server_close()


class TcpProxy:
    """Forwards 127.0.0.1:port to `target_port`; `pause()` stops the bytes both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.running = threading.Event()
        self.running.set()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        self._open: list[socket.socket] = []
        self._cut: tuple[bytes, ...] = ()
        self._cutting: socket.socket | None = None  # the client whose next reply is dropped
        self.cut = threading.Event()  # set once a reply was dropped
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0, password: str | None = None) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, a is client), daemon=True).start()

    def cut_reply(self, *markers: bytes) -> None:
        """The next request holding any of `markers` reaches Redis, and its connection drops
        before the reply comes back (once; `cut` is set then)."""
        self.cut.clear()
        self._cut = markers

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                self.running.wait()
                if upstream and self._cut and any(marker in data for marker in self._cut):
                    self._cut, self._cutting = (), source
                elif not upstream and self._cutting is sink:
                    self._cutting = None
                    self.cut.set()
                    return  # the finally drops both sockets: the reply never arrives
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop_all(self) -> None:
        """Close every connection, dropping what a paused pump holds: a killed client's
        last commands must not reach Redis after it died."""
        for sock in self._open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._open.clear()

    def close(self) -> None:
        self._closed = True
        self.drop_all()
        self.running.set()
        self._listener.close()
