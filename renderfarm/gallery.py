"""Per-campaign gallery next to the images: thumbnails, a static index.html and a contact sheet.

Shared by the worker (which stores a thumbnail with each result and refreshes the gallery
now and then) and the `renderfarm gallery` command, so no JAX and no producer imports here.
The page links with relative paths only, so a campaign folder works the same copied to a
laptop, opened from local storage, or served as a bucket website.

Scale: the worker writes one small JPEG per image when it stores the image, so a refresh
never decodes full-size PNGs; it reads the manifest lines written since its last refresh
and fetches only the thumbnails of the contact sheet. The page lists the newest ``limit``
images and states the total.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import html
import io
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image, PngImagePlugin

from renderfarm.errors import shown
from renderfarm.jobs import SHA256_RE, JobError, check_campaign
from renderfarm.images import open_image
from renderfarm.sources import SourceRoots, read_source
from renderfarm.layout import image_name, index_name, preview_name, source_thumbnail_name, thumbnail_name
from renderfarm.manifest import (
    Cursor,
    Manifest,
    Records,
    no_such_campaign,
    open_manifest,
)
from renderfarm.storage import LocalStorage, Storage

log = logging.getLogger(__name__)

THUMB_SIZE = 128  # px, longest side
DEFAULT_LIMIT = 500  # images listed on index.html
DEFAULT_TILES = 64  # thumbnails on preview.png (8 x 8)
TILE_GAP = 4  # px between contact sheet tiles
EAGER_IMAGES = 64  # the first screenfuls load at once, the rest lazily
FETCH_THREADS = 8
_SHEET_TOTAL = "renderfarm total"  # the contact sheet's text chunk: the images its refresh counted
_PAGE_TOTAL = re.compile(rb'<span id="total">([\d,]+) images</span>')


# --------------------------------------------------------------------------- thumbnails


def make_thumbnail(image: bytes | Image.Image, size: int = THUMB_SIZE) -> bytes:
    """A JPEG no larger than ``size`` px on its longest side (a few kB at 128 px), from a
    stored PNG or, in the worker, from the image before it was encoded."""
    if isinstance(image, bytes):
        with Image.open(io.BytesIO(image)) as decoded:
            thumb = decoded.convert("RGB")
    else:
        thumb = image.convert("RGB")
    # Box-reduce by the whole factor first (reducing_gap=1), then Lanczos for the rest: the
    # worker pays this for every image it stores (`bench/host.py png` times both ways).
    thumb.thumbnail((size, size), Image.Resampling.LANCZOS, reducing_gap=1.0)
    out = io.BytesIO()
    thumb.save(out, format="JPEG", quality=85)
    return out.getvalue()


def store_thumbnail(storage: Storage, campaign: str, job_id: str, image: bytes | Image.Image) -> str:
    """Store the gallery thumbnail of one stored image; returns its storage name.

    The worker calls this right after storing a result (before its manifest line), so every
    job a refresh sees already has its thumbnail.
    """
    name = thumbnail_name(campaign, job_id)
    storage.put(name, make_thumbnail(image), "image/jpeg", sync=False)  # remade from the PNG if lost
    return name


def _thumbnail(storage: Storage, campaign: str, job_id: str) -> bytes:
    """The stored thumbnail, made from the PNG (and stored) if it is missing."""
    try:
        return storage.get(thumbnail_name(campaign, job_id))
    except FileNotFoundError:
        thumb = make_thumbnail(storage.get(image_name(campaign, job_id)))
        storage.put(thumbnail_name(campaign, job_id), thumb, "image/jpeg", sync=False)
        return thumb


def _ensure_source_thumbnail(storage: Storage, campaign: str, digest: str, ref: str,
                             roots: SourceRoots | None) -> bool:
    """The thumbnail of an image job's source image, made from the source if missing; False if
    the source cannot be read any more or is not the image its digest names (a line may name
    any file: only the bytes the job was made from are published), and the gallery then shows
    the result alone."""
    name = source_thumbnail_name(campaign, digest)
    if storage.exists(name):
        return True
    try:
        data = read_source(ref, "init_image", roots)
        if hashlib.sha256(data).hexdigest() != digest:
            raise JobError("init_image", ref, f"is not the image its line's init_image_sha256 names ({digest})")
        image = open_image(data, ref)
    except JobError as err:
        log.warning("gallery of %s: no thumbnail of the source image: %s", campaign, err)
        return False
    storage.put(name, make_thumbnail(image), "image/jpeg", sync=False)
    return True


def _ensure_thumbnail(storage: Storage, campaign: str, job_id: str) -> bool:
    """Make the thumbnail if it is missing; True if one was made."""
    if storage.exists(thumbnail_name(campaign, job_id)):
        return False
    store_thumbnail(storage, campaign, job_id, storage.get(image_name(campaign, job_id)))
    return True


# --------------------------------------------------------------------------- contact sheet


def grid_shape(tiles: int) -> tuple[int, int]:
    """(columns, rows) of a contact sheet: as square as possible, never an empty row."""
    columns = max(1, math.ceil(math.sqrt(tiles)))
    return columns, max(1, math.ceil(tiles / columns))


def contact_sheet(thumbs: list[bytes], total: int, tile: int = THUMB_SIZE, gap: int = TILE_GAP) -> bytes:
    """A PNG grid of thumbnails, newest first, each centred in a ``tile`` px square; it
    states the campaign's ``total`` images in a text chunk, as index.html does on the page."""
    columns, rows = grid_shape(len(thumbs))
    sheet = Image.new("RGB", (columns * (tile + gap) + gap, rows * (tile + gap) + gap), (32, 32, 32))
    for i, data in enumerate(thumbs):
        with Image.open(io.BytesIO(data)) as thumb:
            thumb = thumb.convert("RGB")
            thumb.thumbnail((tile, tile))
            x = gap + (i % columns) * (tile + gap) + (tile - thumb.width) // 2
            y = gap + (i // columns) * (tile + gap) + (tile - thumb.height) // 2
            sheet.paste(thumb, (x, y))
    out = io.BytesIO()
    # zlib level 1, not `optimize=True`: a worker refreshes this every 30 s per running
    # campaign (`bench/host.py png` times both ways and gives both sizes).
    text = PngImagePlugin.PngInfo()
    text.add_text(_SHEET_TOTAL, str(total))
    sheet.save(out, format="PNG", compress_level=1, pnginfo=text)
    return out.getvalue()


# --------------------------------------------------------------------------- index.html

_STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;background:#111;color:#ddd}
a{color:#8cf}h1{font-size:20px;margin:0 0 4px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(160px,1fr));gap:12px;margin-top:12px}
figure{margin:0;background:#1c1c1c;padding:8px;border-radius:4px}
figure img{display:block;width:128px;height:128px;object-fit:contain;margin:0 auto}
figure.image-job{grid-column:span 2}.pair{display:flex;gap:8px;justify-content:center}.pair img{margin:0}
figcaption{margin-top:6px;font-size:12px;overflow-wrap:anywhere}
.prompt{display:-webkit-box;-webkit-line-clamp:3;-webkit-box-orient:vertical;overflow:hidden}
.meta{color:#999}
.meta,.scores{display:block}.nsfw{color:#f66}
"""


def _figure(record: dict[str, Any], eager: bool, sources: Collection[str]) -> str:
    """One image's tile; an image job whose source has a thumbnail (in `sources`) shows the
    source beside the result."""
    spec = _spec(record)
    job_id = record["job_id"]  # validated hex: safe in a URL and in HTML
    prompt = html.escape(str(spec.get("prompt", "")), quote=True)
    seed = html.escape(str(spec.get("seed", "?")))
    size = html.escape(f"{record.get('width', '?')}x{record.get('height', '?')}")
    loading = "" if eager else ' loading="lazy"'
    result = (f'<a href="{job_id}.png"><img src="thumbs/{job_id}.jpg" alt="{prompt}" title="{prompt}"'
              f'{loading}></a>')
    meta, kind = f'seed {seed} · {size} · <a href="{job_id}.json">sidecar</a>', ""
    digest = spec.get("init_image_sha256")
    if digest in sources:  # validated hex (source_thumbnail_name)
        source = html.escape(str(spec.get("init_image", "")), quote=True)
        result = (f'<div class="pair"><img src="thumbs/source-{digest}.jpg" alt="source: {source}" '
                  f'title="source: {source}"{loading}>{result}</div>')
        meta = f'source {source} · strength {html.escape(str(spec.get("strength")))} · {meta}'
        kind = ' class="image-job"'
    return (f'<figure id="{job_id}"{kind}>{result}<figcaption><span class="prompt">{prompt}</span>'
            f'<span class="meta">{meta}</span>{_scores_line(record.get("scores"))}</figcaption></figure>')


def _scores_line(scores: Any) -> str:
    """An image's scores under its caption (renderfarm/scores.py), an nsfw flag marked."""
    if not isinstance(scores, dict) or not scores:
        return ""
    shown = [f"{name} {scores[name]:.4g}" for name in ("clip", "aesthetic")
             if isinstance(scores.get(name), (int, float))]
    if scores.get("nsfw") is True:
        shown.insert(0, '<b class="nsfw">nsfw</b>')
    elif scores.get("nsfw") is False:
        shown.insert(0, "safe")
    return f'<span class="scores">{" · ".join(shown)}</span>' if shown else ""


def render_index(campaign: str, records: list[dict[str, Any]], total: int, manifest_link: bool = True,
                 sources: Collection[str] = ()) -> str:
    """The gallery page for ``records`` (newest first) out of ``total`` images; it links the
    manifest where that is one file (a local folder) and shows the source images whose
    digests `sources` holds beside their results."""
    name = html.escape(check_campaign(campaign))
    manifest = ' · <a href="manifest.jsonl">manifest</a>' if manifest_link else ""
    shown = (f"showing the newest {len(records):,}" if len(records) < total else "all shown")
    updated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    figures = "\n".join(_figure(r, i < EAGER_IMAGES, sources) for i, r in enumerate(records))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src 'self' file: https: http:; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{name}: renderfarm gallery</title>
<style>{_STYLE}</style></head>
<body><h1>{name}</h1>
<p class="summary"><span id="total">{total:,} images</span>; {shown}. Updated {updated}.
<a href="preview.png">contact sheet</a>{manifest}</p>
<main class="grid">
{figures}
</main></body></html>
"""


# --------------------------------------------------------------------------- refresh


@dataclasses.dataclass
class Gallery:
    """What a refresh wrote."""

    campaign: str
    total: int  # distinct finished jobs in the manifest
    shown: int  # on index.html
    tiles: int  # on preview.png
    thumbnails_made: int
    index_url: str
    preview_url: str

    def summary(self) -> str:
        made = f"; made {self.thumbnails_made} missing thumbnails" if self.thumbnails_made else ""
        return (f"gallery of {self.campaign}: {self.index_url} ({self.shown} of {self.total} images), "
                f"contact sheet {self.preview_url} ({self.tiles} tiles){made}")


@dataclasses.dataclass
class Seen:
    """What a refresher has read of a campaign's manifest: where it stopped, the newest
    records and how many there are."""

    newest: collections.deque[dict[str, Any]]
    cursor: Cursor | None = None
    total: int = 0
    sources: set[str] = dataclasses.field(default_factory=set)  # digests of source images with a thumbnail

    def read(self, manifest: Manifest, storage: Storage, campaign: str) -> None:
        """Take in the lines written since the last read."""
        try:
            lines, self.cursor = manifest.read(campaign, self.cursor)
        except FileNotFoundError:
            raise no_such_campaign(storage, campaign) from None
        for record in Records(lines, f"{storage.url(campaign)} manifest"):
            if record.get("dropped"):  # its image was not stored (the job's on_nsfw: drop)
                continue
            if _spec(record).get("init_image") is not None and _source(record) is None:
                log.warning("gallery of %s: job %s names init_image %s without a valid init_image_sha256 "
                            "(64 hex digits): its source image is not shown", campaign, record["job_id"],
                            shown(_spec(record)["init_image"]))
            self.newest.append(record)
            self.total += 1


def refresh(storage: Storage, campaign: str, *, limit: int = DEFAULT_LIMIT, tiles: int = DEFAULT_TILES,
            make_thumbnails: bool = False, seen: Seen | None = None, manifest: Manifest | None = None,
            roots: SourceRoots | None = None) -> Gallery:
    """Rebuild CAMPAIGN/index.html (newest ``limit`` images) and CAMPAIGN/preview.png (newest
    ``tiles``) from the manifest (from where ``seen`` stopped, if given). Thumbnails the
    contact sheet needs are made from the PNGs if missing; ``make_thumbnails`` also checks
    every listed image (one request each: the `renderfarm gallery` command does it, the
    worker's periodic refresh does not need to). Image jobs' sources are read under `roots`
    when given (a worker's source roots, renderfarm.sources)."""
    for field, value in (("limit", limit), ("tiles", tiles)):
        if value < 1:
            raise JobError(field, value, "must be >= 1")
    check_campaign(campaign)
    seen = seen or Seen(collections.deque(maxlen=limit))
    seen.read(manifest or open_manifest(storage), storage, campaign)
    shown, total = list(reversed(seen.newest)), seen.total
    ids = [r["job_id"] for r in shown]
    made = 0
    with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="gallery") as pool:
        if make_thumbnails:
            made = sum(pool.map(lambda job_id: _ensure_thumbnail(storage, campaign, job_id), ids))
        thumbs = list(pool.map(lambda job_id: _thumbnail(storage, campaign, job_id), ids[:tiles]))
        new = [(digest, ref) for digest, ref in _sources(shown).items() if digest not in seen.sources]
        readable = list(pool.map(lambda source: _ensure_source_thumbnail(storage, campaign, *source, roots), new))
        seen.sources |= {digest for (digest, _), ok in zip(new, readable) if ok}
    page = render_index(campaign, shown, total, manifest_link=isinstance(storage, LocalStorage),
                        sources=seen.sources)
    publish(storage, campaign, total, contact_sheet(thumbs, total), page.encode("utf-8"))
    return Gallery(campaign, total, len(shown), len(thumbs), made,
                   storage.url(index_name(campaign)), storage.url(preview_name(campaign)))


def _spec(record: dict[str, Any]) -> dict[str, Any]:
    spec = record.get("spec")
    return spec if isinstance(spec, dict) else {}


def _source(record: dict[str, Any]) -> tuple[str, str] | None:
    """An image job's source image: (sha256, reference); None for a text job's line, and for
    one whose digest is missing or malformed: nothing then vouches for the file it names."""
    digest, ref = _spec(record).get("init_image_sha256"), _spec(record).get("init_image")
    if isinstance(digest, str) and SHA256_RE.fullmatch(digest) and isinstance(ref, str):
        return digest, ref
    return None


def _sources(records: list[dict[str, Any]]) -> dict[str, str]:
    """The source images of the image jobs among `records`: sha256 -> reference."""
    return dict(filter(None, map(_source, records)))


def publish(storage: Storage, campaign: str, total: int, sheet: bytes, page: bytes) -> bool:
    """Store a refresh's contact sheet and page, each unless the one stored counts more images.

    Every worker refreshes on its own, so a refresh may land after a newer one of another
    worker (its upload slow, its process paused): kept out, it cannot set the gallery back.
    Both are rebuilt from the manifest by every refresh: no fsync. True if both were stored."""
    stored_sheet = storage.replace_unless(preview_name(campaign), sheet, "image/png",
                                          lambda stored: _sheet_total(stored) > total, sync=False)
    stored_page = storage.replace_unless(index_name(campaign), page, "text/html; charset=utf-8",
                                         lambda stored: _page_total(stored) > total, sync=False)
    return stored_sheet and stored_page


def _page_total(page: bytes) -> int:
    found = _PAGE_TOTAL.search(page)
    return int(found[1].replace(b",", b"")) if found else 0


def _sheet_total(sheet: bytes) -> int:
    try:
        with Image.open(io.BytesIO(sheet)) as image:
            return int(image.info.get(_SHEET_TOTAL, 0))
    except (OSError, ValueError):  # not a contact sheet of ours: replace it
        return 0


class Refresher:
    """Keeps galleries fresh without a rebuild per bundle: call :meth:`stored` with the
    campaigns of each stored bundle (a campaign is refreshed at once the first time, then at
    most every ``interval`` seconds) and :meth:`flush` when the queue drains or the worker
    stops. Each refresh reads only the manifest lines written since the last one, and image
    jobs' sources only under ``roots`` (a worker's). A failed refresh is logged, never raised:
    a gallery must not fail renders."""

    def __init__(self, storage: Storage, interval: float = 30.0, limit: int = DEFAULT_LIMIT,
                 clock: Callable[[], float] = time.monotonic, roots: SourceRoots | None = None) -> None:
        self.storage, self.interval, self.limit, self.clock, self.roots = storage, interval, limit, clock, roots
        self.manifest = open_manifest(storage)
        self._last: dict[str, float] = {}
        self._stale: set[str] = set()
        self._seen: dict[str, Seen] = {}

    def stored(self, campaigns: Iterable[str]) -> None:
        self._stale.update(campaigns)
        now = self.clock()
        for campaign in sorted(self._stale):
            last = self._last.get(campaign)
            if last is None or now - last >= self.interval:
                self._refresh(campaign)

    def flush(self) -> None:
        for campaign in sorted(self._stale):
            self._refresh(campaign)

    def _refresh(self, campaign: str) -> None:
        self._stale.discard(campaign)
        self._last[campaign] = self.clock()
        seen = self._seen.setdefault(campaign, Seen(collections.deque(maxlen=self.limit)))
        try:
            refresh(self.storage, campaign, limit=self.limit, seen=seen, manifest=self.manifest, roots=self.roots)
        except Exception:  # noqa: BLE001 - logged; the next refresh retries
            log.warning("gallery refresh of %s failed", campaign, exc_info=True)
