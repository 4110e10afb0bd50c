"""The scores' contract on the farm's side (renderfarm/scores.py): the names a job may ask for,
the filter expressions and their errors, the near-duplicate search against a brute force, and
`renderfarm export --where / --dedup` on a stored campaign whose manifest carries scores."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from producer.campaigns import campaign_jobs, parse_spec
from harness.redis_server import RedisServer
from producer.status import format_status
from renderfarm.jobs import JobError, check_scores, parse_job
from renderfarm.scores import Expression, hamming, near_duplicates
from renderfarm.storage import open_storage
from renderfarm_cli import main
from tests.helpers import COLOURS, store_results, submitted


def test_a_job_asks_for_scores_which_do_not_change_its_id(tmp_path: Path) -> None:
    plain = parse_job({"prompt": "a fox", "model": "m", "seed": 1})
    scored = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "scores": ["phash", "safety"]})
    assert (plain.scores, scored.scores) == (None, ("safety", "phash"))
    assert scored.job_id == plain.job_id  # scores describe the pixels, they do not make them
    assert parse_job(scored.to_dict()) == scored
    with pytest.raises(JobError, match="scores='beauty': is not a score"):
        parse_job({"prompt": "a fox", "model": "m", "seed": 1, "scores": ["beauty"]})
    (tmp_path / "rows.txt").write_text("a\nb\n")
    spec = parse_spec({"name": "s", "model": "m", "output": "out", "prompts": "rows.txt", "base_seed": 0,
                       "scores": ["clip", "aesthetic"], "gate": "clip > 20", "rerolls": 2}, tmp_path)
    assert [(job.scores, job.gate, job.rerolls) for job in campaign_jobs(spec)] == [
        (("clip", "aesthetic"), "clip > 20", 2)] * 2
    gated = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "scores": ["clip"], "gate": "clip > 20"})
    assert gated.job_id != parse_job({**gated.to_dict(), "gate": None, "rerolls": None}).job_id  # keeps other pixels
    for bad, message in (({"gate": "clip > 2"}, "gate='clip > 2': reads clip: ask for it in scores"),
                         ({"rerolls": 2}, "rerolls=2: needs a gate"),
                         ({"scores": ["clip"], "gate": "clip > 2", "rerolls": 17}, "rerolls=17: must be in 0..16"),
                         ({"scores": ["clip"], "gate": "clip >"}, "gate='clip >': does not parse"),
                         ({"on_nsfw": "drop"}, "on_nsfw='drop': needs the safety score"),
                         ({"scores": ["safety"], "on_nsfw": "blur"}, "on_nsfw='blur': must be one of keep, black, drop")):
        with pytest.raises(JobError, match=re.escape(message)):
            parse_job({"prompt": "a fox", "model": "m", "seed": 1, **bad})
    assert parse_spec(spec.to_dict(), tmp_path) == spec
    with pytest.raises(JobError, match="scores='x': is not a score"):
        parse_spec({"name": "s", "model": "m", "output": "out", "prompts": "rows.txt", "base_seed": 0,
                    "scores": ["x"]}, tmp_path)


def test_scores_are_named_from_the_contract_in_its_order() -> None:
    assert check_scores(["phash", "clip", "phash"]) == ("clip", "phash")
    assert check_scores("safety") == ("safety",)
    with pytest.raises(JobError, match=r"scores='beauty': is not a score; the scores are safety, clip, aesthetic, "
                                       r"phash"):
        check_scores(["clip", "beauty"])
    with pytest.raises(JobError, match="scores=3: must be a list of score names"):
        check_scores(3)


@pytest.mark.parametrize(("text", "scores", "verdict"), [
    ("clip >= 28 and aesthetic >= 5.5 and not nsfw", {"clip": 30.0, "aesthetic": 6.0, "nsfw": False}, True),
    ("clip >= 28 and aesthetic >= 5.5 and not nsfw", {"clip": 30.0, "aesthetic": 6.0, "nsfw": True}, False),
    ("clip >= 28 or aesthetic > 7", {"clip": 20.0, "aesthetic": 7.5}, True),
    ("20 < clip <= 25", {"clip": 25.0}, True),
    ("not (clip < 10 or nsfw)", {"clip": 12.0, "nsfw": False}, True),
    ("nsfw == false", {"nsfw": False}, True),
    ("aesthetic >= 5", {"clip": 40.0}, None),  # the score it reads is missing
    ("clip > -1", {"clip": 0.0}, True),
    ("clip > -1", {"clip": -2.0}, False),
    ("aesthetic >= -0.25", {"aesthetic": -0.25}, True),
    ("-2 < clip < - 1", {"clip": -1.5}, True),  # a space after the minus is only a space
    ("aesthetic >= 5", None, None),
])
def test_an_expression_passes_what_its_scores_say(text: str, scores: Any, verdict: bool | None) -> None:
    assert Expression(text)(scores) == verdict


@pytest.mark.parametrize(("text", "rule"), [
    ("beauty > 3", "names 'beauty', not a score value (nsfw, clip, aesthetic)"),
    ("clip >= __import__('os').getpid()", "compares \"__import__('os').getpid()\""),
    ("clip.real > 3", "compares 'clip.real'"),
    ("clip >= 28 and", "does not parse at column"),
    ("clip + 1 > 3", "compares 'clip + 1'"),
    ("clip > 'x'", "holds \"'x'\""),
    ("", "must compare nsfw, clip and aesthetic"),
    ("clip > --1", "negates '-1': only a number may be negated, as in 'clip > -1'"),
    ("-clip < 3", "negates 'clip': only a number may be negated"),
    ("clip > -true", "negates 'true': only a number may be negated"),
    ("clip > -'x'", "negates \"'x'\": only a number may be negated"),
])
def test_an_expression_that_is_not_one_is_refused_naming_the_rule(text: str, rule: str) -> None:
    with pytest.raises(JobError) as caught:
        Expression(text)
    assert caught.value.field == "where" and rule in caught.value.rule, caught.value.rule
    assert caught.value.value == text and str(caught.value).startswith(f"where={text!r}: "), str(caught.value)


def test_near_duplicates_are_what_a_brute_force_in_order_finds() -> None:
    rng = random.Random(7)
    hashes: list[str | None] = [f"{rng.getrandbits(64):016x}" for _ in range(600)]
    for h in list(hashes[:150]):  # a few bits off, and exact repeats
        flipped = int(h, 16)
        for _ in range(rng.randrange(0, 7)):
            flipped ^= 1 << rng.randrange(64)
        hashes.append(f"{flipped:016x}")
    hashes += [None, hashes[3], "0" * 16, "0" * 15 + "f"]
    rng.shuffle(hashes)
    for distance in (0, 2, 4, 9):
        kept: list[str] = []
        expected = []
        for h in hashes:
            near = h is not None and any(hamming(h, k) <= distance for k in kept)
            expected.append(near)
            if h is not None and not near:
                kept.append(h)
        assert near_duplicates(hashes, distance) == expected, distance
    with pytest.raises(JobError, match="dedup=33: must be a whole Hamming distance from 0 to 32 bits"):
        near_duplicates(hashes, 33)


SCORED = [  # per stored job, in seed order: what its manifest line says of it
    {"nsfw": False, "clip": 31.0, "aesthetic": 6.1, "phash": "f0f0f0f0f0f0f0f0"},
    {"nsfw": False, "clip": 29.5, "aesthetic": 5.9, "phash": "f0f0f0f0f0f0f0f1"},  # 1 bit from the first
    {"nsfw": True, "clip": 35.0, "aesthetic": 7.0, "phash": "0123456789abcdef"},
    {"nsfw": False, "clip": 12.0, "aesthetic": 4.0, "phash": "fedcba9876543210"},
    None,  # scored nothing
]


def test_export_keeps_what_passes_where_and_the_first_of_near_duplicates(
        sd_model: Any, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    storage = open_storage(str(tmp_path / "renders"))
    records = store_results(storage, sd_model, "scored", COLOURS)
    lines = [json.dumps({**r, **({"scores": s} if s else {})}) for r, s in zip(records, SCORED)]
    (tmp_path / "renders" / "scored" / "manifest.jsonl").write_text("\n".join(reversed(lines)) + "\n")

    def export(to: str, *extra: str) -> set[int]:
        assert main(["export", "scored", "--from", str(tmp_path / "renders"), "--format", "parquet",
                     "--to", str(tmp_path / to), "--quiet", *extra]) == 0
        table = pq.read_table(next((tmp_path / to).glob("*.parquet"))).to_pylist()
        return {[r["job_id"] for r in records].index(row["job_id"]) for row in table}

    assert export("all") == {0, 1, 2, 3, 4}
    assert export("passing", "--where", "clip >= 28 and not nsfw") == {0, 1}
    assert "3 left out by --where (1 without a score it reads)" in capsys.readouterr().out
    assert export("unique", "--dedup", "4") == {0, 2, 3, 4}  # the later of the near pair goes
    assert "1 near-duplicates left out by --dedup" in capsys.readouterr().out
    assert export("both", "--where", "aesthetic > 5", "--dedup", "1") == {0, 2}
    rows = pq.read_table(next((tmp_path / "all").glob("*.parquet"))).to_pylist()
    by_job = {[r["job_id"] for r in records].index(row["job_id"]): row for row in rows}
    for n, scores in enumerate(SCORED):  # each score a column of its own, empty where not scored
        assert {k: by_job[n][k] for k in SCORED[0]} == (scores or dict.fromkeys(SCORED[0])), n

    lines[4] = json.dumps({**records[4], "dropped": "nsfw", "png_sha256": None})  # on_nsfw: drop
    (tmp_path / "renders" / "scored" / f"{records[4]['job_id']}.png").unlink()
    (tmp_path / "renders" / "scored" / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert export("kept") == {0, 1, 2, 3}
    assert "1 flagged images were not stored (on_nsfw: drop)" in capsys.readouterr().out

    code = main(["export", "scored", "--from", str(tmp_path / "renders"), "--format", "parquet",
                 "--to", str(tmp_path / "bad"), "--where", "open('x')"])
    assert code == 2 and """where="open('x')": holds "open('x')": must compare""" in capsys.readouterr().err


@pytest.mark.parametrize("window", [None, 10])
def test_a_campaigns_pass_rates_count_each_done_image_once(redis_server: RedisServer,
                                                                  window: int | None) -> None:
    ids = ["a", "b", "c", "d"]
    progress = submitted(redis_server, "safe", ids, window)
    done = [("safe", i) for i in ids]
    verdicts = [(False, True), (True, False), (None, None), (False, None)]  # (nsfw, passed its gate)
    progress.finished(done[:3], [1.0] * 3, verdicts[:3])  # c asked for no safety score and had no gate
    progress.finished(done, [1.0] * 4, verdicts)  # a redelivery counts nothing twice
    report = progress.status("safe")
    assert (report["safety_checked"], report["nsfw"], report["safety_pass_rate"]) == (3, 1, pytest.approx(2 / 3))
    assert (report["gated"], report["gate_passed"], report["gate_pass_rate"]) == (2, 1, 0.5)
    text = format_status({**report, "queues": [], "workers": [], "warnings": [], "cost_per_1000_images": None})
    assert "safety            3 done images checked, 1 flagged nsfw (66.7% passed)" in text
    assert "gate              2 done images gated, 1 passed (50.0%)" in text
