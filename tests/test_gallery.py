"""The per-campaign gallery: thumbnails, contact sheet, index.html, seen in a real headless Chromium."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from renderfarm import gallery
from renderfarm.images import check_init_image
from renderfarm.jobs import parse_job
from renderfarm.layout import index_name, manifest_name, preview_name, thumbnail_name
from renderfarm.sources import SourceRoots
from renderfarm.storage import Storage, open_storage
from renderfarm_cli import main
from harness.fault_proxies import GcsProxy, Rule
from harness.gcs_emulator import GcsEmulator
from tests.helpers import COLOURS, HOSTILE, STEPS, append_raw, store_jobs, store_results


def chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("Debian's `chromium` is not installed: apt-get install -y chromium (the gallery test needs it)")
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120, check=True)


def close(pixel: np.ndarray, colour: tuple[int, int, int], tolerance: int = 16) -> np.ndarray:
    return (np.abs(pixel.astype(int) - np.array(colour)) <= tolerance).all(axis=-1)


@pytest.fixture()
def local(tmp_path: Path) -> Storage:
    return open_storage(str(tmp_path / "renders"))


def test_refresh_writes_index_and_contact_sheet(sd_model: Any, local: Storage) -> None:
    records = store_results(local, sd_model, "c1", COLOURS)
    append_raw(local, "c1", [json.dumps(records[0])])  # a job's second line (an older release): listed once
    report = gallery.refresh(local, "c1")
    assert (report.total, report.shown, report.tiles) == (5, 5, 5)

    sheet = np.asarray(Image.open(io.BytesIO(local.get("c1/preview.png"))).convert("RGB"))
    columns, rows = gallery.grid_shape(5)
    assert (columns, rows) == (3, 2)
    step = gallery.THUMB_SIZE + gallery.TILE_GAP
    assert sheet.shape == (rows * step + gallery.TILE_GAP, columns * step + gallery.TILE_GAP, 3)
    centres = [(gallery.TILE_GAP + r * step + gallery.THUMB_SIZE // 2, gallery.TILE_GAP + c * step + gallery.THUMB_SIZE // 2)
               for r in range(rows) for c in range(columns)]
    for (y, x), colour in zip(centres, reversed(COLOURS)):  # newest first
        assert close(sheet[y, x], colour), (y, x, sheet[y, x], colour)
    assert not any(close(sheet[centres[5]], c) for c in COLOURS)  # the sixth slot is empty

    page = local.get("c1/index.html").decode()
    assert "5 images" in page and "all shown" in page and page.count("<figure") == 5
    for record in records:
        assert f'href="{record["job_id"]}.png"' in page and f'src="thumbs/{record["job_id"]}.jpg"' in page
        assert f"seed {record['spec']['seed']}" in page
    assert str(local.root) not in page and "file:/" not in page.replace("img-src 'self' file:", "")


def test_limit_lists_the_newest_and_states_the_total(sd_model: Any, local: Storage) -> None:
    records = store_results(local, sd_model, "c2", COLOURS)
    report = gallery.refresh(local, "c2", limit=2, tiles=1)
    page = local.get("c2/index.html").decode()
    assert (report.total, report.shown, report.tiles) == (5, 2, 1)
    assert "5 images" in page and "showing the newest 2" in page and page.count("<figure") == 2
    assert page.index(records[4]["job_id"]) < page.index(records[3]["job_id"])
    assert records[2]["job_id"] not in page
    sheet = Image.open(io.BytesIO(local.get("c2/preview.png")))
    assert sheet.size == (gallery.THUMB_SIZE + 2 * gallery.TILE_GAP,) * 2


@pytest.mark.browser
def test_hostile_prompts_are_escaped(sd_model: Any, local: Storage, tmp_path: Path) -> None:
    store_results(local, sd_model, "c3", COLOURS[:2], prompts=HOSTILE)
    gallery.refresh(local, "c3")
    page = local.get("c3/index.html").decode()
    assert "<script" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; a cat" in page
    dom = chromium("--dump-dom", (local.root / "c3" / "index.html").as_uri()).stdout
    assert "<script" not in dom and 'onerror="' not in dom and '<img src="x"' not in dom
    assert "&lt;script&gt;alert(\"x\")&lt;/script&gt; a cat" in dom and "a dog" in dom


@pytest.mark.browser
def test_chromium_screenshot_shows_every_image(sd_model: Any, local: Storage, tmp_path: Path) -> None:
    records = store_results(local, sd_model, "c4", COLOURS)
    gallery.refresh(local, "c4")
    page = (local.root / "c4" / "index.html").as_uri()
    shot = tmp_path / "shot.png"
    chromium(f"--screenshot={shot}", "--window-size=1000,700", page)
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    for colour in COLOURS:  # each thumbnail is drawn in a 128 x 128 box
        assert close(pixels, colour).sum() >= 0.8 * gallery.THUMB_SIZE ** 2, colour
    dom = chromium("--dump-dom", page).stdout
    for record in records:
        assert record["spec"]["prompt"] in dom


def test_store_thumbnail_keeps_the_aspect_ratio(sd_model: Any, local: Storage) -> None:
    (record,) = store_results(local, sd_model, "wide", [(10, 120, 250)], size=(256, 128))
    thumb = Image.open(io.BytesIO(local.get(thumbnail_name("wide", record["job_id"]))))
    assert (thumb.format, thumb.size) == ("JPEG", (128, 64))
    assert close(np.asarray(thumb)[32, 64], (10, 120, 250))


def test_gallery_command_makes_missing_thumbnails(sd_model: Any, local: Storage,
                                                  capsys: pytest.CaptureFixture) -> None:
    records = store_results(local, sd_model, "c5", COLOURS[:3])
    shutil.rmtree(local.root / "c5" / "thumbs")
    assert main(["gallery", "c5", "--from", str(local.root)]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 images" in out and "made 3 missing thumbnails" in out and str(local.root / "c5" / "index.html") in out
    for record in records:
        assert local.exists(thumbnail_name("c5", record["job_id"]))
    assert local.exists("c5/preview.png")

    assert main(["gallery", "nope", "--from", str(local.root)]) == 2
    err = capsys.readouterr().err
    assert "campaign='nope'" in err and f"{local.root / 'nope'}/ has no manifest" in err
    assert main(["gallery", "../etc", "--from", str(local.root)]) == 2
    assert "campaign='../etc': must match" in capsys.readouterr().err


def test_refresher_throttles_per_campaign(sd_model: Any, local: Storage) -> None:
    store_results(local, sd_model, "c6", COLOURS[:1])
    now = [1000.0]
    refresher = gallery.Refresher(local, interval=30, clock=lambda: now[0])
    index = local.root / "c6" / "index.html"
    refresher.stored(["c6"])
    assert index.exists()  # the first batch of a campaign shows at once
    index.unlink()
    now[0] += 10
    refresher.stored(["c6"])
    assert not index.exists()  # within the interval: only marked stale
    now[0] += 25
    refresher.stored([])
    assert index.exists()  # the interval passed: a stale campaign is refreshed
    index.unlink()
    refresher.stored(["c6"])
    refresher.flush()  # queue drained: stale ones now
    assert index.exists()
    refresher.stored(["no-manifest"])  # a failing refresh is logged, not raised


def test_gallery_on_gcs(sd_model: Any, gcs: GcsEmulator) -> None:
    bucket = f"g-{uuid.uuid4().hex[:10]}"
    gcs.create_bucket(bucket)
    storage = open_storage(f"gs://{bucket}/renders")
    store_results(storage, sd_model, "c7", COLOURS[:2])
    report = gallery.refresh(storage, "c7")
    assert report.index_url == f"gs://{bucket}/renders/c7/index.html"
    blob = storage.client.bucket(bucket).get_blob("renders/c7/index.html")
    assert blob.content_type.startswith("text/html") and "2 images" in blob.download_as_text()
    assert Image.open(io.BytesIO(storage.get("c7/preview.png"))).size == (2 * 132 + 4, 132 + 4)


def test_a_gallery_is_replaced_only_by_one_that_counts_as_many_images(sd_model: Any, local: Storage) -> None:
    """The page and the contact sheet each state their count; a refresh that counted fewer
    images leaves both as they are, one that counted as many replaces them."""
    store_results(local, sd_model, "c10", COLOURS[:4])
    gallery.refresh(local, "c10")
    names = (index_name("c10"), preview_name("c10"))
    stored = [local.get(name) for name in names]

    def files(total: int) -> tuple[bytes, bytes]:
        return gallery.contact_sheet([], total), gallery.render_index("c10", [], total).encode()

    assert not gallery.publish(local, "c10", 3, *files(3))
    assert [local.get(name) for name in names] == stored
    assert gallery.publish(local, "c10", 4, *files(4))
    assert "4 images" in local.get(names[0]).decode() and local.get(names[1]) == files(4)[0]


def test_a_refresh_that_lands_late_does_not_set_the_gallery_back(sd_model: Any, gcs: GcsEmulator,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers refresh a campaign's gallery: the first one's page upload is held up while
    the second stores a newer gallery; when it lands, the newer page and sheet stay."""
    bucket = f"g-{uuid.uuid4().hex[:10]}"
    gcs.create_bucket(bucket)
    proxy = GcsProxy(gcs.url)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    try:
        storage = open_storage(f"gs://{bucket}/renders")
        store_results(storage, sd_model, "c9", COLOURS[:2])
        held = proxy.add(Rule(r"c9/index\.html$", hold=True, method="POST", times=1))
        late = threading.Thread(target=gallery.refresh, args=(storage, "c9"))
        late.start()
        assert held.held.wait(60), "the first refresh's page upload"
        store_results(storage, sd_model, "c9", COLOURS[2:4], prompts=["a third", "a fourth"])
        assert gallery.refresh(storage, "c9").total == 4
        held.release()
        late.join(60)
        assert not late.is_alive()
        assert "4 images" in storage.get(index_name("c9")).decode()
        assert Image.open(io.BytesIO(storage.get(preview_name("c9")))).size == (2 * 132 + 4,) * 2  # 4 tiles
    finally:
        proxy.close()


def test_a_refresh_reads_only_the_manifest_lines_written_since_the_last(sd_model: Any, local: Storage) -> None:
    store_results(local, sd_model, "c8", COLOURS[:2])
    refresher = gallery.Refresher(local, interval=0)
    refresher.stored(["c8"])
    assert "2 images" in local.get(index_name("c8")).decode()
    # What the refresher has read is not read again: garbled in place, it still counts.
    path = local.path(manifest_name("c8"))
    path.write_bytes(b"x" * (path.stat().st_size - 1) + b"\n")
    store_results(local, sd_model, "c8", COLOURS[2:4], prompts=["a third", "a fourth"])
    refresher.stored(["c8"])
    assert "4 images" in local.get(index_name("c8")).decode()
    assert gallery.refresh(local, "c8").total == 2  # a full read does see the garbled lines


def test_an_image_job_shows_its_source_beside_the_result(sd_model: Any, local: Storage, tmp_path: Path) -> None:
    sources = [tmp_path / "fox.png", tmp_path / "gone.png"]
    for path, colour in zip(sources, [(250, 120, 0), (0, 0, 250)]):
        Image.new("RGB", (96, 64), colour).save(path)
    jobs = [check_init_image(parse_job({"prompt": f"p{i}", "model": sd_model.ref, "seed": i, "steps": STEPS,
                                        "width": 64, "height": 64, "campaign": "c9", "init_image": str(path),
                                        "strength": 0.5}), 64)
            for i, path in enumerate([sources[0], sources[0], sources[1]])]
    text = parse_job({"prompt": "text", "model": sd_model.ref, "seed": 9, "steps": STEPS, "width": 64,
                      "height": 64, "campaign": "c9"})
    records = store_jobs(local, sd_model, [*jobs, text], COLOURS[:4])
    sources[1].unlink()  # a source moved away since: its results show alone
    gallery.refresh(local, "c9")

    page = local.get("c9/index.html").decode()
    fox = jobs[0].init_image_sha256
    assert page.count(f'src="thumbs/source-{fox}.jpg"') == 2 and page.count('class="image-job"') == 2
    assert f"source-{jobs[2].init_image_sha256}" not in page and page.count("<figure") == 4
    thumb = np.asarray(Image.open(io.BytesIO(local.get(f"c9/thumbs/source-{fox}.jpg"))).convert("RGB"))
    assert thumb.shape[:2] == (64, 96) and close(thumb[30, 50], (250, 120, 0))
    assert f'href="{records[3]["job_id"]}.png"' in page and "strength 0.5" in page


def test_a_source_is_published_only_if_it_is_the_image_its_line_names(
        sd_model: Any, local: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A line names its source by path and sha256: the file at that path when it is not those
    bytes (a line written to copy another file out), or when the line has no digest, is not
    published; the gallery is built without it."""
    fox, secret = tmp_path / "fox.png", tmp_path / "secret.png"
    for path, colour in ((fox, (250, 120, 0)), (secret, (0, 0, 250))):
        Image.new("RGB", (96, 64), colour).save(path)
    job = {"prompt": "p", "model": sd_model.ref, "steps": STEPS, "width": 64, "height": 64, "campaign": "c10",
           "strength": 0.5}
    made_from_fox = check_init_image(parse_job({**job, "seed": 1, "init_image": str(fox)}), 64)
    names_secret = dataclasses.replace(made_from_fox, init_image=str(secret))  # the fox's sha256
    undigested = parse_job({**job, "seed": 2, "init_image": str(secret)})
    assert undigested.init_image_sha256 is None
    store_jobs(local, sd_model, [names_secret, undigested], COLOURS[:2])
    with caplog.at_level("WARNING", logger="renderfarm.gallery"):
        assert gallery.refresh(local, "c10").total == 2

    assert [name for name in local.list("c10/thumbs/") if "source-" in name] == []
    page = local.get(index_name("c10")).decode()
    assert page.count("<figure") == 2 and 'class="image-job"' not in page and "thumbs/source-" not in page
    logged = caplog.text
    assert (f"init_image={str(secret)!r}: is not the image its line's init_image_sha256 names "
            f"({made_from_fox.init_image_sha256})") in logged, logged
    assert (f"job {undigested.job_id} names init_image {str(secret)!r} without a valid init_image_sha256"
            in logged), logged


def test_a_workers_gallery_reads_sources_only_under_its_source_roots(
        sd_model: Any, local: Storage, tmp_path: Path) -> None:
    """A worker's refresh reads an image job's source as the worker reads sources: only under
    its source roots, so a manifest line cannot make it publish a file from elsewhere."""
    inside, outside = tmp_path / "sources", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    job = {"prompt": "p", "model": sd_model.ref, "steps": STEPS, "width": 64, "height": 64, "strength": 0.5}
    specs = []
    for n, folder in enumerate((inside, outside)):
        Image.new("RGB", (64, 64), (40 * n, 200, 0)).save(folder / "photo.png")
        specs.append(check_init_image(parse_job({**job, "seed": n, "campaign": f"roots{n}",
                                                 "init_image": str(folder / "photo.png")}), 64))
    roots = SourceRoots.parse([str(inside)])
    for n, spec in enumerate(specs):
        store_jobs(local, sd_model, [spec], COLOURS[:1])
        gallery.refresh(local, f"roots{n}", roots=roots)
    published = [[name for name in local.list(f"roots{n}/thumbs/") if "source-" in name] for n in range(2)]
    assert published == [[f"roots0/thumbs/source-{specs[0].init_image_sha256}.jpg"], []]
