"""Model loading: one path for every model reference, so tests exercise what users run.

A reference is a hub id (optionally `@revision`), a local diffusers folder, or a `gs://`
folder copied once into a local cache. Every kind is first resolved to a local folder, then
loaded by the same code: the family from model_index.json (worker/families), each
component's network from its config.json (worker/nn), its weights from safetensors or Flax
msgpack (worker/weights.py; never a pickle), the tokenizers (worker/tokenizer.py) and the
scheduler config. Nothing here imports torch, diffusers or transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from renderfarm.jobs import DTYPES as JOB_DTYPES
from renderfarm.jobs import SCHEDULERS, JobError, check_variant
from renderfarm.storage import open_storage
from worker.families import detect
from worker.family import Family, Networks
from worker.schedulers import CLASS_NAMES
from worker.tokenizer import CLIPTokenizer, TokenizerError
from worker.weights import load_weights

DTYPES = {name: jnp.dtype(name) for name in JOB_DTYPES}
# What a hub snapshot needs: configs, tokenizer files and weights; never a pickle.
HUB_CONFIGS = ["*.json", "*.txt"]


@dataclasses.dataclass
class LoadedModel:
    """A pipeline's networks, weights (on the host), tokenizers and configs, and where they
    came from."""

    ref: str
    revision: str | None
    family: Family
    dtype: str
    variant: str | None
    networks: Networks
    params: dict[str, Any]  # component -> parameter tree (numpy)
    tokenizers: list[CLIPTokenizer]
    configs: dict[str, dict[str, Any]]  # component -> config.json, "scheduler" included

    @property
    def vae_scale_factor(self) -> int:
        return self.networks["vae"].config.scale_factor

    @property
    def size_step(self) -> int:
        """Pixels per step of width/height: VAE factor x UNet downsampling."""
        return self.vae_scale_factor * 2 ** (len(self.networks["unet"].config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.networks["unet"].config.sample_size) * self.vae_scale_factor

    @property
    def default_scheduler(self) -> str:
        """The job contract's name of the model's own scheduler."""
        name = self.configs["scheduler"].get("_class_name")
        if name not in CLASS_NAMES:
            raise JobError("scheduler", None, f"the model's own scheduler is {name!r}, which the farm does not "
                                              f"run: name one of {', '.join(SCHEDULERS)}")
        return CLASS_NAMES[name]


def split_ref(ref: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); folders and URLs keep any `@` they contain."""
    if "@" in ref and not ref.startswith("gs://") and not Path(ref).exists():
        name, _, revision = ref.rpartition("@")
        return name, revision or None
    return ref, None


def cache_root() -> Path:
    return Path(os.environ.get("RENDERFARM_MODEL_CACHE", Path.home() / ".cache" / "renderfarm" / "models"))


def contained(url: str, names: list[str]) -> list[str]:
    """The object names of a gs:// folder, each checked to stay inside it once it is a local
    path: names are whatever the bucket's writers chose, and are checked before anything is
    written."""
    for name in names:
        if name.startswith("/") or "\\" in name or any(part in ("", ".", "..") for part in name.split("/")):
            raise JobError("model", url, f"holds an object named {name!r}, which would be written outside "
                                         "the model's folder: refused")
    return names


def _fetch_gcs_folder(url: str) -> Path:
    """Copy a gs:// model folder into the local cache once (with a progress bar); a marker
    says the copy is whole."""
    target = cache_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    marker = target / ".complete"
    if marker.exists():
        return target
    store = open_storage(url)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    names = contained(url, list(store.list("")))
    if not names:
        raise JobError("model", url, "is an empty or missing gs:// folder")
    with tqdm(total=len(names), unit="file", desc=f"copying {url}", file=sys.stderr) as bar:
        for name in names:
            dest = partial / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(store.get(name))
            bar.update(1)
    (partial / ".complete").write_text(url)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def hub_patterns(variant: str | None) -> list[str]:
    """What to fetch of a hub repo: configs, tokenizer files, and the weights of `variant`
    (safetensors, sharded or not; Flax msgpack when no variant is asked for), nothing else:
    a repo often holds every format and variant of the same weights, and pickles."""
    if variant is None:
        return [*HUB_CONFIGS, "*model.safetensors", "*model-*-of-*.safetensors", "*.msgpack"]
    return [*HUB_CONFIGS, f"*.{variant}.safetensors", f"*.{variant}-*-of-*.safetensors"]


def resolve(ref: str, variant: str | None = None) -> tuple[Path, str | None]:
    """Any model reference -> (local diffusers folder, revision or None)."""
    if ref.startswith("gs://"):
        return _fetch_gcs_folder(ref), None
    local = Path(ref.removeprefix("file://")).expanduser()
    if local.exists() or ref.startswith((".", "/", "~", "file://")):
        return local, None
    from huggingface_hub import snapshot_download

    repo, revision = split_ref(ref)
    try:  # huggingface_hub shows a progress bar per file while it downloads
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=hub_patterns(variant)))
    except Exception as err:  # the hub client raises many types; the user needs the reason
        raise JobError("model", ref, f"could not be resolved on the hub or its cache ({err})") from err
    return folder, folder.name  # a snapshot folder is named by its commit


def _read_json(ref: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobError("model", ref, f"has no {path.parent.name}/{path.name}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise JobError("model", ref, f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise JobError("model", ref, f"{path}: must be a JSON object")
    return data


def load_model(ref: str, dtype: str = "float32", variant: str | None = None) -> LoadedModel:
    """Load a diffusers pipeline folder (any reference) for the farm. With bfloat16 the
    weights are cast; the schedulers keep their state in float32 whatever the dtype."""
    if dtype not in DTYPES:
        raise JobError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if variant is not None:
        check_variant(variant)
    folder, revision = resolve(ref, variant)
    if not (folder / "model_index.json").is_file():
        raise JobError("model", ref, "must be a diffusers pipeline folder (no model_index.json found)")
    index = _read_json(ref, folder / "model_index.json")
    family = detect(ref, index)
    configs = {name: _read_json(ref, folder / name / "config.json") for name in family.components}
    configs["scheduler"] = _read_json(ref, folder / "scheduler" / "scheduler_config.json")
    modules, params = {}, {}
    for name, component in family.components.items():
        try:
            config = component.config.from_dict(configs[name])
        except (ValueError, TypeError) as err:
            raise JobError("model", ref, f"{name}/config.json: {err}") from None
        modules[name] = component.module(config, dtype=DTYPES[dtype])
        expected = jax.eval_shape(modules[name].init_params, jax.random.PRNGKey(0))
        params[name] = load_weights(folder, name, component.kind, expected, DTYPES[dtype], variant)
    try:
        tokenizers = [CLIPTokenizer.from_folder(folder / name) for name in family.tokenizers]
    except TokenizerError as err:
        raise JobError("model", ref, str(err)) from None
    networks = Networks(tuple(modules.items()), bool(index.get("force_zeros_for_empty_prompt", True)))
    return LoadedModel(ref=ref, revision=revision, family=family, dtype=dtype, variant=variant, networks=networks,
                       params=params, tokenizers=tokenizers, configs=configs)
