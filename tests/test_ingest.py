"""Campaign sources and specs, no broker: each source and the template expansion give the
jobs and seeds the rules say; bad rows are reported by line and skipped; bad specs name
key, value, rule and file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.campaigns import (
    CampaignSpec,
    campaign_jobs,
    load_spec,
    parse_spec,
    scan_campaign,
)
from renderfarm.jobs import JobError, JobSpec


def spec(tmp_path: Path, **keys: object) -> CampaignSpec:
    return parse_spec({"name": "c", "model": "org/m", "output": "out", "base_seed": 100, **keys}, tmp_path)


def seeds_and_prompts(s: CampaignSpec) -> list[tuple[str, int]]:
    return [(j.prompt, j.seed) for j in campaign_jobs(s)]


def test_txt_rows_skip_blank_lines_and_get_derived_seeds(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a fox\n\n  \nun château\r\nthird\n")
    s = spec(tmp_path, prompts="p.txt", images_per_prompt=3, steps=4, negative_prompt="blurry")
    jobs = list(campaign_jobs(s))
    assert [(j.prompt, j.seed) for j in jobs] == [(p, 100 + i * 3 + k) for i, p in
                                                  enumerate(["a fox", "un château", "third"]) for k in range(3)]
    assert jobs[0] == JobSpec(prompt="a fox", model="org/m", seed=100, steps=4, negative_prompt="blurry",
                              campaign="c")
    assert len({j.job_id for j in jobs}) == 9


def test_csv_per_row_columns_override_the_spec_and_others_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "p.csv").write_text(
        "id,text,steps,guidance_scale,width,scheduler,url\n"
        "1,a fox,,,,,x\n"
        '2,"two\nlines, quoted",7,3.5,640,ddim,y\n'
        "\n"
        "3,third,9,,,euler,z\n")
    s = spec(tmp_path, prompts="p.csv", prompt_column="text", steps=20, images_per_prompt=2)
    jobs = list(campaign_jobs(s))
    assert [(j.prompt, j.seed, j.steps, j.guidance_scale, j.width, j.scheduler) for j in jobs] == [
        ("a fox", 100, 20, None, None, None), ("a fox", 101, 20, None, None, None),
        ("two\nlines, quoted", 102, 7, 3.5, 640, "ddim"), ("two\nlines, quoted", 103, 7, 3.5, 640, "ddim"),
        ("third", 104, 9, None, None, "euler"), ("third", 105, 9, None, None, "euler")]
    assert scan_campaign(s).ignored_columns == ("id", "url")


def test_sampler_and_lora_keys_reach_every_job(tmp_path: Path) -> None:
    """A spec's timestep_spacing, karras, base and loras go into each job (and so its id and
    queue); a CSV row may set its own spacing and karras (true/false, 1/0, yes/no)."""
    (tmp_path / "p.csv").write_text("prompt,timestep_spacing,karras\na,,\nb,leading,no\nc,,maybe\n")
    s = spec(tmp_path, prompts="p.csv", scheduler="dpm", timestep_spacing="trailing", karras=True,
             loras=["style.safetensors:0.8", "detail.safetensors"])
    scan = scan_campaign(s)
    assert [str(b) for b in scan.first_bad] == ["line 4: karras='maybe': must be true or false"]
    jobs = list(campaign_jobs(s))
    assert [(j.timestep_spacing, j.karras) for j in jobs] == [("trailing", True), ("leading", False)]
    assert {j.loras for j in jobs} == {(("style.safetensors", 0.8), ("detail.safetensors", 1.0))}
    assert parse_spec(s.to_dict(), tmp_path) == s  # a stored schedule reads back the same
    with pytest.raises(JobError, match="karras=True: needs a scheduler with Karras sigmas"):
        spec(tmp_path, prompts="p.csv", scheduler="euler_a", karras=True)


def test_csv_bad_rows_are_reported_by_line_and_keep_other_rows_seeds(tmp_path: Path) -> None:
    (tmp_path / "p.csv").write_text(
        "prompt,steps\n"
        "good 0,3\n"          # line 2, row 0
        '"multi\nline",zz\n'  # lines 3-4, row 1: steps not a number
        "good 2,0\n"          # line 5, row 2: steps out of range
        "good 3\n"            # line 6, row 3: one cell short
        ",4\n"                # line 7, row 4: empty prompt
        "good 5,4\n")         # line 8, row 5
    s = spec(tmp_path, prompts="p.csv")
    scan = scan_campaign(s)
    assert (scan.rows, scan.bad_rows, scan.jobs) == (6, 4, 2)
    assert [str(b) for b in scan.first_bad] == [
        "line 3: steps='zz': must be an integer", "line 5: steps=0: must be in 1..500",
        "line 6: row=['good 3']: must have 2 cells like the header", "line 7: prompt='': must not be empty"]
    assert seeds_and_prompts(s) == [("good 0", 100), ("good 5", 105)]


def test_parquet_rows_typed_columns_and_nulls(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["a", "b", None, "d"], "steps": [3, None, 4, 600],
                      "negative_prompt": [None, "ugly", None, None], "caption_id": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    s = spec(tmp_path, prompts="p.parquet")
    scan = scan_campaign(s)
    assert [str(b) for b in scan.first_bad] == ["row 3: prompt=None: is required",
                                                "row 4: steps=600: must be in 1..500"]
    assert scan.ignored_columns == ("caption_id",)
    assert [(j.prompt, j.seed, j.steps, j.negative_prompt) for j in campaign_jobs(s)] == [
        ("a", 100, 3, ""), ("b", 101, 25, "ugly")]


def test_jsonl_rows_bad_json_and_spec_only_keys(tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": "a", "priority": 9, "note": "x"}), "{broken", json.dumps({"prompt": "c", "seed": 5}),
            "", json.dumps({"prompt": "d", "model": "other/m", "height": 128})]
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    s = spec(tmp_path, prompts="p.jsonl")
    scan = scan_campaign(s)
    assert [str(b) for b in scan.first_bad] == [
        "line 2: line='{broken': must be a JSON object (Expecting property name enclosed in double quotes)",
        "line 3: seed=5: may not be set per row: seeds derive from base_seed and the row's position"]
    assert [(j.prompt, j.seed, j.priority, j.model, j.height) for j in campaign_jobs(s)] == [
        ("a", 100, 9, "org/m", None), ("d", 103, None, "other/m", 128)]
    assert scan.ignored_columns == ("note",)


def test_a_seed_column_in_csv_is_a_spec_error(tmp_path: Path) -> None:
    (tmp_path / "p.csv").write_text("prompt,seed\na,1\n")
    with pytest.raises(JobError, match="has a column 'seed', which may not be set per row"):
        scan_campaign(spec(tmp_path, prompts="p.csv"))
    with pytest.raises(JobError, match=r"prompt_column='text': must be a column of .*p.csv \(it has: prompt, seed\)"):
        scan_campaign(spec(tmp_path, prompts="p.csv", prompt_column="text"))


def test_template_combinatorial_expands_every_combination_in_order(tmp_path: Path) -> None:
    s = spec(tmp_path, template="a {red|blue} {cat|dog}", images_per_prompt=2)
    assert seeds_and_prompts(s) == [("a red cat", 100), ("a red cat", 101), ("a red dog", 102),
                                    ("a red dog", 103), ("a blue cat", 104), ("a blue cat", 105),
                                    ("a blue dog", 106), ("a blue dog", 107)]
    capped = spec(tmp_path, templates=["a {red|blue} {cat|dog}", "{x|y}"], samples=3)
    assert seeds_and_prompts(capped) == [("a red cat", 100), ("a red dog", 101), ("a blue cat", 102),
                                         ("x", 103), ("y", 104)]


def test_template_random_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    template = "a {red|blue|green|white} {cat|dog|fox|owl} in {rain|snow|fog}"
    s = spec(tmp_path, template=template, mode="random", samples=20, template_seed=7)
    first = seeds_and_prompts(s)
    assert first == seeds_and_prompts(spec(tmp_path, template=template, mode="random", samples=20,
                                           template_seed=7))
    assert [seed for _, seed in first] == list(range(100, 120))
    assert len({p for p, _ in first}) > 5
    other = seeds_and_prompts(spec(tmp_path, template=template, mode="random", samples=20, template_seed=8))
    assert [p for p, _ in other] != [p for p, _ in first]
    with pytest.raises(JobError, match="samples=None: is required with mode random"):
        spec(tmp_path, template=template, mode="random")


def test_template_wildcards_from_a_folder(tmp_path: Path) -> None:
    wildcards = tmp_path / "wildcards"
    (wildcards / "styles").mkdir(parents=True)
    (wildcards / "animal.txt").write_text("owl\n# a comment\nfox\n")
    (wildcards / "styles" / "paint.txt").write_text("oil\nwatercolour of a __animal__\n")
    s = spec(tmp_path, template="__styles/paint__, __animal__", wildcards="wildcards")
    assert [p for p, _ in seeds_and_prompts(s)] == [
        "oil, fox", "oil, owl", "watercolour of a fox, fox", "watercolour of a fox, owl",
        "watercolour of a owl, fox", "watercolour of a owl, owl"]
    with pytest.raises(JobError, match=r"uses wildcard __colour__, which needs a file colour.txt"):
        spec(tmp_path, template="a __colour__ cat", wildcards="wildcards")
    with pytest.raises(JobError, match="must be a valid dynamicprompts template"):
        spec(tmp_path, template="a {red|blue cat")


def test_spec_file_round_trip_and_replace(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a\nb\n")
    path = tmp_path / "campaign.yaml"
    path.write_text("name: lighthouses\nmodel: org/m\noutput: renders\nprompts: p.txt\nbase_seed: 5\n"
                    "images_per_prompt: 2\nsteps: 30\nguidance_scale: 6\nwidth: 512\nheight: 768\n"
                    "scheduler: euler\ndtype: bfloat16\npriority: 8\nschedule: '*/15 * * * *'\n")
    loaded = load_spec(path)
    assert (loaded.prompts, loaded.output) == (str(tmp_path / "p.txt"), str(tmp_path / "renders"))
    assert parse_spec(json.loads(json.dumps(loaded.to_dict())), "/elsewhere") == loaded
    templated = spec(tmp_path, template="{a|b}", mode="random", samples=2, template_seed=3)
    assert parse_spec(templated.to_dict(), "/elsewhere") == templated
    again = dataclasses.replace(loaded, name="lighthouses-20250101T0300", base_seed=99)
    assert [j.seed for j in campaign_jobs(again)] == [99, 100, 101, 102]
    with pytest.raises(JobError, match="name='a/b': must match"):
        dataclasses.replace(loaded, name="a/b")


BAD_SPECS = {
    "unknown key": ({"colour": "red"}, "colour='red': unknown key (known: base, base_seed,"),
    "wrong type": ({"steps": "ten"}, "steps='ten': must be an integer in 1..500"),
    "bad value": ({"guidance_scale": 99}, "guidance_scale=99: must be finite and in 0..50"),
    "missing": ({"base_seed": None}, "base_seed=None: is required"),
    "seed range": ({"base_seed": -1}, "base_seed=-1: must be in 0..4294967295"),
    "images": ({"images_per_prompt": 0}, "images_per_prompt=0: must be in 1..4294967296"),
    "two sources": ({"template": "{a|b}"}, "give exactly one source"),
    "file type": ({"prompts": "p.xlsx"}, "must be a file ending in .txt or .csv or .parquet or .jsonl"),
    "cron": ({"schedule": "every day"}, "schedule='every day': must be a cron expression"),
    "priority": ({"priority": 10}, "priority=10: must be in 0..9"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_specs_name_file_key_value_rule(case: str, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a\n")
    keys, message = BAD_SPECS[case]
    mapping = {"name": "c", "model": "m", "output": "out", "prompts": "p.txt", "base_seed": 0, **keys}
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps({k: v for k, v in mapping.items() if v is not None}) if case == "missing"
                    else json.dumps(mapping))
    with pytest.raises(JobError) as caught:
        load_spec(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


def test_seeds_past_2_32_are_an_error_before_any_job(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a\nb\nc\n")
    s = spec(tmp_path, prompts="p.txt", base_seed=2**32 - 5, images_per_prompt=2)
    with pytest.raises(JobError, match=r"line 3 \(row 2\) would get seeds up to 4294967296"):
        scan_campaign(s)


def _photo(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (200, 136)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def test_an_image_column_makes_image_jobs_one_per_strength_with_the_image_digest_in_the_id(tmp_path: Path) -> None:
    _photo(tmp_path / "photos" / "a.png", (200, 10, 10))
    _photo(tmp_path / "photos" / "b.jpg", (10, 200, 10), (300, 300))
    (tmp_path / "rows.csv").write_text("image,caption,strength\nphotos/a.png,a fox,\nphotos/b.jpg,a hare,0.9\n"
                                       "photos/missing.png,lost,\n")
    s = spec(tmp_path, prompts="rows.csv", prompt_column="caption", image_column="image", images_per_prompt=2,
             strength=[0.3, 0.7], steps=10, scheduler="euler")
    bad: list = []
    jobs = list(campaign_jobs(s, bad.append))
    # Row 0: 2 images x 2 strengths, each pair of strengths on one seed; row 1's own strength wins.
    assert [(j.prompt, j.seed, j.strength, j.width, j.height) for j in jobs] == [
        ("a fox", 100, 0.3, 192, 128), ("a fox", 100, 0.7, 192, 128),
        ("a fox", 101, 0.3, 192, 128), ("a fox", 101, 0.7, 192, 128),
        ("a hare", 102, 0.9, 256, 256), ("a hare", 103, 0.9, 256, 256)]
    assert jobs[0].init_image == str(tmp_path / "photos" / "a.png")  # relative to the source file
    assert len({j.job_id for j in jobs}) == 6 and {j.init_image_sha256 for j in jobs[:4]} == {jobs[0].init_image_sha256}
    assert [(row.where, row.error.field) for row in bad] == [("line 4", "init_image")]
    assert scan_campaign(s).shapes[("org/m", 192, 128, 10, "euler", True, True)] == 4
    # The same file with other bytes is a new job; the same bytes give the same ids again.
    assert [j.job_id for j in campaign_jobs(s)] == [j.job_id for j in jobs]
    _photo(tmp_path / "photos" / "a.png", (201, 10, 10))
    changed = list(campaign_jobs(s))
    assert changed[0].job_id != jobs[0].job_id and changed[4].job_id == jobs[4].job_id


def test_an_images_folder_is_a_source_with_one_prompt_for_every_image(tmp_path: Path) -> None:
    for name in ("b.png", "a.jpg", "sub/c.webp"):
        _photo(tmp_path / "in" / name, (9, 9, 9), (128, 128))
    (tmp_path / "in" / "notes.txt").write_text("not an image")
    s = spec(tmp_path, images="in", prompt="a watercolour", strength=0.5, steps=4, scheduler="ddim")
    jobs = list(campaign_jobs(s))
    assert [(Path(j.init_image).relative_to(tmp_path / "in").as_posix(), j.prompt, j.seed, j.strength)
            for j in jobs] == [("a.jpg", "a watercolour", 100, 0.5), ("b.png", "a watercolour", 101, 0.5),
                               ("sub/c.webp", "a watercolour", 102, 0.5)]
    assert s.source == str(tmp_path / "in") and parse_spec(s.to_dict(), "/elsewhere") == s


IMAGE_SPECS = {
    "no prompt": ({"images": "in"}, "prompt=None: goes with `images: FOLDER`"),
    "prompt without images": ({"prompts": "p.txt", "prompt": "x"}, "prompt='x': goes with `images: FOLDER`"),
    "missing folder": ({"images": "nowhere", "prompt": "x"}, "images="),
    "strength range": ({"prompts": "p.txt", "strength": [0.5, 1.5]}, "strength=1.5: must be"),
    "repeated strength": ({"prompts": "p.txt", "strength": [0.5, 0.5]}, "list of distinct strengths"),
}


@pytest.mark.parametrize("case", list(IMAGE_SPECS))
def test_bad_image_specs_name_key_value_rule(case: str, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a\n")
    (tmp_path / "in").mkdir()
    keys, message = IMAGE_SPECS[case]
    with pytest.raises(JobError, match=None) as caught:
        spec(tmp_path, **keys)
    assert message in str(caught.value), str(caught.value)
