"""Model loading: one path for every model reference, so tests exercise what users run.

A reference is a hub id (optionally `@revision`), a local diffusers folder, or a `gs://`
folder copied once into a local cache. Every kind is first resolved to a local folder,
then loaded by the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from renderfarm.jobs import JobError
from renderfarm.storage import open_storage

# What a Flax pipeline needs from a hub repo; torch weights are never fetched.
HUB_PATTERNS = ["*.json", "*.txt", "*.msgpack"]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SCHEDULER_NAMES = {
    "FlaxPNDMScheduler": "pndm", "PNDMScheduler": "pndm",
    "FlaxDDIMScheduler": "ddim", "DDIMScheduler": "ddim",
    "FlaxLMSDiscreteScheduler": "lms", "LMSDiscreteScheduler": "lms",
    "FlaxEulerDiscreteScheduler": "euler", "EulerDiscreteScheduler": "euler",
    "FlaxDPMSolverMultistepScheduler": "dpm", "DPMSolverMultistepScheduler": "dpm",
}


@dataclasses.dataclass
class LoadedModel:
    """A pipeline (module definitions), its parameters on the host, and where they came from."""

    ref: str
    revision: str | None
    family: str  # "sd" or "sdxl"
    dtype: str
    pipe: Any
    params: dict[str, Any]

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    @property
    def size_step(self) -> int:
        """Pixels per step of width/height: VAE factor x UNet downsampling."""
        return self.vae_scale_factor * 2 ** (len(self.pipe.unet.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.pipe.unet.config.sample_size) * self.vae_scale_factor

    @property
    def default_scheduler(self) -> str:
        return SCHEDULER_NAMES[type(self.pipe.scheduler).__name__]


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers warns on every Flax class use and about the disabled safety checker; users
    of the farm cannot act on either, so keep them out of their output."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    old = dlog.get_verbosity(), tlog.get_verbosity()
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Flax classes are deprecated.*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
            yield
    finally:
        dlog.set_verbosity(old[0])
        tlog.set_verbosity(old[1])


def split_ref(ref: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); folders and URLs keep any `@` they contain."""
    if "@" in ref and not ref.startswith("gs://") and not Path(ref).exists():
        name, _, revision = ref.rpartition("@")
        return name, revision or None
    return ref, None


def cache_root() -> Path:
    return Path(os.environ.get("RENDERFARM_MODEL_CACHE", Path.home() / ".cache" / "renderfarm" / "models"))


def _fetch_gcs_folder(url: str) -> Path:
    """Copy a gs:// model folder into the local cache once; a marker says the copy is whole."""
    target = cache_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    marker = target / ".complete"
    if marker.exists():
        return target
    store = open_storage(url)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    names = list(store.list(""))
    if not names:
        raise JobError("model", url, "is an empty or missing gs:// folder")
    for name in names:
        dest = partial / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(store.get(name))
    (partial / ".complete").write_text(url)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def resolve(ref: str) -> tuple[Path, str | None]:
    """Any model reference -> (local diffusers folder, revision or None)."""
    if ref.startswith("gs://"):
        return _fetch_gcs_folder(ref), None
    local = Path(ref.removeprefix("file://")).expanduser()
    if local.exists() or ref.startswith((".", "/", "~", "file://")):
        return local, None
    from huggingface_hub import snapshot_download

    repo, revision = split_ref(ref)
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # the hub client raises many types; the user needs the reason
        raise JobError("model", ref, f"could not be resolved on the hub or its cache ({err})") from err
    return folder, folder.name  # a snapshot folder is named by its commit


def _diffusers_models(folder: Path, index: dict[str, Any], dtype: Any) -> dict[str, tuple[Any, Any]]:
    """The pipeline's diffusers models (UNet, VAE) built from their configs, with their
    weights as stored. diffusers' own loader traces each model's initialisation under
    `jax.eval_shape` to check the weights' shapes, which is most of a warm worker's
    start-up; here the engine checks them against the compiled program instead
    (`Engine.compiled`), and a fresh compile fails on a mismatch with flax's error."""
    import diffusers
    from diffusers.models.modeling_flax_utils import FlaxModelMixin
    from diffusers.utils import FLAX_WEIGHTS_NAME
    from flax.serialization import msgpack_restore

    models = {}
    for name, entry in index.items():
        weights = folder / name / FLAX_WEIGHTS_NAME
        if not isinstance(entry, list) or entry[0] != "diffusers" or not weights.is_file():
            continue
        cls = getattr(diffusers, entry[1] if entry[1].startswith("Flax") else f"Flax{entry[1]}", None)
        if isinstance(cls, type) and issubclass(cls, FlaxModelMixin):
            module = cls.from_config(cls.load_config(folder / name), dtype=dtype)
            models[name] = (module, msgpack_restore(weights.read_bytes()))
    return models


def load_model(ref: str, dtype: str = "float32") -> LoadedModel:
    """Load a diffusers Flax pipeline; with bfloat16 the weights are cast but the scheduler
    state stays float32 (its small values lose too much in bfloat16)."""
    if dtype not in DTYPES:
        raise JobError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    folder, revision = resolve(ref)
    index = folder / "model_index.json"
    if not folder.is_dir() or not index.is_file():
        raise JobError("model", ref, "must be a diffusers pipeline folder (no model_index.json found)")
    components = json.loads(index.read_text())
    family = "sdxl" if "XL" in components.get("_class_name", "") else "sd"
    kwargs: dict[str, Any] = {} if family == "sdxl" else {"safety_checker": None, "feature_extractor": None}

    from diffusers import FlaxDiffusionPipeline

    with quiet_diffusers():
        try:
            models = _diffusers_models(folder, components, DTYPES[dtype])
            pipe, params = FlaxDiffusionPipeline.from_pretrained(
                str(folder), dtype=DTYPES[dtype], **kwargs, **{name: module for name, (module, _) in models.items()})
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise JobError("model", ref, f"must be a loadable diffusers Flax pipeline ({err})") from err
    params.update({name: weights for name, (_, weights) in models.items()})
    if dtype == "bfloat16":
        params = {k: v if k == "scheduler" else jax.tree.map(lambda x: x.astype(jnp.bfloat16), v)
                  for k, v in params.items()}
    return LoadedModel(ref=ref, revision=revision, family=family, dtype=dtype, pipe=pipe, params=params)
