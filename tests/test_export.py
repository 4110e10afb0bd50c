"""`renderfarm export` read back with the real libraries: datasets, webdataset, pyarrow."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from producer import export as export_module
from renderfarm.jobs import JobError
from renderfarm.layout import image_name
from renderfarm.storage import Storage, open_storage
from renderfarm_cli import main
from harness.gcs_emulator import GcsEmulator
from tests.helpers import COLOURS, HOSTILE, append_raw, store_results


@pytest.fixture()
def campaign(sd_model: Any, tmp_path: Path) -> tuple[Storage, list[dict[str, Any]]]:
    """Five stored results; the manifest also holds a redelivered job's second line."""
    storage = open_storage(str(tmp_path / "renders"))
    records = store_results(storage, sd_model, "c1", COLOURS, prompts=["a red square", *HOSTILE, "a", "b"])
    append_raw(storage, "c1", [json.dumps(records[1])])  # as an older release could leave it
    return storage, records


def run(source: Storage, fmt: str, to: Path, *extra: str) -> int:
    return main(["export", "c1", "--from", source.describe(), "--format", fmt, "--to", str(to), "--quiet", *extra])


def same_fields(row: dict[str, Any], record: dict[str, Any]) -> None:
    """Every sidecar field came through (dict fields as JSON), plus prompt and seed."""
    for key, value in record.items():
        assert (json.loads(row[key]) if isinstance(value, dict) else row[key]) == value, key
    assert (row["prompt"], row["seed"]) == (record["spec"]["prompt"], record["spec"]["seed"])


def test_imagefolder_loads_with_datasets(campaign: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, records = campaign
    out = tmp_path / "imagefolder"
    assert run(source, "imagefolder", out, "--shard-size", "2") == 0
    summary = capsys.readouterr().out
    assert f"exported 5 images of c1 as imagefolder: 8 files written to {out.as_uri()}" in summary
    assert "1 duplicate manifest lines exported once" in summary
    assert sorted(p.name for p in out.iterdir()) == ["000000", "000001", "000002"]

    ds = datasets.load_dataset("imagefolder", data_dir=str(out), split="train",
                               cache_dir=str(tmp_path / "hf")).cast_column("image", datasets.Image(decode=False))
    assert len(ds) == 5
    by_id = {row["job_id"]: row for row in ds}
    assert set(by_id) == {r["job_id"] for r in records}
    for record in records:
        row = by_id[record["job_id"]]
        same_fields(row, record)
        assert Path(row["image"]["path"]).read_bytes() == source.get(image_name("c1", record["job_id"]))
    decoded = datasets.load_dataset("imagefolder", data_dir=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert {row["image"].getpixel((5, 5)) for row in decoded} == set(COLOURS)


def test_webdataset_shards_read_back(campaign: tuple, tmp_path: Path) -> None:
    source, records = campaign
    out = tmp_path / "wds"
    assert run(source, "webdataset", out, "--shard-size", "2") == 0
    shards = sorted(str(p) for p in out.iterdir())
    assert [Path(p).name for p in shards] == ["c1-000000.tar", "c1-000001.tar", "c1-000002.tar"]

    raw = list(wds.WebDataset(shards, shardshuffle=False))
    assert [s["__key__"] for s in raw] == [r["job_id"] for r in records]  # manifest order, each job once
    for sample, record in zip(raw, records):
        assert sample["png"] == source.get(image_name("c1", record["job_id"]))
        assert json.loads(sample["json"]) == record == json.loads(source.get(f"c1/{record['job_id']}.json"))
    decoded = list(wds.WebDataset(shards, shardshuffle=False).decode("pil").to_tuple("png", "json"))
    assert [(img.getpixel((0, 0)), meta["spec"]["prompt"]) for img, meta in decoded] == \
        [(c, r["spec"]["prompt"]) for c, r in zip(COLOURS, records)]


def test_parquet_reads_back_with_pyarrow_and_datasets(campaign: tuple, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    source, records = campaign
    monkeypatch.setattr(export_module, "ROW_GROUP_ROWS", 2)
    out = tmp_path / "parquet"
    assert run(source, "parquet", out, "--shard-size", "3") == 0
    files = sorted(out.iterdir())
    assert [p.name for p in files] == ["c1-000000.parquet", "c1-000001.parquet"]
    assert [pq.ParquetFile(p).metadata.num_row_groups for p in files] == [2, 1]  # streamed in row groups

    rows = pq.read_table(out).to_pylist()
    assert [row["job_id"] for row in rows] == [r["job_id"] for r in records]
    for row, record in zip(rows, records):
        same_fields(row, record)
        assert row["image"] == {"bytes": source.get(image_name("c1", record["job_id"])),
                                "path": f"{record['job_id']}.png"}
    schema = pq.read_schema(files[0])  # a text job's source columns are typed nulls, as its scores are
    assert [str(schema.field(name).type) for name in ("init_image", "strength")] == ["string", "double"]
    ds = datasets.load_dataset("parquet", data_files=[str(p) for p in files], split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert isinstance(ds.features["image"], datasets.Image)
    assert [row["image"].getpixel((1, 1)) for row in ds] == COLOURS


def test_export_between_gcs_buckets(sd_model: Any, gcs: GcsEmulator) -> None:
    bucket = f"x-{uuid.uuid4().hex[:10]}"
    gcs.create_bucket(bucket)
    source = open_storage(f"gs://{bucket}/renders")
    records = store_results(source, sd_model, "c1", COLOURS[:3])
    report = export_module.export(source, "c1", "parquet", open_storage(f"gs://{bucket}/exports/p"))
    assert (report.images, report.files) == (3, ["c1-000000.parquet"])
    data = open_storage(f"gs://{bucket}/exports/p").get("c1-000000.parquet")
    table = pq.read_table(io.BytesIO(data))
    assert table.column("job_id").to_pylist() == [r["job_id"] for r in records]
    assert [Image.open(io.BytesIO(i["bytes"])).getpixel((0, 0)) for i in table.column("image").to_pylist()] == COLOURS[:3]


def test_missing_image_is_reported_and_the_rest_exported(campaign: tuple, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    source, records = campaign
    (source.root / "c1" / f"{records[2]['job_id']}.png").unlink()
    (source.root / "c1" / f"{records[3]['job_id']}.png").write_bytes(b"not the png the sidecar describes")
    append_raw(source, "c1", ['{"job_id": "../../etc"}', "{not json"])
    out = tmp_path / "wds"
    assert run(source, "webdataset", out) == 1
    captured = capsys.readouterr()
    assert "exported 3 images" in captured.out and "skipped unreadable manifest lines 7, 8" in captured.out
    assert f"skipped 2 jobs with a missing or corrupt PNG: {records[2]['job_id']}, {records[3]['job_id']}" in captured.out
    assert "images were not exported" in captured.err
    keys = [s["__key__"] for s in wds.WebDataset([str(out / "c1-000000.tar")], shardshuffle=False)]
    assert keys == [records[i]["job_id"] for i in (0, 1, 4)]


def test_bad_inputs_say_what_is_wrong(campaign: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, _ = campaign
    assert main(["export", "nope", "--from", str(source.root), "--format", "parquet", "--to", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "campaign='nope': no such campaign" in err and f"{source.root / 'nope'}/ has no manifest" in err

    with pytest.raises(SystemExit):
        run(source, "zip", tmp_path / "o")
    assert "--format: invalid choice: 'zip' (choose from 'imagefolder', 'webdataset', 'parquet')" in capsys.readouterr().err
    with pytest.raises(JobError, match="format='zip': must be one of imagefolder, webdataset, parquet"):
        export_module.export(source, "c1", "zip", open_storage(str(tmp_path / "o")))

    assert main(["export", "../c1", "--from", str(source.root), "--format", "parquet", "--to", str(tmp_path / "o")]) == 2
    assert "campaign='../c1': must match [A-Za-z0-9._-]{1,128}" in capsys.readouterr().err
    assert run(source, "webdataset", tmp_path / "o", "--shard-size", "0") == 2
    assert "shard_size=0: must be an integer >= 1" in capsys.readouterr().err

    assert run(source, "webdataset", tmp_path / "o") == 0
    assert run(source, "parquet", tmp_path / "o") == 2  # never mixes two exports silently
    assert f"to='{(tmp_path / 'o').as_uri()}': is not empty" in capsys.readouterr().err
    assert run(source, "webdataset", tmp_path / "o", "--overwrite") == 0


def test_an_image_jobs_source_and_strength_are_columns_of_their_own() -> None:
    spec = {"prompt": "a fox", "seed": 3, "init_image": "gs://b/photos/a.png", "init_image_sha256": "ab" * 32,
            "strength": 0.6}
    row = export_module.columns({"job_id": "j", "spec": spec})
    assert (row["init_image"], row["init_image_sha256"], row["strength"]) == ("gs://b/photos/a.png", "ab" * 32, 0.6)
    text = export_module.columns({"job_id": "k", "spec": {"prompt": "a fox", "seed": 3}})
    assert (text["init_image"], text["init_image_sha256"], text["strength"]) == (None, None, None)
