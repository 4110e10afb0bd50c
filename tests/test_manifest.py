"""renderfarm.manifest: one line per job, exactly once, on a local disk and on GCS (the real
emulator), read in order and from a cursor."""

from __future__ import annotations

import json
import multiprocessing
import time
import uuid
from pathlib import Path

import pytest

from renderfarm.manifest import (
    CLOCK_MARGIN_NS,
    FileManifest,
    PartsManifest,
    Records,
    open_manifest,
)
from renderfarm.storage import GCSStorage, LocalStorage, open_storage
from harness.gcs_emulator import GcsEmulator


def line(job_id: str, **extra: object) -> tuple[str, str]:
    return job_id, json.dumps({"job_id": job_id, **extra})


def ids(lines: list[bytes]) -> list[str]:
    return [json.loads(text)["job_id"] for text in lines]


@pytest.fixture(params=["local", "gs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> LocalStorage | GCSStorage:
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    emulator: GcsEmulator = request.getfixturevalue("gcs")
    bucket = f"m-{uuid.uuid4().hex[:12]}"
    emulator.create_bucket(bucket)
    return open_storage(f"gs://{bucket}/renders")


def test_each_job_once_whatever_is_written_again(store: LocalStorage | GCSStorage) -> None:
    manifest = open_manifest(store)
    first = manifest.new_part("c")
    manifest.append("c", first, [line("aa"), line("bb")])
    assert manifest.holds("c", first, "aa") and not manifest.holds("c", first, "cc")
    # A redelivered job whose sidecar names `first` finds its line there and writes nothing;
    # the same batch written twice (a retried write) adds nothing either.
    manifest.append("c", first, [line("aa"), line("bb")])
    if isinstance(manifest, FileManifest):  # one file: a job already in it is skipped
        manifest.append("c", manifest.new_part("c"), [line("bb"), line("cc")])
    else:
        manifest.append("c", manifest.new_part("c"), [line("cc")])
    lines, _ = manifest.read("c")
    assert ids(lines) == ["aa", "bb", "cc"]
    # Another process's view (a fresh object reads from the start).
    assert ids(open_manifest(store).read("c")[0]) == ["aa", "bb", "cc"]
    with pytest.raises(ValueError, match="newlines"):
        manifest.append("c", manifest.new_part("c"), [("dd", '{"job_id": "dd"}\n{}')])


def test_read_continues_from_a_cursor(store: LocalStorage | GCSStorage) -> None:
    manifest = open_manifest(store)
    with pytest.raises(FileNotFoundError):
        manifest.read("c")
    manifest.append("c", manifest.new_part("c"), [line("aa"), line("bb")])
    lines, cursor = manifest.read("c")
    assert ids(lines) == ["aa", "bb"]
    assert manifest.read("c", cursor)[0] == []
    manifest.append("c", manifest.new_part("c"), [line("cc")])
    lines, cursor = manifest.read("c", cursor)
    assert ids(lines) == ["cc"]
    assert manifest.read("c", cursor)[0] == []


def test_records_one_per_job_and_bad_lines_named(tmp_path: Path) -> None:
    records = Records([b'{"job_id": "aa", "n": 1}', b'{"job_id": "aa", "n": 2}', b"{not json",
                       b'{"job_id": "../x"}', b'{"job_id": "bb"}'], "test")
    assert [(r["job_id"], r.get("n")) for r in records] == [("aa", 1), ("bb", None)]
    assert (records.duplicates, records.bad_lines) == (1, [3, 4])


# --------------------------------------------------------------------------- local file


def _append_overlapping(root: str, worker: int) -> None:
    """Runs in a spawned process: job ids overlapping with the other process's."""
    manifest = open_manifest(open_storage(root))
    for i in range(0, 60, 3):
        batch = [line(f"{n:04x}", worker=worker) for n in range(i, i + 5)]
        manifest.append("c", manifest.new_part("c"), batch)


def test_two_processes_writing_the_same_jobs_write_each_once(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_overlapping, args=(root, w)) for w in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    written = ids(open_manifest(open_storage(root)).read("c")[0])
    assert sorted(written) == [f"{n:04x}" for n in range(62)]


def test_a_torn_last_line_is_ended_and_not_taken_for_a_job(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "root")
    store.put("c/manifest.jsonl", b'{"job_id": "aa"}\n{"job_id": "bb", "tor')
    manifest = open_manifest(store)
    assert not manifest.holds("c", "manifest.jsonl", "bb")
    manifest.append("c", "manifest.jsonl", [line("bb")])
    assert store.get("c/manifest.jsonl").splitlines()[-2:] == [b'{"job_id": "bb", "tor', b'{"job_id": "bb"}']
    records = Records(manifest.read("c")[0], "test")
    assert [r["job_id"] for r in records] == ["aa", "bb"] and records.bad_lines == [2]


# --------------------------------------------------------------------------- GCS parts


def test_gcs_parts_are_small_objects_written_once(gcs: GcsEmulator) -> None:
    bucket = f"m-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(bucket)
    store = open_storage(f"gs://{bucket}")
    manifest = PartsManifest(store)
    parts = [manifest.new_part("c") for _ in range(3)]
    assert parts == sorted(parts)  # names sort in the order they were made
    for n, part in enumerate(parts):
        manifest.append("c", part, [line(f"{n:02x}")])
    manifest.append("c", parts[0], [line("ff")])  # a part is never rewritten
    names = list(store.list("c/"))
    assert names == [f"c/{part}" for part in parts]
    assert [store.get(name) for name in names] == [(json.dumps({"job_id": f"{n:02x}"}) + "\n").encode()
                                                   for n in range(3)]
    # Foreign objects in the folder are not parts; a manifest.jsonl of an older release is read first.
    store.put("c/manifest/notes.txt", b"hello")
    store.put("c/manifest.jsonl", (json.dumps({"job_id": "0a"}) + "\n").encode())
    assert ids(PartsManifest(store).read("c")[0]) == ["0a", "00", "01", "02"]


def test_gcs_reader_sees_a_part_from_a_host_whose_clock_is_behind(gcs: GcsEmulator) -> None:
    bucket = f"m-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(bucket)
    store = open_storage(f"gs://{bucket}")
    manifest = PartsManifest(store)
    manifest.append("c", manifest.new_part("c"), [line("aa")])
    _, cursor = manifest.read("c")
    behind = time.time_ns() - CLOCK_MARGIN_NS // 2
    late = f"manifest/{behind:020d}-otherhost-1-00000000.jsonl"
    manifest.append("c", late, [line("bb")])
    lines, cursor = manifest.read("c", cursor)
    assert ids(lines) == ["bb"]
    assert manifest.read("c", cursor)[0] == []


def test_a_manifest_planted_as_a_link_is_refused_never_written_through(tmp_path: Path) -> None:
    """A `manifest.jsonl` that is a symlink (or a campaign's folder swapped for one) would make the
    worker append its lines to whatever the link names: refused, the target unchanged."""
    storage = open_storage(str(tmp_path / "root"))
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"keep me\n")
    manifest = FileManifest(storage)
    manifest.append("c", "manifest.jsonl", [line("a1")])
    (tmp_path / "root" / "c" / "manifest.jsonl").unlink()
    (tmp_path / "root" / "c" / "manifest.jsonl").symlink_to(target)
    for touch in (lambda: manifest.append("c", "manifest.jsonl", [line("b2")]),
                  lambda: manifest.holds("c", "manifest.jsonl", "b2"), lambda: manifest.read("c")):
        with pytest.raises(ValueError, match="is a symlink: a campaign's folders must be real folders"):
            touch()
    assert target.read_bytes() == b"keep me\n"
