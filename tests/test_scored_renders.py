"""Scores where the images render: `renderfarm render --score ...` with the tiny scoring models
of tests/data/scores/ scores each image on the devices right after its batch, and its sidecar
and manifest line carry what the job asked for, equal to the scorers run on the stored PNG's
pixels; a score whose model the worker lacks is missing with the reason, and the image stays."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from diffusion.scores import load_scorers, phash
from harness.farm import STEPS
from renderfarm.jobs import reroll_seed
from tests.helpers import DATA, Cli

SCORES = DATA / "scores"
MODELS = ("--safety-model", SCORES / "safety_checker", "--clip-model", SCORES / "clip",
          "--aesthetic-model", SCORES / "aesthetic.safetensors")


def render(cli: Cli, model: Path, out: Path, *extra: object) -> list[dict]:
    code, output, err = cli("render", "a red lighthouse", "a blue fox", "a green owl", "--model", model,
                            "--out", out, "--campaign", "scored", "--seed", 5, "--steps", STEPS,
                            "--width", 64, "--height", 64, "--quiet", *extra)
    assert code == 0, err
    return [json.loads(line) for line in (out / "scored" / "manifest.jsonl").read_text().splitlines()]


def test_each_image_carries_the_scores_it_asked_for(cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    records = render(cli, tiny_sd, tmp_path / "out", "--score", "safety", "--score", "clip",
                     "--score", "aesthetic", "--score", "phash", *MODELS)
    scorers = load_scorers(SCORES / "safety_checker", SCORES / "clip", SCORES / "aesthetic.safetensors")
    for record in records:
        sidecar = json.loads((tmp_path / "out" / "scored" / f"{record['job_id']}.json").read_text())
        assert sidecar == record and "scores_missing" not in record
        pixels = np.asarray(Image.open(io.BytesIO((tmp_path / "out" / "scored" /
                                                   f"{record['job_id']}.png").read_bytes())).convert("RGB"))
        expected = jax.jit(scorers.score_batch)(scorers.params, pixels[None],
                                                scorers.tokenize([record["spec"]["prompt"]]))
        scores = record["scores"]
        assert set(scores) == {"nsfw", "safety_concepts", "clip", "aesthetic", "phash"}
        assert scores["nsfw"] == bool(expected["nsfw"][0])
        assert scores["clip"] == pytest.approx(float(expected["clip"][0]), abs=1e-3)
        assert scores["aesthetic"] == pytest.approx(float(expected["aesthetic"][0]), abs=1e-3)
        assert scores["phash"] == f"{phash(pixels):016x}"
        flagged = {f"concept {i}": v for i, v in enumerate(np.asarray(expected["concept_scores"][0])) if v > 0}
        assert set(flagged) <= set(scores["safety_concepts"])
    page = (tmp_path / "out" / "scored" / "index.html").read_text()  # the gallery shows them
    for record in records:
        scores = record["scores"]
        figure = page[page.index(f'<figure id="{record["job_id"]}"'):].split("</figure>")[0]
        assert f"clip {scores['clip']:.4g} · aesthetic {scores['aesthetic']:.4g}" in figure
        assert ('<b class="nsfw">nsfw</b>' if scores["nsfw"] else "safe") in figure


def test_a_score_the_worker_cannot_give_is_missing_with_its_reason(cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    records = render(cli, tiny_sd, tmp_path / "out", "--score", "clip", "--score", "phash")
    for record in records:
        assert set(record["scores"]) == {"phash"}
        assert record["scores_missing"] == {"clip": "this worker has no clip model (renderfarm worker --clip-model)"}
    plain = render(cli, tiny_sd, tmp_path / "plain")
    assert all("scores" not in record and "scores_missing" not in record for record in plain)


def test_a_scoring_model_that_is_not_there_stops_the_command_before_it_renders(
        cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    code, _, err = cli("render", "a fox", "--model", tiny_sd, "--out", tmp_path / "out", "--score", "clip",
                       "--clip-model", tmp_path / "nowhere")
    assert code == 2 and str(tmp_path / "nowhere") in err, err
    assert not (tmp_path / "out").exists()


def test_a_gated_job_keeps_the_first_attempt_that_passes(cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    """Attempt k renders with reroll_seed(seed, k); the image kept is the first whose scores
    pass the gate (the same pixels as a plain job of that seed), or the first when none does;
    each attempt and its scores are in the sidecar, and the job is one image."""
    models = ("--clip-model", SCORES / "clip", "--aesthetic-model", SCORES / "aesthetic.safetensors")
    seeds = [5, reroll_seed(5, 1), reroll_seed(5, 2)]
    plain = {}
    for seed in seeds:  # what each attempt's seed renders, ungated
        code, _, err = cli("render", "a red lighthouse", "--model", tiny_sd, "--out", tmp_path / f"p{seed}",
                           "--campaign", "c", "--seed", seed, "--steps", STEPS, "--width", 64, "--height", 64,
                           "--score", "aesthetic", "--quiet", *models)
        assert code == 0, err
        [record] = [json.loads(line) for line in (tmp_path / f"p{seed}" / "c" / "manifest.jsonl").read_text().splitlines()]
        plain[seed] = (record["scores"]["aesthetic"], (tmp_path / f"p{seed}" / "c" / f"{record['job_id']}.png"))
    first, second = plain[seeds[0]][0], plain[seeds[1]][0]
    assert first != second
    below = f"aesthetic {'>' if second > first else '<'} {(first + second) / 2!r}"  # fails seed 5, passes the next

    def gated(gate: str, rerolls: int) -> tuple[dict, np.ndarray]:
        out = tmp_path / f"g{len(list(tmp_path.iterdir()))}"
        job = json.dumps({"prompt": "a red lighthouse", "seed": 5, "gate": gate, "rerolls": rerolls,
                          "scores": ["aesthetic"]})
        (tmp_path / "job.jsonl").write_text(job + "\n")
        code, _, err = cli("render", "--prompts", tmp_path / "job.jsonl", "--model", tiny_sd, "--out", out,
                           "--campaign", "c", "--steps", STEPS, "--width", 64, "--height", 64, "--quiet", *models)
        assert code == 0, err
        [record] = [json.loads(line) for line in (out / "c" / "manifest.jsonl").read_text().splitlines()]
        return record, np.asarray(Image.open(out / "c" / f"{record['job_id']}.png"))

    record, pixels = gated(below, 2)
    assert (record["gate"]["passed"], record["gate"]["kept"], record["gate"]["seed"]) == (True, 1, seeds[1])
    assert [a["seed"] for a in record["gate"]["attempts"]] == seeds[:2]
    assert [a["passed"] for a in record["gate"]["attempts"]] == [False, True]
    assert record["scores"]["aesthetic"] == pytest.approx(second)
    np.testing.assert_array_equal(pixels, np.asarray(Image.open(plain[seeds[1]][1])))

    record, pixels = gated("aesthetic > 1e9", 2)  # none passes: the first is kept, all three tried
    assert (record["gate"]["passed"], record["gate"]["kept"]) == (False, 0)
    assert [a["seed"] for a in record["gate"]["attempts"]] == seeds
    np.testing.assert_array_equal(pixels, np.asarray(Image.open(plain[seeds[0]][1])))


@pytest.mark.parametrize("policy", ["black", "drop"])
def test_a_flagged_image_is_blacked_out_or_not_stored_as_its_job_asks(cli: Cli, tiny_sd: Path, tmp_path: Path,
                                                                      policy: str) -> None:
    """The tiny checker flags some images and not others: a flagged one is stored black (as
    diffusers' pipelines return it) or not at all (its sidecar and manifest line stay, so the
    job is done and a run again does not redo it); the others are stored as rendered."""
    base = render(cli, tiny_sd, tmp_path / "kept", "--score", "safety", *MODELS)
    assert {r["scores"]["nsfw"] for r in base} == {True, False}, "the tiny checker must flag some, not all"
    records = render(cli, tiny_sd, tmp_path / "out", "--score", "safety", "--on-nsfw", policy, *MODELS)
    folder = tmp_path / "out" / "scored"
    for record in records:
        png = folder / f"{record['job_id']}.png"
        kept = tmp_path / "kept" / "scored" / f"{base[[r['spec']['prompt'] for r in base].index(record['spec']['prompt'])]['job_id']}.png"
        if not record["scores"]["nsfw"]:
            np.testing.assert_array_equal(np.asarray(Image.open(png)), np.asarray(Image.open(kept)))
        elif policy == "black":
            assert record["on_nsfw"] == "black" and not np.asarray(Image.open(png)).any()
        else:
            assert (record["dropped"], record["png_sha256"]) == ("nsfw", None) and not png.exists()
            assert (folder / f"{record['job_id']}.json").exists()
    page = (folder / "index.html").read_text()
    shown = sum(f'<figure id="{r["job_id"]}"' in page for r in records)
    assert shown == (len(records) if policy == "black" else sum(not r["scores"]["nsfw"] for r in records))
