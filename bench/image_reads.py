"""Whether reading image jobs' sources stalls the devices: storage reads behind a slow proxy.

Image jobs' sources live in a bucket (the GCS emulator here) behind a proxy that holds every
image read for `--latency` seconds, as a distant or busy bucket would. The engine renders
`--batches` batches of image-to-image jobs on the tiny SD 1.x oracle checkpoint (64x64, 8 CPU
devices), three ways:

- sources already read: the devices' own time, the floor;
- read ahead (worker/sources.py: the sources of a batch and the next one are read on
  threads while the devices render): what the engine does;
- read one by one when a batch starts, on the consumer's thread: reading without threads.

    PYTHONPATH=. python bench/image_reads.py [--latency 0.25] [--batches 4] [--steps 100]
"""

from __future__ import annotations

import argparse
import io
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from PIL import Image  # noqa: E402

from diffusion.models import load_model  # noqa: E402
from harness.fault_proxies import GcsProxy, Rule  # noqa: E402
from harness.gcs_emulator import GcsEmulator  # noqa: E402
from renderfarm.images import check_init_image  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from renderfarm.storage import open_storage  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sources import InitImages  # noqa: E402

ORACLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "oracle"


def photos(bucket: str, n: int) -> list[str]:
    """`n` distinct 256x256 sources in the bucket, as URLs."""
    storage = open_storage(f"gs://{bucket}/sources")
    urls = []
    for i in range(n):
        out = io.BytesIO()
        Image.effect_noise((256, 256), 40 + i).convert("RGB").save(out, format="PNG")
        storage.put(f"{i:04d}.png", out.getvalue(), "image/png")
        urls.append(storage.url(f"{i:04d}.png"))
    return urls


def timed(engine: Engine, specs: list[JobSpec], read_ahead: bool) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.25, help="seconds the proxy holds each image read")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)  # batches long enough to hide a batch of reads
    args = parser.parse_args()
    engine = Engine(load_model(str(ORACLE / "sd1" / "model")))
    with GcsEmulator() as emulator:
        emulator.create_bucket("sources")
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
        urls = photos("sources", engine.batch_size * args.batches)
        proxy = GcsProxy(emulator.url)
        proxy.add(Rule(r"^sources/.*\.png$", method="GET", after=lambda seen: time.sleep(args.latency)))
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
        specs = [check_init_image(JobSpec(prompt=f"a harbour {i}", model=engine.model.ref, seed=i, steps=args.steps,
                                          scheduler="euler", width=64, height=64, strength=0.6, init_image=url), 64)
                 for i, url in enumerate(urls)]
        engine.compiled(engine.check(specs[0]))
        engine.prefetch(specs, engine.check(specs[0]))
        timed(engine, specs, read_ahead=False)  # warm: every source read, the program run once
        floor = timed(engine, specs, read_ahead=False)
        engine.init_images = InitImages()
        ahead = timed(engine, specs, read_ahead=True)
        engine.init_images = InitImages(threads=1)
        serial = timed(engine, specs, read_ahead=False)
        proxy.close()
    reads = len(specs)
    print(f"{reads} image jobs in {args.batches} batches of {engine.batch_size}, {args.steps} steps, "
          f"each source read held {args.latency * 1000:.0f} ms by the proxy ({reads * args.latency:.1f} s of reads)")
    print(f"  sources already read (the devices alone): {floor:.2f} s")
    print(f"  read ahead on threads:                    {ahead:.2f} s ({ahead - floor:+.2f} s)")
    print(f"  read one by one as each batch starts:     {serial:.2f} s ({serial - floor:+.2f} s)")


if __name__ == "__main__":
    main()
