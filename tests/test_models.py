"""One loader for every model reference: local folder, gs:// folder, hub id@revision (offline)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusion import models
from diffusion.models import LoadedModel, contained, load_model, resolve_file, set_bucket_opener
from diffusion.schedulers import make
from renderfarm.jobs import JobError
from renderfarm.storage import open_storage
from harness.gcs_emulator import GcsEmulator


def same_params(a: LoadedModel, b: LoadedModel) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a.params["unet"]), jax.tree.leaves(b.params["unet"])
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_local_folder(sd_model: LoadedModel, sdxl_model: LoadedModel) -> None:
    assert (sd_model.family.name, sdxl_model.family.name) == ("sd", "sdxl")
    assert sd_model.native_size == 64 and sd_model.revision is None
    assert [name for name, _ in sdxl_model.networks.modules] == ["text_encoder", "text_encoder_2", "unet", "vae"]


@pytest.fixture
def buckets() -> Iterator[None]:
    """gs:// references read through the farm's storage layer, as `renderfarm worker` and `render` set it."""
    set_bucket_opener(open_storage)
    yield
    models._bucket_opener.clear()


def test_a_bucket_reference_without_a_bucket_reader_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model layer imports no storage client: a program that set no reader is told so."""
    monkeypatch.setattr(models, "_bucket_opener", [])  # as in a process that never set one
    with pytest.raises(JobError, match=r"model='gs://models/x': .*no bucket reader.*set_bucket_opener"):
        load_model("gs://models/x")
    with pytest.raises(JobError, match=r"loras='gs://weights/l.safetensors': .*no bucket reader"):
        resolve_file("gs://weights/l.safetensors", "loras")


def test_gcs_folder_copied_once(buckets: None, tiny_sd: Path, sd_model: LoadedModel, gcs: GcsEmulator) -> None:
    gcs.create_bucket("models")
    bucket = open_storage("gs://models/tiny-sd")
    for path in tiny_sd.rglob("*"):
        if path.is_file():
            bucket.put(path.relative_to(tiny_sd).as_posix(), path.read_bytes())
    loaded = load_model("gs://models/tiny-sd")
    assert loaded.family.name == "sd" and same_params(loaded, sd_model)
    gcs.stop()  # a second load needs no bucket: it is served from the local cache
    try:
        assert same_params(load_model("gs://models/tiny-sd"), sd_model)
    finally:
        gcs.start()


def test_hub_id_with_revision_offline(tiny_sd: Path, sd_model: LoadedModel) -> None:
    """Lay out a hub cache as huggingface_hub does, then load `org/name@revision` offline."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(constants.HF_HUB_CACHE) / "models--acme--tiny-sd"
    shutil.copytree(tiny_sd, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text(commit)
    loaded = load_model("acme/tiny-sd@v1")
    assert (loaded.ref, loaded.revision, loaded.family.name) == ("acme/tiny-sd@v1", commit, "sd")
    assert same_params(loaded, sd_model)
    with pytest.raises(JobError, match="model='acme/tiny-sd@v2'"):
        load_model("acme/tiny-sd@v2")


def test_not_a_pipeline_folder(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    with pytest.raises(JobError) as err:
        load_model(str(tmp_path / "weights"))
    assert err.value.field == "model" and "model_index.json" in err.value.rule


def test_bfloat16_keeps_scheduler_float32(tiny_sd: Path) -> None:
    model = load_model(str(tiny_sd), dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(model.params["unet"])} == {jnp.dtype(jnp.bfloat16)}
    state = make(model.default_scheduler, model.configs["scheduler"]).set_timesteps(3, (1, 4, 8, 8))
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    assert floats and {jnp.asarray(x).dtype for x in floats} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", ["unet/../../../escaped.txt", "/etc/cron.d/x", "unet//x", "./x", "a\\..\\x"])
def test_object_names_that_leave_the_model_folder_are_refused(name: str) -> None:
    with pytest.raises(JobError, match=f"holds an object named {re.escape(repr(name))}"):
        contained("gs://b/m", ["model_index.json", name])
    assert contained("gs://b/m", ["model_index.json", "unet/config.json"]) == ["model_index.json", "unet/config.json"]


def test_a_gcs_folder_with_an_object_named_outside_it_is_refused_before_anything_is_written(
        buckets: None, tiny_sd: Path, gcs: GcsEmulator) -> None:
    from renderfarm.storage import make_gcs_client

    gcs.create_bucket("hostile-models")
    bucket = make_gcs_client().bucket("hostile-models")
    for path in tiny_sd.rglob("*"):
        if path.is_file():
            bucket.blob(f"m/{path.relative_to(tiny_sd).as_posix()}").upload_from_filename(str(path))
    bucket.blob("m/unet\\..\\x").upload_from_string(b"a name the emulator keeps as it is")
    with pytest.raises(JobError, match="holds an object named"):
        load_model("gs://hostile-models/m")
    assert not list(Path(os.environ["RENDERFARM_MODEL_CACHE"]).glob("*partial*"))


def test_the_worker_imports_no_torch_diffusers_or_transformers() -> None:
    """The model layer is the project's own: loading and rendering need none of them. Nor does
    starting a worker or a render import scipy (the perceptual hash's) or Pallas's TPU kernels
    (splash attention's): each would add a tenth of a second or more to every start."""
    import subprocess
    import sys

    code = ("import sys, worker.engine, diffusion.models, worker.farm, diffusion.tiny, worker.commands, worker.local\n"
            "bad = sorted(m for m in ('torch', 'diffusers', 'transformers', 'scipy', 'jax.experimental.pallas')"
            " if m in sys.modules)\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_hub_gives_configs_tokenizer_files_and_the_asked_weights_only() -> None:
    """What snapshot_download's allow_patterns (fnmatch, as huggingface_hub applies them)
    select of a typical SDXL repo: never a pickle, never another variant's weights."""
    from fnmatch import fnmatch

    from diffusion.models import hub_patterns

    repo = ["model_index.json", "scheduler/scheduler_config.json", "tokenizer/vocab.json", "tokenizer/merges.txt",
            "tokenizer/special_tokens_map.json", "text_encoder/config.json", "text_encoder/model.safetensors",
            "text_encoder/model.fp16.safetensors", "text_encoder/pytorch_model.bin", "text_encoder/flax_model.msgpack",
            "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
            "unet/diffusion_pytorch_model.safetensors.index.json",
            "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_pytorch_model.bin",
            "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors", "vae/diffusion_flax_model.msgpack",
            "sd_xl_base_1.0.safetensors", "sd_xl_base_1.0.ckpt", "README.md", "images/example.png"]

    def fetched(variant: str | None, components: list[str] | None = None) -> set[str]:
        return {name for name in repo if any(fnmatch(name, pattern) for pattern in hub_patterns(variant, components))}

    configs = {name for name in repo if name.endswith((".json", ".txt"))}
    assert fetched(None) == configs | {
        "text_encoder/model.safetensors", "text_encoder/flax_model.msgpack", "unet/diffusion_pytorch_model.safetensors",
        "unet/diffusion_pytorch_model-00001-of-00002.safetensors", "vae/diffusion_flax_model.msgpack"}
    assert fetched("fp16") == configs | {
        "text_encoder/model.fp16.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors",
        "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors"}
    # a single file's base: the weights of the components the file does not hold, configs of all
    assert fetched(None, ["text_encoder", "vae"]) == configs | {"text_encoder/model.safetensors",
                                                                "text_encoder/flax_model.msgpack",
                                                                "vae/diffusion_flax_model.msgpack"}
    assert fetched(None, []) == configs


def test_weights_digests_are_computed_once_per_file(tmp_path: Path) -> None:
    """A restarted worker does not re-hash gigabytes: a file's sha256 is kept by its path, size
    and mtime (the cache is believed: a forged entry comes back), and hashed again once it changes."""
    from diffusion.digests import file_sha256

    cache = tmp_path / "cache" / "sha256.json"
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"weights one")
    assert file_sha256(weights, cache) == hashlib.sha256(b"weights one").hexdigest()
    entries = json.loads(cache.read_text())
    assert len(entries) == 1
    cache.write_text(json.dumps({key: "f" * 64 for key in entries}))
    assert file_sha256(weights, cache) == "f" * 64  # from the cache, not the file
    weights.write_bytes(b"weights two")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert file_sha256(weights, cache) == hashlib.sha256(b"weights two").hexdigest()


ORACLE = Path(__file__).parent / "data" / "oracle"
SINGLE = Path(__file__).parent / "data" / "single_file" / "sd1.safetensors"
LORA = Path(__file__).parent / "data" / "lora" / "sd1" / "kohya.safetensors"


def test_single_files_and_loras_from_gcs_and_the_hub(buckets: None, gcs: GcsEmulator, tmp_path: Path) -> None:
    """A single file and a LoRA load the same from a path, gs:// (copied once into the cache)
    and a hub file `org/repo/x.safetensors@revision` (the hub's cache, offline); the sidecar
    digests name the same bytes whatever the reference."""
    from huggingface_hub import constants

    base = str(ORACLE / "sd1" / "model")
    local = load_model(str(SINGLE), base=base, loras=((str(LORA), 0.7),))
    gcs.create_bucket("weights")
    bucket = open_storage("gs://weights/civitai")
    bucket.put("sd1.safetensors", SINGLE.read_bytes())
    bucket.put("loras/style.safetensors", LORA.read_bytes())
    from_gcs = load_model("gs://weights/civitai/sd1.safetensors", base=base,
                          loras=(("gs://weights/civitai/loras/style.safetensors", 0.7),))
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = Path(constants.HF_HUB_CACHE) / "models--acme--loras"
    (repo / "snapshots" / commit / "sd1").mkdir(parents=True)
    shutil.copy(LORA, repo / "snapshots" / commit / "sd1" / "style.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "v2").write_text(commit)
    from_hub = load_model(str(SINGLE), base=base, loras=(("acme/loras/sd1/style.safetensors@v2", 0.7),))
    for other in (from_gcs, from_hub):
        for component in local.params:
            assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(local.params[component]),
                                                            jax.tree.leaves(other.params[component])))
        assert [w["sha256"] for w in other.weights] == [w["sha256"] for w in local.weights]
    assert [w["file"] for w in from_gcs.weights] == ["gs://weights/civitai/sd1.safetensors",
                                                    "gs://weights/civitai/loras/style.safetensors"]
    with pytest.raises(JobError, match="loras='gs://weights/civitai/nope.safetensors': no such object"):
        load_model(str(SINGLE), base=base, loras=(("gs://weights/civitai/nope.safetensors", 1.0),))
    with pytest.raises(JobError, match="loras='acme/loras/sd1/style.safetensors@v3': could not be resolved"):
        load_model(str(SINGLE), base=base, loras=(("acme/loras/sd1/style.safetensors@v3", 1.0),))
    with pytest.raises(JobError, match="loras='style.pt': is a pickle file, which is never loaded"):
        load_model(str(SINGLE), base=base, loras=(("style.pt", 1.0),))
