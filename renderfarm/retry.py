"""Retries for storage: which errors are worth another try (network blips, throttling, 5xx,
flaky local I/O) and how often, with jittered exponential backoff; the same policy for
every backend."""

from __future__ import annotations

import errno
import http.client
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry transient errors: total tries, first backoff, backoff cap (delays
    double each time, with jitter)."""

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, failures: int) -> float:
        """Jittered exponential delay after ``failures`` consecutive failures (>= 1)."""
        d = min(self.max_delay, self.base_delay * (2 ** (failures - 1)))
        return d * (0.5 + random.random() / 2)


DEFAULT_RETRY = RetryPolicy()

# Local OSErrors that retrying cannot fix.
_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.EINVAL,
    errno.EROFS,
    errno.ENOTEMPTY,
    errno.ELOOP,
    errno.EBADF,
}
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}


def _google_transient(exc: BaseException) -> bool | None:
    """Classify google/requests/urllib3 exceptions; None if not one of theirs. The imports
    are here, not at the top, so that a producer that only writes local files never pays
    for loading the google client."""
    import requests
    import urllib3
    from google.api_core import exceptions as gexc
    from google.auth.exceptions import TransportError
    from google.cloud.storage.exceptions import InvalidResponse

    if isinstance(exc, gexc.PreconditionFailed):
        return False
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _TRANSIENT_HTTP
    if isinstance(
        exc,
        (
            requests.ConnectionError,
            requests.Timeout,
            requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.TimeoutError,
            urllib3.exceptions.PoolError,
        ),
    ):
        return True
    if isinstance(exc, TransportError):
        inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
        return True if inner is None else is_transient_error(inner, local=False)
    if isinstance(exc, InvalidResponse):
        return getattr(exc.response, "status_code", None) in _TRANSIENT_HTTP
    return None


def is_transient_error(exc: BaseException, *, local: bool = False) -> bool:
    """True if ``exc`` is worth retrying (network blips, throttling, 5xx, flaky local I/O).

    ``local=True`` additionally treats generic OSErrors as transient, except those that
    retrying cannot fix (missing file, permissions, ...).
    """
    g = _google_transient(exc)
    if g is not None:
        return g
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
        return True
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine)):
        return True
    if local and isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS and not isinstance(
            exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
        )
    return False


def with_retries(fn: Callable[[], T], policy: RetryPolicy, what: str, *, local: bool) -> T:
    """Run ``fn``; on transient errors back off and retry up to ``policy.attempts`` tries."""
    failures = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient_error(exc, local=local):
                raise
            failures += 1
            if failures >= policy.attempts:
                log.warning("storage: %s failed after %d attempts: %r", what, failures, exc)
                raise
            delay = policy.delay(failures)
            log.info("storage: %s transient error (%r); retry %d/%d in %.2fs", what, exc, failures, policy.attempts - 1, delay)
            time.sleep(delay)


