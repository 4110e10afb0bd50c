"""The job contract: every rule names its field, value and rule; ids are content-derived."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from renderfarm.ingest import build_jobs, read_prompt_file
from renderfarm.jobs import JobError, JobSpec, parse_job

GOOD = {"prompt": "a fox", "model": "m", "seed": 1}


@pytest.mark.parametrize(("fields", "field", "rule"), [
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({"prompt": "x" * 10_001}, "prompt", "at most 10000 characters"),
    ({"prompt": 3}, "prompt", "must be a string"),
    ({"seed": -1}, "seed", "0..4294967295"),
    ({"seed": 2**32}, "seed", "0..4294967295"),
    ({"seed": True}, "seed", "integer"),
    ({"steps": 0}, "steps", "1..500"),
    ({"steps": 501}, "steps", "1..500"),
    ({"guidance_scale": float("nan")}, "guidance_scale", "finite"),
    ({"guidance_scale": float("inf")}, "guidance_scale", "finite"),
    ({"guidance_scale": 51}, "guidance_scale", "0..50"),
    ({"width": 100}, "width", "multiple of 16 (the finest size step of any model family)"),
    ({"height": 4096}, "height", "64..2048"),
    ({"scheduler": "heun"}, "scheduler", "one of pndm, ddim, lms, euler, dpm, euler_a, lcm"),
    ({"timestep_spacing": "karras"}, "timestep_spacing", "one of leading, trailing, linspace"),
    ({"karras": "yes"}, "karras", "must be true or false"),
    ({"karras": True, "scheduler": "ddim"}, "karras", "needs a scheduler with Karras sigmas (lms, euler, dpm), not ddim"),
    ({"timestep_spacing": "trailing", "scheduler": "lcm"}, "timestep_spacing", "does not apply to lcm"),
    ({"dtype": "float16"}, "dtype", "one of float32, bfloat16"),
    ({"campaign": "../etc"}, "campaign", "[A-Za-z0-9._-]{1,128}"),
    ({"campaign": ".."}, "campaign", "not be '.' or '..'"),
    ({"priority": 10}, "priority", "0..9"),
    ({"colour": "red"}, "colour", "unknown field"),
    ({"model": None}, "model", "is required"),
])
def test_each_rule_names_field_value_and_rule(fields: dict, field: str, rule: str) -> None:
    with pytest.raises(JobError) as err:
        parse_job({**GOOD, **fields})
    assert err.value.field == field
    assert rule in str(err.value) and field in str(err.value)


def test_defaults_and_model_size_step() -> None:
    spec = parse_job(GOOD)
    assert (spec.steps, spec.guidance_scale, spec.negative_prompt, spec.campaign) == (25, None, "", "local")
    assert parse_job({**GOOD, "width": 80}, size_step=16).width == 80
    # a Flux size (its step is 16): the producer, which does not know the model's family, takes it
    assert parse_job({**GOOD, "width": 1008}).width == 1008


def test_job_id_is_content_derived() -> None:
    a = parse_job(GOOD)
    assert a.job_id == parse_job(dict(GOOD)).job_id
    assert a.job_id == parse_job({**GOOD, "campaign": "other", "priority": 3}).job_id  # not pixels
    for change in ({"seed": 2}, {"prompt": "a dog"}, {"steps": 24}, {"guidance_scale": 7.0},
                   {"negative_prompt": "x"}, {"width": 64}, {"scheduler": "ddim"}, {"dtype": "bfloat16"},
                   {"model": "n"}, {"timestep_spacing": "trailing"}, {"karras": True}, {"karras": False}):
        assert parse_job({**GOOD, **change}).job_id != a.job_id, change


def test_seeds_follow_input_order(tmp_path: Path) -> None:
    rows = [(None, {"prompt": "a"}), (1, {"prompt": "b"}), (2, {"prompt": "c", "seed": 5})]
    specs = list(build_jobs(rows, {"model": "m"}, base_seed=100))
    assert [s.seed for s in specs] == [100, 101, 5]
    random_seeds = [s.seed for s in build_jobs(rows[:2], {"model": "m"})]
    assert all(0 <= s < 2**32 for s in random_seeds)


def test_jsonl_line_wins_over_flags_and_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "jobs.jsonl"
    good.write_text('{"prompt": "a", "steps": 3}\n\n{"prompt": "b"}\n')
    specs = list(build_jobs(read_prompt_file(good), {"model": "m", "steps": 7}, base_seed=0))
    assert [(s.prompt, s.steps) for s in specs] == [("a", 3), ("b", 7)]

    cases = {
        '{"prompt": "a"}\n{"prompt": "b", "steps": 0}\n': (2, "steps"),
        '{"prompt": "a"}\n{"prompt": "b"\n': (2, "line"),
        '["a list"]\n': (1, "line"),
        '{"prompt": ""}\n': (1, "prompt"),
    }
    for text, (line, field) in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(JobError) as err:
            list(build_jobs(read_prompt_file(bad), {"model": "m"}, base_seed=0))
        assert (err.value.line, err.value.field) == (line, field)
        assert f"line {line}:" in str(err.value)


def test_text_file_with_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"a fox\n\xff\xfe a dog\n")
    with pytest.raises(JobError) as err:
        list(read_prompt_file(bad))
    assert err.value.line == 2 and "UTF-8" in err.value.rule


def test_unknown_file_type(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="ending in .txt or .jsonl"):
        list(read_prompt_file(tmp_path / "prompts.csv"))


def test_producer_side_imports_without_jax() -> None:
    code = ("import sys, renderfarm_cli, renderfarm.jobs, renderfarm.storage, renderfarm.ingest;"
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_spec_round_trip() -> None:
    spec = parse_job({**GOOD, "priority": 2, "scheduler": "dpm"})
    assert JobSpec(**spec.to_dict()) == spec == parse_job(spec.to_dict())


def test_a_weights_variant_is_part_of_the_job_and_its_queue() -> None:
    import hashlib
    import json

    from renderfarm.queue import job_message

    plain = parse_job(GOOD)
    # Without a variant the id is what it was before jobs had one: old campaigns resume as they were.
    before = {"model": "m", "prompt": "a fox", "negative_prompt": "", "seed": 1, "steps": 25, "guidance_scale": 7.5,
              "width": None, "height": None, "scheduler": None, "dtype": "float32"}
    canonical = json.dumps(before, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert plain.job_id == hashlib.sha256(canonical.encode()).hexdigest()[:32]
    # A job without a guidance scale (its model family's default) keeps the id it had when the
    # contract's default was 7.5 for every model.
    assert plain.guidance_scale is None and parse_job({**GOOD, "guidance_scale": 7.5}).job_id == plain.job_id
    # ... and so are the sampler fields: unset, they leave the id alone.
    assert parse_job({**GOOD, "timestep_spacing": None, "karras": None}).job_id == plain.job_id
    fp16 = parse_job({**GOOD, "variant": "fp16"})
    assert fp16.job_id != plain.job_id  # other weights, other pixels
    assert job_message(fp16)["queue"] == "rf.float32.fp16.m" != job_message(plain)["queue"]
    for bad in ("FP16", "fp16/../x", "", 16):
        with pytest.raises(JobError, match=r"variant=.*: must match \[a-z0-9_\]\{1,32\}"):
            parse_job({**GOOD, "variant": bad})


def test_a_lora_set_and_a_base_are_part_of_the_job_and_its_queue() -> None:
    """A model reference is base + LoRAs + scales: each set has its own job ids and queue, and
    a job without them keeps the id it had before jobs could name them."""
    from renderfarm.queue import job_message

    plain = parse_job(GOOD)
    sets = [
        {"loras": ["style.safetensors"]},
        {"loras": ["style.safetensors:0.5"]},
        {"loras": ["other/style.safetensors"]},
        {"loras": ["style.safetensors", "detail.safetensors:0.8"]},
        {"loras": ["detail.safetensors:0.8", "style.safetensors"]},
        {"base": "org/base"},
    ]
    jobs = [parse_job({**GOOD, **fields}) for fields in sets]
    assert len({job.job_id for job in [plain, *jobs]}) == len(sets) + 1
    queues = {job_message(job)["queue"] for job in [plain, *jobs]}
    assert len(queues) == len(sets) + 1 and all(q.startswith("rf.float32.m") for q in queues)
    # the same set stated another way is the same job
    assert parse_job({**GOOD, "loras": [["style.safetensors", 1]]}).job_id == jobs[0].job_id
    assert parse_job({**GOOD, "loras": []}).job_id == parse_job({**GOOD, "loras": None}).job_id == plain.job_id
    assert parse_job({**GOOD, "loras": ["gs://b/x.safetensors"]}).loras == (("gs://b/x.safetensors", 1.0),)
    for bad, rule in ((["x:11"], "-10..10"), (["  "], "must not be empty"), ("x", "at most 16 LoRAs"),
                      ([["x", "y"]], "must be a number"), ([3], 'each must be "REF[:SCALE]"')):
        with pytest.raises(JobError, match=re.escape(rule)):
            parse_job({**GOOD, "loras": bad})
