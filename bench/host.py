"""What storage and encoding cost beside the devices: the host's work per image, and whether
it ever stalls them. Not a test.

Parts (`PYTHONPATH=. python bench/host.py [PART ...] [flags]`; no part runs `png tokenizer`):

- png: the worker's PNG encoder (worker/png.py: Paeth filter, zlib-ng level 1 with the
  run-length strategy) against Pillow's default, in CPU ms per image on one core and in size,
  on noise and on the photographs scikit-image ships (`pip install .[bench]`); then the
  gallery's thumbnail and contact sheet, each against the plain way.
- tokenizer: CLIP's BPE on batches of 64 distinct prompts, prompts/s per tokenizer.
- overlap: one farm worker (tiny SD, 256x256, 8 devices) against the same compiled program
  called back to back with no host work at all, and the worker's CPU split by thread.
- farm: one farm worker against `renderfarm render` of the same jobs (tiny SD, 25 steps).
- dedup: `renderfarm export --dedup 4`'s near-duplicate search on a million perceptual hashes.
- reads: image jobs whose sources sit in a bucket (the GCS emulator) behind a proxy that holds
  each read `--latency` seconds: the engine's read-ahead (worker/sources.py) against the
  sources already read (the devices alone) and against reading them as each batch starts.
"""

from __future__ import annotations

import argparse
import collections
import io
import itertools
import os
import random
import statistics
import tempfile
import time
import timeit
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from bench.control import farm_rate, farm_worker, measure_farm, stat_seconds, tiny_model  # noqa: E402

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina")
SIZE = 256  # overlap's image size
XLA_THREADS = "tf_XLAEigen"  # the name XLA:CPU gives the threads that run the devices' work
SUBJECTS = ["a lighthouse on a cliff", "a red fox in fresh snow", "a bowl of ramen", "an astronaut riding a horse",
            "a watercolor map of an imaginary island", "portrait of an old fisherman", "a cyberpunk street at night",
            "a cozy cabin in the woods"]
STYLES = ["oil painting", "telephoto photograph, 85mm, bokeh", "studio lighting, highly detailed, 8k",
          "trending on artstation, by greg rutkowski", "(masterpiece:1.2), best quality, sharp focus",
          "watercolor, soft pastel colors", "cinematic lighting, volumetric fog, unreal engine",
          "pencil sketch, cross hatching"]


# -- png ----------------------------------------------------------------------------------------------


def images() -> dict[str, np.ndarray]:
    """Noise at 256 and 1024, the photographs at their own sizes and one scaled to 1024x1024."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = {f"noise {n}x{n}": rng.integers(0, 256, (n, n, 3), dtype=np.uint8) for n in (256, 1024)}
    try:
        from skimage import data
    except ImportError:
        print("scikit-image is not installed (pip install .[bench]): noise only")
        return out
    for name in PHOTOS:
        pixels = np.ascontiguousarray(getattr(data, name)()[..., :3])
        out[f"{name} {pixels.shape[1]}x{pixels.shape[0]}"] = pixels
    big = Image.fromarray(out["astronaut 512x512"]).resize((1024, 1024), Image.Resampling.LANCZOS)
    out["astronaut 1024x1024 (scaled)"] = np.asarray(big)
    return out


def png_bytes(image: Any, **options: Any) -> bytes:
    """Pillow's PNG of a PIL image (its default settings unless `options` say otherwise)."""
    out = io.BytesIO()
    image.save(out, format="PNG", **options)
    return out.getvalue()


def pillow_png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    return png_bytes(Image.fromarray(pixels))


def cpu_ms(encode: Callable[[Any], Any], subject: Any, repeats: int) -> float:
    """Median CPU milliseconds of one call (CPU time: the figure that competes with the devices
    on a host whose cores are also its devices)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        encode(subject)
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def zlib_deflate(rows: np.ndarray) -> bytes:
    """The worker's deflate settings through Python's own zlib."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    return deflate.compress(rows) + deflate.flush()


def lanczos_thumbnail(image: Any) -> bytes:
    """The plain thumbnail: Lanczos from full size."""
    from PIL import Image

    from renderfarm.gallery import THUMB_SIZE

    thumb = image.convert("RGB")
    thumb.thumbnail((THUMB_SIZE, THUMB_SIZE), Image.Resampling.LANCZOS, reducing_gap=None)
    out = io.BytesIO()
    thumb.save(out, format="JPEG", quality=85)
    return out.getvalue()


def gallery(photos: list[np.ndarray], repeats: int) -> None:
    from PIL import Image

    from renderfarm.gallery import THUMB_SIZE, contact_sheet, make_thumbnail

    pictures = [Image.fromarray(p) for p in photos]
    box = statistics.median(cpu_ms(make_thumbnail, image, repeats) for image in pictures)
    lanczos = statistics.median(cpu_ms(lanczos_thumbnail, image, repeats) for image in pictures)
    print(f"thumbnail ({THUMB_SIZE} px JPEG), median over the photographs: box-reduced first {box:.2f} ms, "
          f"Lanczos from full size {lanczos:.2f} ms")
    thumbs = [make_thumbnail(pictures[i % len(pictures)]) for i in range(64)]
    with Image.open(io.BytesIO(contact_sheet(thumbs, len(thumbs)))) as sheet:
        sheet.load()
        fast, small = png_bytes(sheet, compress_level=1), png_bytes(sheet, optimize=True)
        fast_ms = cpu_ms(lambda im: png_bytes(im, compress_level=1), sheet, repeats)
        small_ms = cpu_ms(lambda im: png_bytes(im, optimize=True), sheet, repeats)
    print(f"contact sheet of 64 photo thumbnails ({sheet.width}x{sheet.height}): zlib level 1 {fast_ms:.0f} ms, "
          f"{len(fast) / 1024:.0f} KiB; optimize=True {small_ms:.0f} ms, {len(small) / 1024:.0f} KiB")


def part_png(args: argparse.Namespace) -> None:
    """"ours" filters on the host; "deflate" is what the worker's host does from rows the
    devices filtered (zlib-ng); "zlib" the same deflate through Python's zlib."""
    from PIL import Image

    from worker.png import encode_png, paeth_filter

    print(f"{'image':30s} {'Pillow ms':>10s} {'ours ms':>9s} {'deflate ms':>11s} {'zlib ms':>8s} "
          f"{'speed-up':>9s} {'Pillow KiB':>11s} {'ours KiB':>9s} {'size':>6s}")
    photo_sizes, photos = [0, 0], []
    for name, pixels in images().items():
        ours, theirs = encode_png(pixels), pillow_png(pixels)
        if not np.array_equal(np.asarray(Image.open(io.BytesIO(ours))), pixels):
            raise SystemExit(f"{name}: the PNG does not decode to its pixels")
        height, width, _ = pixels.shape
        rows = paeth_filter(pixels.reshape(height, width * 3), 3)
        theirs_ms, ours_ms = cpu_ms(pillow_png, pixels, args.repeats), cpu_ms(encode_png, pixels, args.repeats)
        deflate_ms = cpu_ms(lambda p: encode_png(p, scanlines=rows), pixels, args.repeats)
        zlib_ms = cpu_ms(zlib_deflate, rows, args.repeats)
        print(f"{name:30s} {theirs_ms:10.1f} {ours_ms:9.1f} {deflate_ms:11.1f} {zlib_ms:8.1f} "
              f"{theirs_ms / ours_ms:8.1f}x {len(theirs) / 1024:11.1f} {len(ours) / 1024:9.1f} "
              f"{len(ours) / len(theirs):6.3f}")
        if not name.startswith("noise"):
            photo_sizes[0] += len(theirs)
            photo_sizes[1] += len(ours)
            photos.append(pixels)
    if photos:
        print(f"photographs, all together: ours / Pillow's size = {photo_sizes[1] / photo_sizes[0]:.3f}")
        gallery(photos, args.repeats)


# -- tokenizer ----------------------------------------------------------------------------------------


def part_tokenizer(args: argparse.Namespace) -> None:
    """The worker tokenizes every prompt of every batch on the host: prompts/s for batches of 64
    distinct typical prompts, per tokenizer folder (CLIP's real vocabulary, tests/data/tokenizer/)."""
    from diffusion.tokenizer import CLIPTokenizer
    from harness.tokenizer import build_folder

    prompts = [f"{subject}, {style}" for subject, style in itertools.product(SUBJECTS, STYLES)]
    data = Path(__file__).resolve().parent.parent / "tests" / "data"
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("sd", "sdxl_2"):
            tokenizer = CLIPTokenizer.from_folder(build_folder(data, name, Path(tmp) / name))
            start = time.perf_counter()
            tokenizer(prompts)
            first = time.perf_counter() - start
            per_batch = min(timeit.repeat(lambda: tokenizer(prompts), number=100, repeat=5)) / 100
            print(f"tokenizer {name}: {len(prompts) / per_batch:,.0f} prompts/s ({per_batch * 1e3:.2f} ms per batch "
                  f"of {len(prompts)}; first batch {first * 1e3:.2f} ms)")


# -- overlap, farm: a real worker beside the bare program and the local render --------------------------


def thread_cpu(pid: int) -> collections.Counter[str]:
    """CPU seconds so far of a process's threads, by kind: XLA's device threads, or the host's
    (Python's threads, Celery's, the store threads)."""
    seconds: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        kind = "devices" if stat[stat.index("(") + 1:].startswith(XLA_THREADS) else "host"
        seconds[kind] += stat_seconds(stat)
    return seconds


class Bare:
    """The worker's compiled programs for the benchmark's shape, in this process."""

    def __init__(self, model: Path, steps: int) -> None:
        import jax

        from diffusion.generate import text_inputs
        from diffusion.models import load_model
        from renderfarm.jobs import JobSpec
        from worker.engine import Engine

        engine = Engine(load_model(str(model)))
        specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=steps,
                         width=SIZE, height=SIZE) for i in range(engine.batch_size)]
        key = engine.check(specs[0])
        program, encoder, self.batch_size = engine.compiled(key), engine.encoder(key.guided), engine.batch_size
        inputs, _ = engine.inputs(key, specs)
        text, weights = engine._weights  # noqa: SLF001

        def run() -> Any:  # a batch's two programs, as the engine dispatches them
            return program(weights, inputs, encoder(text, text_inputs(inputs)))

        self.run = run
        jax.block_until_ready(self.run())  # warm

    def rate(self, n: int) -> tuple[float, collections.Counter[str]]:
        """Images/s called back to back, and this process's CPU seconds per image by kind."""
        import jax

        batches = n // self.batch_size
        start, cpu = time.perf_counter(), thread_cpu(os.getpid())
        jax.block_until_ready([self.run() for _ in range(batches)])
        seconds, images = time.perf_counter() - start, batches * self.batch_size
        return images / seconds, per_image(thread_cpu(os.getpid()) - cpu, images)


def per_image(cpu: collections.Counter[str], images: int) -> collections.Counter[str]:
    return collections.Counter({kind: seconds / images for kind, seconds in cpu.items()})


def ms(cpu: collections.Counter[str]) -> str:
    return f"devices {1000 * cpu['devices']:.1f}, host {1000 * cpu['host']:.1f}"


def part_overlap(args: argparse.Namespace) -> None:
    """One worker serves every round, all of one campaign (a warm-up batch takes the campaign's
    one-off first gallery build out of the rounds). Each round times the bare program in this
    process while the worker idles, then the farm; the figure is the median of the ratios."""
    ratios = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = tiny_model(Path(tmp))
        bare = Bare(model, args.steps)
        with farm_worker(model, Path(tmp), args.steps, stand_in=None, size=SIZE) as (server, worker):
            measure_farm(server, model, "overlap", bare.batch_size, args.steps, SIZE, seed=0)  # warm-up
            for r in range(1, args.rounds + 1):
                bare_rate, bare_cpu = bare.rate(args.jobs)
                farm, jobs, cpu, cpu_end = measure_farm(server, model, "overlap", args.jobs, args.steps, SIZE,
                                                        seed=r * args.jobs,
                                                        measure=lambda: thread_cpu(worker.proc.pid))
                ratios.append(farm / bare_rate)
                print(f"round {r}: farm {farm:.2f} images/s, compiled function back to back {bare_rate:.2f} "
                      f"images/s, ratio {farm / bare_rate:.3f}; CPU ms per image: farm worker "
                      f"{ms(per_image(cpu_end - cpu, jobs))}; compiled function alone {ms(bare_cpu)}")
    print(f"tiny SD {SIZE}x{SIZE} {args.steps} steps, {args.jobs} images per round, 8 devices: farm / compiled "
          f"function back to back, median of {args.rounds} rounds: {statistics.median(ratios):.3f} (target >= 0.95)")


def local_rate(model: Path, tmp: Path, n: int, steps: int) -> float:
    """images/s of `renderfarm render`'s path (engine, then PNG, sidecar and manifest), warmed up."""
    from diffusion.models import load_model
    from renderfarm.jobs import JobSpec
    from renderfarm.storage import open_storage
    from worker.engine import Engine
    from worker.local import render_to_storage

    specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=steps, campaign="bench")
             for i in range(n)]
    engine = Engine(load_model(str(model)))
    render_to_storage(specs[:engine.batch_size], engine, open_storage(str(tmp / "warm"), durable=False),
                      progress=False)
    out = open_storage(str(tmp / f"local-out-{time.monotonic_ns()}"), durable=False)
    return render_to_storage(specs, engine, out, progress=False).images_per_second


def part_farm(args: argparse.Namespace) -> None:
    """The default job (25 steps) at the tiny model's native 64x64: per image a small fraction
    of a real model's compute, so the farm's per-job cost shows plainly. The local render runs
    before and after the farm, so a drift of the machine shows and averages out."""
    n, steps = args.jobs, 25
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = tiny_model(Path(tmp))
        before = local_rate(model, Path(tmp), n, steps)
        farm, _ = farm_rate(model, Path(tmp), n, steps, stand_in=None)
        after = local_rate(model, Path(tmp), n, steps)
    local = (before + after) / 2
    print(f"farm / local: tiny SD 64x64 {steps} steps, {n} images: farm {farm:.1f} images/s, local render "
          f"{local:.1f} images/s ({before:.1f} before, {after:.1f} after), ratio {farm / local:.2f} (target >= 0.9)")


def part_dedup(args: argparse.Namespace) -> None:
    """Random 64-bit hashes, one in a hundred a copy of an earlier one with 1-3 bits flipped."""
    from renderfarm.scores import near_duplicates

    rng = random.Random(0)
    hashes = [f"{rng.getrandbits(64):016x}" for _ in range(args.hashes)]
    for i in range(0, len(hashes), 100):
        flipped = int(hashes[rng.randrange(len(hashes))], 16)
        for _ in range(rng.randrange(1, 4)):
            flipped ^= 1 << rng.randrange(64)
        hashes[i] = f"{flipped:016x}"
    started = time.perf_counter()
    dropped = sum(near_duplicates(hashes, 4))
    print(f"near-duplicates of {len(hashes):,} hashes at Hamming <= 4: {dropped:,} found in "
          f"{time.perf_counter() - started:.1f} s")


# -- reads: image jobs' sources behind a slow bucket ------------------------------------------------------


def source_urls(bucket: str, n: int) -> list[str]:
    """`n` distinct 256x256 sources in the bucket, as URLs."""
    from PIL import Image

    from renderfarm.storage import open_storage

    storage = open_storage(f"gs://{bucket}/sources")
    urls = []
    for i in range(n):
        out = io.BytesIO()
        Image.effect_noise((256, 256), 40 + i).convert("RGB").save(out, format="PNG")
        storage.put(f"{i:04d}.png", out.getvalue(), "image/png")
        urls.append(storage.url(f"{i:04d}.png"))
    return urls


def render_seconds(engine: Any, specs: list[Any], read_ahead: bool) -> float:
    """Seconds to render `specs` (compiled already): as the engine does (`iter_render`, which
    reads ahead), or with each batch's sources read when it starts."""
    plan = engine.plan(specs)
    start = time.perf_counter()
    if read_ahead:
        for _ in engine.iter_render(specs, plan):
            pass
        return time.perf_counter() - start
    pending = None
    for key, idx in plan:
        started = engine.start(specs, key, idx)
        if pending is not None:
            engine.collect(pending)
        pending = started
    engine.collect(pending)
    return time.perf_counter() - start


def part_reads(args: argparse.Namespace) -> None:
    """The oracle's tiny SD 1.x checkpoint, 64x64 image-to-image jobs at strength 0.6, `--steps`
    long enough for a batch to hide the next one's reads."""
    from diffusion.models import load_model
    from harness.fault_proxies import GcsProxy, Rule
    from harness.gcs_emulator import GcsEmulator
    from renderfarm.images import check_init_image
    from renderfarm.jobs import JobSpec
    from worker.engine import Engine
    from worker.sources import InitImages

    engine = Engine(load_model(str(Path(__file__).resolve().parent.parent / "tests" / "data" / "oracle" / "sd1" /
                                   "model")))
    with GcsEmulator() as emulator:
        emulator.create_bucket("sources")
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
        urls = source_urls("sources", engine.batch_size * args.batches)
        proxy = GcsProxy(emulator.url)
        proxy.add(Rule(r"^sources/.*\.png$", method="GET", after=lambda seen: time.sleep(args.latency)))
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
        specs = [check_init_image(JobSpec(prompt=f"a harbour {i}", model=engine.model.ref, seed=i, steps=args.reads_steps,
                                          scheduler="euler", width=64, height=64, strength=0.6, init_image=url), 64)
                 for i, url in enumerate(urls)]
        engine.compiled(engine.check(specs[0]))
        engine.prefetch(specs, engine.check(specs[0]))
        render_seconds(engine, specs, read_ahead=False)  # warm: every source read, the program run once
        floor = render_seconds(engine, specs, read_ahead=False)
        engine.init_images = InitImages()
        ahead = render_seconds(engine, specs, read_ahead=True)
        engine.init_images = InitImages(threads=1)
        serial = render_seconds(engine, specs, read_ahead=False)
        proxy.close()
    reads = len(specs)
    print(f"{reads} image jobs in {args.batches} batches of {engine.batch_size}, {args.reads_steps} steps, "
          f"each source read held {args.latency * 1000:.0f} ms by the proxy ({reads * args.latency:.1f} s of reads)")
    print(f"  sources already read (the devices alone): {floor:.2f} s")
    print(f"  read ahead on threads:                    {ahead:.2f} s ({ahead - floor:+.2f} s)")
    print(f"  read one by one as each batch starts:     {serial:.2f} s ({serial - floor:+.2f} s)")


PARTS = {"png": part_png, "tokenizer": part_tokenizer, "overlap": part_overlap, "farm": part_farm,
         "dedup": part_dedup, "reads": part_reads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"of {', '.join(PARTS)} (default: png tokenizer)")
    parser.add_argument("--repeats", type=int, default=7, help="png: encodes per figure (median)")
    parser.add_argument("--jobs", type=int, help="overlap: images per round (128); farm: images (256)")
    parser.add_argument("--steps", type=int, default=4, help="overlap: steps")
    parser.add_argument("--rounds", type=int, default=5, help="overlap: rounds")
    parser.add_argument("--hashes", type=int, default=1_000_000, help="dedup: hashes")
    parser.add_argument("--latency", type=float, default=0.25, help="reads: seconds the proxy holds each image read")
    parser.add_argument("--batches", type=int, default=4, help="reads: batches of image jobs")
    parser.add_argument("--reads-steps", type=int, default=100,
                        help="reads: steps (batches long enough to hide a batch of reads)")
    args = parser.parse_args()
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    for part in args.parts or ["png", "tokenizer"]:
        PARTS[part](argparse.Namespace(**{**vars(args), "jobs": args.jobs or {"farm": 256}.get(part, 128)}))


if __name__ == "__main__":
    main()
