"""Local render, the main job without a broker: engine in-process, results to storage."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from renderfarm.gallery import refresh as refresh_gallery
from renderfarm.jobs import JobSpec
from renderfarm.storage import Storage
from worker.engine import Engine
from worker.output import ResultWriter


@dataclasses.dataclass
class RenderReport:
    images: int
    campaigns: list[str]
    compile_seconds: float
    programs: int  # compiled for this run: a generate program per shape, the text encoders' per guidance kind
    cache_hits: int  # of those, found in the persistent compilation cache
    loaded: int  # of those, saved executables loaded without tracing or compiling
    render_seconds: float  # after compile: rendering, encoding and storing

    @property
    def images_per_second(self) -> float:
        return self.images / self.render_seconds if self.render_seconds else 0.0


def render_to_storage(specs: Sequence[JobSpec], engine: Engine, storage: Storage,
                      progress: bool = True, store_threads: int | None = None) -> RenderReport:
    """Compile every needed shape first (so the rate excludes it), then render and store;
    each campaign's gallery is rebuilt at the end."""
    compile_before, hits_before = engine.compile_seconds, engine.cache_hits
    loaded_before = engine.executables.loaded if engine.executables else 0
    plan = engine.prepare(specs)
    start = time.perf_counter()
    with tqdm(total=len(specs), unit="img", disable=not progress, file=sys.stderr) as bar, \
            ResultWriter(storage, engine.model, engine.devices, threads=store_threads,
                         on_stored=lambda r: bar.update(len(r))) as writer:
        for results in engine.iter_render(specs, plan):
            writer.submit(results)
    render_seconds = time.perf_counter() - start
    campaigns = sorted({s.campaign for s in specs})
    for campaign in campaigns:
        refresh_gallery(storage, campaign)
    return RenderReport(
        images=len(specs),
        campaigns=campaigns,
        compile_seconds=engine.compile_seconds - compile_before,
        programs=len({key for key, _ in plan}) + len({key.guided for key, _ in plan}),  # the text encoders' too
        cache_hits=engine.cache_hits - hits_before,
        loaded=(engine.executables.loaded if engine.executables else 0) - loaded_before,
        render_seconds=render_seconds,
    )
