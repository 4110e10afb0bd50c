"""The model layer used on its own, as docs/models.md shows it: the snippet there runs as
written (on a tiny model) and renders what the farm's engine renders for the same jobs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from renderfarm.jobs import JobSpec
from worker.engine import Engine

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def snippet() -> str:
    """The Python block of the doc's section on the model layer on its own."""
    section = DOC.read_text().split("## The model layer on its own", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_documented_snippet_renders_what_the_engine_renders(tiny_sd: Path, sd_engine: Engine) -> None:
    code = snippet().replace('"build/tiny-sd"', repr(str(tiny_sd)))
    assert code != snippet()  # the doc still loads the folder `make demo` builds
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    images = np.asarray(scope["images"])
    assert images.shape == (2, 64, 64, 3) and images.dtype == np.uint8 and scope["truncated"] == [False, False]
    jobs = [JobSpec(prompt="a red fox in snow", seed=0, steps=4, guidance_scale=7.5, width=64, height=64,
                    scheduler="euler", model=sd_engine.model.ref),
            JobSpec(prompt="a lighthouse", negative_prompt="blurry", seed=1, steps=4, guidance_scale=7.5,
                    width=64, height=64, scheduler="euler", model=sd_engine.model.ref)]
    rendered = sd_engine.render(jobs)
    for ours, theirs in zip(images, rendered):
        assert np.abs(ours.astype(int) - theirs.image.astype(int)).max() <= 1
    assert np.abs(images[0].astype(int) - images[1].astype(int)).max() > 10  # two jobs, two images
