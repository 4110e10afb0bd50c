"""Storage in `gs://bucket/prefix` through google-cloud-storage, imported lazily so local-only
users do not need it; `STORAGE_EMULATOR_HOST` points the client at an emulator."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from renderfarm.retry import DEFAULT_RETRY, RetryPolicy, with_retries
from renderfarm.storage.base import ObjectTooLarge, Storage, check_name

if TYPE_CHECKING:  # pragma: no cover - typing only
    from google.cloud import storage

T = TypeVar("T")

EMULATOR_PROJECT = "renderfarm-emulator"


def make_gcs_client(project: str | None = None) -> "storage.Client":
    """Build a google-cloud-storage client.

    With ``STORAGE_EMULATOR_HOST`` set (tests / local emulator) use anonymous credentials,
    so no ADC lookup happens; otherwise default credentials (ADC / metadata server).
    """
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=project or os.environ.get("GOOGLE_CLOUD_PROJECT") or EMULATOR_PROJECT,
            credentials=AnonymousCredentials(),
        )
    return storage.Client() if project is None else storage.Client(project=project)


BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


class GCSStorage(Storage):
    """Storage in ``gs://bucket/prefix`` via google-cloud-storage.

    The client is created lazily (and re-created after ``fork``) so instances can be built
    before worker processes start.  The client's own retries are disabled (``retry=None``);
    this class does its own retrying so the policy is uniform and configurable.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: "storage.Client | None" = None,
        retry: RetryPolicy | None = None,
        timeout: float = 60.0,
    ) -> None:
        if not isinstance(bucket, str) or not BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_name(prefix)
        self.bucket_name = bucket
        self.prefix = prefix
        self.retry = retry or DEFAULT_RETRY
        self.timeout = timeout
        self._client = client
        self._client_pid = os.getpid() if client is not None else None
        self._lock = threading.Lock()

    # -- plumbing
    @property
    def client(self) -> "storage.Client":
        """The google client, created on first use in this process."""
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = make_gcs_client()
                self._client_pid = os.getpid()
            return self._client

    def _key(self, name: str) -> str:
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _blob(self, name: str) -> "storage.Blob":
        return self.client.bucket(self.bucket_name).blob(self._key(name))

    def _run(self, fn: Callable[[], T], what: str) -> T:
        return with_retries(fn, self.retry, what, local=False)

    # -- API
    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream",
            sync: bool = True) -> None:
        """Unconditional overwrite: retrying after an ambiguous failure just rewrites the same
        bytes. An upload is durable once it returns, whatever ``sync`` says."""
        data = bytes(data)

        def op() -> None:
            self._blob(name).upload_from_string(data, content_type=content_type, retry=None, timeout=self.timeout)

        self._run(op, f"put {self.url(name)}")

    def get(self, name: str, max_bytes: int | None = None) -> bytes:
        """With `max_bytes`, at most that many bytes are downloaded (a ranged read): a larger
        object raises ObjectTooLarge with its size."""
        from google.api_core.exceptions import NotFound

        def op() -> bytes:
            try:
                if max_bytes is None:
                    return self._blob(name).download_as_bytes(retry=None, timeout=self.timeout)
                data = self._blob(name).download_as_bytes(end=max_bytes, retry=None, timeout=self.timeout)
                if len(data) > max_bytes:  # `end` is inclusive: one byte more than allowed came
                    blob = self.client.bucket(self.bucket_name).get_blob(self._key(name), retry=None,
                                                                         timeout=self.timeout)
                    raise ObjectTooLarge(self.url(name), None if blob is None else blob.size, max_bytes)
                return data
            except NotFound:
                raise FileNotFoundError(self.url(name)) from None

        return self._run(op, f"get {self.url(name)}")

    def exists(self, name: str) -> bool:
        return self._run(lambda: self._blob(name).exists(retry=None, timeout=self.timeout), f"exists {self.url(name)}")

    def list(self, prefix: str = "", start_offset: str | None = None) -> Iterator[str]:
        """Listing is collected fully inside the retry loop, so a mid-pagination blip restarts
        cleanly. ``start_offset`` (a name) skips the names that sort before it."""
        check_name(prefix, prefix=True)
        root = f"{self.prefix}/" if self.prefix else ""
        start = None if start_offset is None else root + start_offset

        def op() -> list[str]:
            blobs = self.client.list_blobs(self.bucket_name, prefix=root + prefix, start_offset=start,
                                           retry=None, timeout=self.timeout)
            return sorted(b.name[len(root):] for b in blobs if not b.name.endswith("/"))

        return iter(self._run(op, f"list gs://{self.bucket_name}/{root}{prefix}"))

    def create(self, name: str, data: bytes, content_type: str = "application/octet-stream") -> bool:
        """Store ``data`` under ``name`` only if nothing is there yet (``if_generation_match=0``);
        False if something is. A retry after an ambiguous failure that did land finds it there."""
        from google.api_core.exceptions import PreconditionFailed

        data = bytes(data)

        def op() -> bool:
            try:
                self._blob(name).upload_from_string(data, content_type=content_type, if_generation_match=0,
                                                    retry=None, timeout=self.timeout)
            except PreconditionFailed:
                return False
            return True

        return self._run(op, f"create {self.url(name)}")

    def replace_unless(self, name: str, data: bytes, content_type: str, keep: Callable[[bytes], bool],
                       sync: bool = True) -> bool:
        """Reads the object at its generation and uploads with ``if_generation_match`` on it
        (0: nothing there); another upload between the two makes the precondition fail, and it
        looks again."""
        from google.api_core.exceptions import NotFound, PreconditionFailed

        data = bytes(data)

        def op() -> bool:
            while True:
                blob = self.client.bucket(self.bucket_name).get_blob(self._key(name), retry=None,
                                                                     timeout=self.timeout)
                try:
                    # a blob from get_blob downloads its own generation: NotFound once replaced
                    if blob is not None and keep(blob.download_as_bytes(retry=None, timeout=self.timeout)):
                        return False
                    self._blob(name).upload_from_string(
                        data, content_type=content_type, if_generation_match=0 if blob is None else blob.generation,
                        retry=None, timeout=self.timeout)
                    return True
                except (NotFound, PreconditionFailed):
                    continue  # written or removed since the look: look again

        return self._run(op, f"replace {self.url(name)}")

    def url(self, name: str) -> str:
        return f"gs://{self.bucket_name}/{self._key(name)}"

    def describe(self) -> str:
        return f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"


