"""renderfarm.storage (and its layout and retries) against the local filesystem and a real GCS emulator."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from renderfarm.layout import image_name, manifest_name, sidecar_name
from renderfarm.retry import RetryPolicy, is_transient_error
from renderfarm.storage import GCSStorage, LocalStorage, make_gcs_client, open_storage
from renderfarm.storage import local as local_backend
from harness.gcs_emulator import GcsEmulator, create_bucket

FAST_RETRY = RetryPolicy(attempts=6, base_delay=0.05, max_delay=1.0)


# --------------------------------------------------------------------------- fixtures


def _new_bucket(emu: GcsEmulator) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    emu.create_bucket(name)
    return name


@pytest.fixture(params=["local", "gs"])
def store(request, tmp_path):
    """The same tests for both backends, opened through open_storage like production code."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    emu = request.getfixturevalue("gcs")
    return open_storage(f"gs://{_new_bucket(emu)}/some/prefix")


# --------------------------------------------------------------------------- basic API


def test_put_get_exists_url(store):
    name = image_name("local", "abc123")
    assert name == "local/abc123.png"
    assert not store.exists(name)
    store.put(name, b"\x89PNG data", "image/png")
    assert store.exists(name)
    assert store.get(name) == b"\x89PNG data"
    if isinstance(store, GCSStorage):
        assert store.url(name) == f"gs://{store.bucket_name}/some/prefix/local/abc123.png"
        assert str(store) == f"gs://{store.bucket_name}/some/prefix"
        blob = store.client.bucket(store.bucket_name).get_blob("some/prefix/local/abc123.png")
        assert blob.content_type == "image/png"
    else:
        assert store.url(name) == str(store.root / "local" / "abc123.png")
        assert os.path.isabs(store.url(name))
        assert str(store) == store.root.as_uri()
        assert not [p for p in (store.root / "local").iterdir() if p.name.startswith(".rf-tmp-")]


def test_get_missing_raises_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.get("nope/missing.json")


def test_put_is_idempotent_and_overwrites(store):
    name = sidecar_name("c1", "ff00")
    store.put(name, b'{"a": 1}', "application/json")
    store.put(name, b'{"a": 1}', "application/json")
    assert store.get(name) == b'{"a": 1}'
    store.put(name, b'{"a": 2}', "application/json")
    assert store.get(name) == b'{"a": 2}'
    assert list(store.list("c1/")) == ["c1/ff00.json"]


def test_put_without_sync_stores_the_whole_file_and_skips_the_fsyncs(store, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store.put("c/thumbs/a.jpg", b"thumb" * 1000, "image/jpeg", sync=False)
    assert store.get("c/thumbs/a.jpg") == b"thumb" * 1000 and synced == []
    store.put("c/a.png", b"png" * 1000, "image/png")
    assert store.get("c/a.png") == b"png" * 1000
    if isinstance(store, LocalStorage):
        assert len(synced) == 2  # the file, then its folder (the rename)


def test_put_large_object(store):
    data = os.urandom(9 * 1024 * 1024)  # above the client's 8 MiB resumable-upload threshold
    store.put("big/blob.bin", data, "application/octet-stream")
    assert store.get("big/blob.bin") == data


def test_list(store):
    for n in ["c1/aa.png", "c1/aa.json", "c1/ab.png", "c2/aa.png", "c1/sub/x.txt", "top.txt"]:
        store.put(n, n.encode(), "text/plain")
    assert list(store.list("c1/")) == ["c1/aa.json", "c1/aa.png", "c1/ab.png", "c1/sub/x.txt"]
    assert list(store.list("c1/a")) == ["c1/aa.json", "c1/aa.png", "c1/ab.png"]
    assert list(store.list("c")) == ["c1/aa.json", "c1/aa.png", "c1/ab.png", "c1/sub/x.txt", "c2/aa.png"]
    assert list(store.list("")) == sorted(
        ["c1/aa.png", "c1/aa.json", "c1/ab.png", "c2/aa.png", "c1/sub/x.txt", "top.txt"]
    )
    assert list(store.list("zz/")) == []


@pytest.mark.parametrize("bad", ["/abs", "../x", "a/../b", "a//b", "", "a/./b", "a\\b"])
def test_bad_names_rejected(store, bad):
    with pytest.raises(ValueError):
        store.put(bad, b"x", "text/plain")


# --------------------------------------------------------------------------- layout rules


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 129, "..", ".", "a b", "é"])
def test_campaign_rules(bad):
    for fn in (lambda: image_name(bad, "ab"), lambda: sidecar_name(bad, "ab"), lambda: manifest_name(bad)):
        with pytest.raises(ValueError) as ei:
            fn()
        msg = str(ei.value)
        assert "campaign" in msg
        assert repr(bad) in msg
        assert "[A-Za-z0-9._-]{1,128}" in msg


@pytest.mark.parametrize("good", ["local", "x" * 128, "a.b_c-D9", "..."])
def test_campaign_ok(good):
    assert manifest_name(good) == f"{good}/manifest.jsonl"


@pytest.mark.parametrize("bad", ["", "xyz", "AB", "../ab", "ab/cd", "a" * 129])
def test_job_id_rules(bad):
    with pytest.raises(ValueError, match="job_id"):
        image_name("c", bad)


# --------------------------------------------------------------------------- open_storage


def test_open_storage_url_forms(tmp_path, monkeypatch, gcs):
    monkeypatch.chdir(tmp_path)
    rel = open_storage("out/rel")
    assert isinstance(rel, LocalStorage) and rel.root == tmp_path / "out" / "rel" and rel.root.is_dir()
    fileurl = open_storage(f"file://{tmp_path}/viafile")
    assert isinstance(fileurl, LocalStorage) and fileurl.root == tmp_path / "viafile" and fileurl.root.is_dir()
    assert open_storage(str(fileurl)).root == fileurl.root  # describe() round-trips

    bucket = _new_bucket(gcs)
    bare = open_storage(f"gs://{bucket}")
    assert isinstance(bare, GCSStorage) and bare.prefix == ""
    assert str(bare) == f"gs://{bucket}"
    bare.put("c/ab.png", b"png", "image/png")
    assert bare.url("c/ab.png") == f"gs://{bucket}/c/ab.png"
    assert list(bare.list("")) == ["c/ab.png"]
    assert open_storage(f"gs://{bucket}/p/q/").prefix == "p/q"

    for bad in ["s3://x/y", "gs:///nobucket", "", "gs://UPPER/x"]:
        with pytest.raises(ValueError):
            open_storage(bad)


def test_package_imports_without_jax():
    code = "import sys, renderfarm.storage; assert 'jax' not in sys.modules; assert 'google.cloud.storage' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_replace_unless_stores_what_is_not_kept(store):
    """A new name is stored; a stored file is replaced unless `keep` (shown the stored bytes)
    says to keep it."""
    seen = []
    assert store.replace_unless("c/page.html", b"2 images", "text/html", lambda stored: seen.append(stored))
    assert store.get("c/page.html") == b"2 images" and seen == []  # nothing there: nothing to look at
    assert store.replace_unless("c/page.html", b"4 images", "text/html", lambda stored: stored > b"4")
    assert not store.replace_unless("c/page.html", b"3 images", "text/html", lambda stored: stored > b"3")
    assert store.get("c/page.html") == b"4 images"


def test_replace_unless_looks_again_after_a_write_between_its_look_and_its_store(gcs):
    """Another worker's upload lands after this call looked: its store would set the object
    back, so the generation precondition fails it and it looks again, and keeps the newer one."""
    s = GCSStorage(_new_bucket(gcs), retry=FAST_RETRY)
    s.put("c/page.html", b"2 images", "text/html")
    looked = []

    def keep(stored: bytes) -> bool:
        looked.append(stored)
        if len(looked) == 1:
            s.put("c/page.html", b"4 images", "text/html")  # lands between the look and the store
        return stored > b"3"

    assert not s.replace_unless("c/page.html", b"3 images", "text/html", keep)
    assert looked == [b"2 images", b"4 images"] and s.get("c/page.html") == b"4 images"


def test_local_replace_unless_waits_for_another_ones_look_and_store(tmp_path):
    """Two writers of a local folder: the second looks only once the first has stored."""
    s = open_storage(str(tmp_path / "root"))
    looking, go = threading.Event(), threading.Event()

    def first_keep(stored: bytes) -> bool:
        looking.set()
        assert go.wait(30)
        return False

    s.put("c/page.html", b"2 images", "text/html")
    first = threading.Thread(target=s.replace_unless, args=("c/page.html", b"4 images", "text/html", first_keep))
    first.start()
    assert looking.wait(30)
    seen = []
    second = threading.Thread(target=s.replace_unless,
                              args=("c/page.html", b"3 images", "text/html", lambda b: seen.append(b) or b > b"3"))
    second.start()
    second.join(0.5)
    assert second.is_alive() and seen == []  # waiting on the first one's lock
    go.set()
    first.join(30)
    second.join(30)
    assert seen == [b"4 images"] and s.get("c/page.html") == b"4 images"


# --------------------------------------------------------------------------- emulator honesty


def test_emulator_enforces_preconditions(gcs):
    """The CAS in append_lines is only tested if the emulator really enforces preconditions."""
    from google.api_core.exceptions import PreconditionFailed

    bucket = _new_bucket(gcs)
    client = make_gcs_client()
    blob = client.bucket(bucket).blob("obj")
    blob.upload_from_string(b"one", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        client.bucket(bucket).blob("obj").upload_from_string(b"two", if_generation_match=0)
    gen = client.bucket(bucket).get_blob("obj").generation
    with pytest.raises(PreconditionFailed):
        client.bucket(bucket).blob("obj").upload_from_string(b"two", if_generation_match=gen + 1)
    # resumable (chunked) uploads honour it too
    with pytest.raises(PreconditionFailed):
        client.bucket(bucket).blob("obj", chunk_size=256 * 1024).upload_from_string(
            os.urandom(600 * 1024), if_generation_match=0
        )
    assert client.bucket(bucket).blob("obj").download_as_bytes() == b"one"
    # ... and our put does not treat 412 as transient
    assert not is_transient_error(PreconditionFailed("x"))


# --------------------------------------------------------------------------- transient errors


def _restart_later(emu: GcsEmulator, delay: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(delay), emu.start()), daemon=True)
    th.start()
    return th


def test_gcs_outage_is_retried(tmp_path, monkeypatch):
    """Operations issued while the emulator is down succeed once it is back on the same port."""
    with GcsEmulator(data_dir=tmp_path / "gcs") as emu:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
        create_bucket(emu.url, "outage")
        s = GCSStorage("outage", "p", retry=RetryPolicy(attempts=8, base_delay=0.2, max_delay=1.0))
        s.put("c/before.png", b"before", "image/png")  # warm the connection pool

        emu.stop()
        th = _restart_later(emu, 1.5)
        t0 = time.monotonic()
        s.put("c/during.png", b"during", "image/png")
        assert time.monotonic() - t0 >= 1.0
        th.join()
        assert s.get("c/during.png") == b"during"
        assert s.get("c/before.png") == b"before"  # data survived the restart

        emu.stop()
        th = _restart_later(emu, 1.0)
        assert s.create("c/part.jsonl", b"two\n")
        th.join()
        assert s.get("c/part.jsonl") == b"two\n"

        # persistent outage: bounded retries, then the transient error is re-raised
        emu.stop()
        s.retry = RetryPolicy(attempts=3, base_delay=0.01)
        t0 = time.monotonic()
        with pytest.raises(Exception) as ei:
            s.put("c/never.png", b"x", "image/png")
        assert is_transient_error(ei.value)
        assert time.monotonic() - t0 < 5


def test_create_writes_once_and_an_ambiguous_write_is_not_an_error(gcs, monkeypatch):
    """create() never overwrites; if its write lands but the response is lost, the retry
    finds the object there and does not fail."""
    import requests
    from google.cloud.storage import Blob

    s = GCSStorage(_new_bucket(gcs), retry=FAST_RETRY)
    assert s.create("part", b"first") is True
    assert s.create("part", b"second") is False and s.get("part") == b"first"
    real = Blob.upload_from_string
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            raise requests.ConnectionError("response lost")

    monkeypatch.setattr(Blob, "upload_from_string", flaky)
    assert s.create("other", b"landed") is False  # it did land: the retry saw it there
    assert s.get("other") == b"landed"


def test_a_symlinked_campaign_folder_is_refused(tmp_path):
    s = LocalStorage(tmp_path / "root")
    (tmp_path / "elsewhere").mkdir()
    (s.root / "c1").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="is a symlink"):
        s.put("c1/x.png", b"x")
    assert list((tmp_path / "elsewhere").iterdir()) == []
    s.put("c2/x.png", b"x")  # a real folder is fine
    assert s.get("c2/x.png") == b"x"


NO_LINKS = "is a symlink: a campaign's folders must be real folders, and its files regular files, not symlinks"


def _elsewhere(tmp_path):
    """A folder outside the root, and a file there that no write through the root may touch."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim").write_bytes(b"not yours")
    return elsewhere


def test_a_symlinked_folder_inside_a_campaign_is_refused(tmp_path):
    s = LocalStorage(tmp_path / "root")
    elsewhere = _elsewhere(tmp_path)
    s.put("c/x.png", b"x")
    (s.root / "c" / "thumbs").symlink_to(elsewhere)
    for write in (lambda: s.put("c/thumbs/a.jpg", b"thumb"),
                  lambda: s.replace_unless("c/thumbs/a.jpg", b"thumb", "image/jpeg", lambda stored: False),
                  lambda: s.put("c/thumbs/new/a.jpg", b"thumb")):
        with pytest.raises(ValueError) as caught:
            write()
        assert str(caught.value) == f"{s.root / 'c' / 'thumbs'} {NO_LINKS}"
    for look in (lambda: s.get("c/thumbs/victim"), lambda: s.exists("c/thumbs/victim"),
                 lambda: s.list("c/thumbs/"), lambda: s.url("c/thumbs/victim")):
        with pytest.raises(ValueError, match=NO_LINKS):
            look()
    assert sorted(os.listdir(elsewhere)) == ["victim"] and (elsewhere / "victim").read_bytes() == b"not yours"
    assert list(s.list("c/")) == ["c/x.png"] and list(s.list("")) == ["c/x.png"]  # not followed, not listed


def test_a_campaign_folder_swapped_for_a_link_after_a_write_is_refused(tmp_path):
    """Each operation looks at every folder again: having written through one once proves
    nothing about it now."""
    s = LocalStorage(tmp_path / "root")
    elsewhere = _elsewhere(tmp_path)
    s.put("c/x.png", b"x")
    s.put("c/y.png", b"y")  # through the folder as it is now
    (s.root / "c").rename(tmp_path / "moved")
    (s.root / "c").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=NO_LINKS):
        s.put("c/victim", b"overwritten")
    assert sorted(os.listdir(elsewhere)) == ["victim"] and (elsewhere / "victim").read_bytes() == b"not yours"


def test_links_planted_at_a_writes_temporary_and_final_names_are_never_followed(tmp_path):
    """The old temporary name, `.rf-tmp-NAME.THREADID`, could be guessed: links planted there
    (for every thread id this host could give a writer of this process) and at the final name
    are replaced or passed by, and the file they point at keeps its bytes."""
    s = LocalStorage(tmp_path / "root")
    elsewhere = _elsewhere(tmp_path)
    victim = elsewhere / "victim"
    s.put("c/other.png", b"o")
    folder = s.root / "c"
    ids = {threading.get_native_id(), *(t.native_id for t in threading.enumerate())}
    for tid in ids:
        for base in ("x.png", "page.html"):
            (folder / f".rf-tmp-{base}.{tid}").symlink_to(victim)
    (folder / "y.png").symlink_to(victim)

    s.put("c/x.png", b"stored")
    assert s.replace_unless("c/page.html", b"page", "text/html", lambda stored: False)
    s.put("c/y.png", b"the link is replaced, not followed")
    assert victim.read_bytes() == b"not yours"
    assert s.get("c/x.png") == b"stored" and s.get("c/page.html") == b"page"
    assert not (folder / "y.png").is_symlink() and s.get("c/y.png") == b"the link is replaced, not followed"
    assert all(os.readlink(folder / f".rf-tmp-x.png.{tid}") == str(victim) for tid in ids)
    assert list(s.list("c/")) == ["c/other.png", "c/page.html", "c/x.png", "c/y.png"]


def test_a_symlinked_file_inside_a_campaign_is_refused_on_read(tmp_path):
    s = LocalStorage(tmp_path / "root")
    victim = _elsewhere(tmp_path) / "victim"
    s.put("c/x.png", b"x")
    (s.root / "c" / "leak.png").symlink_to(victim)
    (s.root / "c" / "index.html").symlink_to(victim)
    (s.root / "c" / "inside.png").symlink_to(s.root / "c" / "x.png")  # even one that stays inside
    for name in ("c/leak.png", "c/inside.png"):
        with pytest.raises(ValueError) as caught:
            s.get(name)
        assert str(caught.value) == f"{s.root / name} {NO_LINKS}"
        assert not s.exists(name)
    looked = []
    with pytest.raises(ValueError, match=NO_LINKS):
        s.replace_unless("c/index.html", b"page", "text/html", looked.append)
    assert looked == [] and victim.read_bytes() == b"not yours"
    assert list(s.list("c/")) == ["c/x.png"] and list(s.list("c/l")) == []


def test_a_fifo_inside_a_campaign_is_refused_without_waiting_on_it(tmp_path):
    s = LocalStorage(tmp_path / "root")
    s.put("c/x.png", b"x")
    fifo = s.root / "c" / "thumb.jpg"
    os.mkfifo(fifo)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(ValueError, s.get, "c/thumb.jpg")),
                              daemon=True)
    reader.start()
    reader.join(5)
    try:
        assert not reader.is_alive(), "get waited on a FIFO for a writer"
    finally:
        if reader.is_alive():  # let a reader stuck in open() go: a writer comes and leaves
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert str(outcome[0].value) == f"{fifo} is not a regular file: {NO_LINKS.removeprefix('is a symlink: ')}"
    assert not s.exists("c/thumb.jpg") and list(s.list("c/")) == ["c/x.png"]


def test_local_transient_oserror_retried(tmp_path, monkeypatch):
    import errno

    s = LocalStorage(tmp_path / "r", retry=FAST_RETRY)
    real = os.replace
    calls = {"n": 0}

    def flaky(src, dst, **dir_fds):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst, **dir_fds)

    monkeypatch.setattr(local_backend.os, "replace", flaky)
    s.put("c/x.png", b"data", "image/png")
    assert s.get("c/x.png") == b"data"
    assert calls["n"] == 3
    assert list(s.list("c/")) == ["c/x.png"]
    assert os.listdir(s.root / "c") == ["x.png"]  # failed attempts left no temp files behind


def test_is_transient_error_classification():
    import requests
    from google.api_core import exceptions as gexc

    for exc in [
        gexc.TooManyRequests("x"),
        gexc.ServiceUnavailable("x"),
        gexc.InternalServerError("x"),
        gexc.GatewayTimeout("x"),
        requests.ConnectionError("x"),
        requests.Timeout("x"),
        ConnectionResetError(),
        ConnectionRefusedError(),
        TimeoutError(),
    ]:
        assert is_transient_error(exc), exc
    for exc in [gexc.PreconditionFailed("x"), gexc.NotFound("x"), gexc.Forbidden("x"), ValueError(), FileNotFoundError()]:
        assert not is_transient_error(exc), exc
    assert is_transient_error(OSError(5, "EIO"), local=True)
    assert not is_transient_error(FileNotFoundError(2, "x"), local=True)
    assert not is_transient_error(PermissionError(13, "x"), local=True)
