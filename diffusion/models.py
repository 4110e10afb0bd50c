"""Model loading: one path for every model reference, so tests exercise what users run.

A reference is a hub id (optionally `@revision`), a local diffusers folder, or a bucket
folder (`gs://...`) copied once into a local cache; or one single-file checkpoint (`x.safetensors`:
local, in a bucket, or `org/repo/x.safetensors[@revision]` on the hub) with a base pipeline
for its configs and tokenizers. Every kind is first resolved to local files, then loaded by
the same code: the family from model_index.json (diffusion/families), each component's network
from its config.json (diffusion/nn), its weights from safetensors or Flax msgpack
(diffusion/weights.py, diffusion/single_file.py; never a pickle) with any LoRAs merged
(diffusion/lora.py), the tokenizers (diffusion/tokenizer.py) and the scheduler config. The
sha256 of every weights file used is kept for the sidecars (diffusion/digests.py). Nothing
here imports torch, diffusers or transformers.

The weights go straight to the devices where diffusion/placement.py puts them: replicated by
diffusion/weights.py's device path (files read in parallel, moved as stored, permuted and cast
on the devices), or split over devices from the host, shard by shard; the load is logged:
`loaded MODEL (DTYPE) in X s: N tensors, G GB on D devices`.

Buckets are read through an opener the application registers for their scheme
(`set_bucket_opener`; the farm sets its storage layer's), so the model
layer imports no storage client.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from tqdm import tqdm

from diffusion.choices import DTYPES, SCHEDULERS, Lora, check_variant
from diffusion.digests import file_sha256
from diffusion.errors import ModelError
from diffusion.families import detect
from diffusion.family import Family, Networks, Tokenizer
from diffusion.generate import ImageInputs
from diffusion.lora import Patch, read_lora
from diffusion.nn import parameter_shapes
from diffusion.placement import Placement, make_placement
from diffusion.schedulers import CLASS_NAMES
from diffusion.sharding import choose_model_parallel, split_text_encoders
from diffusion.single_file import check_family, read_single_file
from diffusion.targets import usable_share
from diffusion.tokenizer import TokenizerError
from diffusion.weights import (
    PICKLE_SUFFIXES,
    Delta,
    TensorInfo,
    choose_weights,
    load_tensors,
    load_weights,
    safetensors_tensors,
)

JAX_DTYPES = {name: jnp.dtype(name) for name in DTYPES}
DIGESTS = "sha256.json"  # in the model cache: diffusion/digests.py
# A single file's default base, by the lineage its tensors show: configs and tokenizers only.
STANDARD_BASES = {"flux-schnell": "black-forest-labs/FLUX.1-schnell", "flux-dev": "black-forest-labs/FLUX.1-dev",
                  "sd1": "stable-diffusion-v1-5/stable-diffusion-v1-5", "sd2": "stabilityai/stable-diffusion-2-1",
                  "sdxl": "stabilityai/stable-diffusion-xl-base-1.0"}
# What a hub snapshot needs: configs, tokenizer files and weights; never a pickle.
HUB_CONFIGS = ["*.json", "*.txt"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    """A pipeline's networks, weights (on the devices, as `placement` put them), tokenizers and
    configs, and where they came from."""

    ref: str
    revision: str | None
    family: Family
    dtype: str
    variant: str | None
    networks: Networks
    params: dict[str, Any]  # component -> parameter tree (jax arrays placed by `placement`)
    tokenizers: list[Tokenizer]
    configs: dict[str, dict[str, Any]]  # component -> config.json, "scheduler" included
    base: str | None = None  # a single file's base pipeline, as the jobs name it (None: the default)
    loras: tuple[Lora, ...] | None = None  # as the jobs name them
    weights: tuple[dict[str, Any], ...] = ()  # every weights file used: role, file, sha256 (and a LoRA's scale)
    model_parallel: int = 1  # devices that share one copy of the weights (diffusion.placement)
    placement: Placement | None = None  # where the weights are (None: shapes only, not placed)

    def inputs(self, prompts: Sequence[str], negatives: Sequence[str], seeds: Sequence[int],
               guidance: Sequence[float]) -> tuple[Any, list[bool]]:
        """One batch's inputs of the family's `generate`, on the host (numpy), a job per
        position; and which prompts the tokenizers cut."""
        return self.family.inputs(self.tokenizers, prompts, negatives, seeds, guidance)

    def guidance_scale(self, asked: float | None) -> float:
        """The guidance a job renders with: the scale it asks for, or else its family's default."""
        return self.family.default_guidance if asked is None else asked

    def abstract_inputs(self, batch: int, sharding: jax.sharding.Sharding | None = None,
                        image: tuple[int, int] | None = None, mask: bool = False) -> Any:
        """The shapes and dtypes of `inputs` for `batch` jobs (what a program is compiled for);
        with `image` (height, width), an image-to-image batch's (generate.ImageInputs), with
        `mask` an inpainting one's."""
        inputs = self.family.abstract_inputs(self.tokenizers, batch)
        if image is not None:
            inputs = ImageInputs(inputs, jax.ShapeDtypeStruct((batch, 3, *image), jnp.float32),
                                 jax.ShapeDtypeStruct((batch,), jnp.int32),
                                 jax.ShapeDtypeStruct((batch, 1, *image), jnp.float32) if mask else None)
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), inputs)

    @property
    def size_step(self) -> int:
        """Widths and heights are multiples of this (the family's geometry)."""
        return self.family.geometry(self.networks).size_step

    @property
    def native_size(self) -> int:
        return self.family.geometry(self.networks).native_size

    @property
    def inpainting_unet(self) -> bool:
        """Whether its UNet takes more channels than the VAE's latents (an inpainting UNet,
        like sd-1.5-inpainting's 9: latents, mask, masked image's latents): it renders
        inpainting jobs only."""
        modules = dict(self.networks.modules)
        unet, vae = modules.get("unet"), modules.get("vae")
        return unet is not None and vae is not None and unet.config.in_channels > vae.config.latent_channels

    @property
    def default_scheduler(self) -> str:
        """The name (of diffusion.choices.SCHEDULERS) of the model's own scheduler."""
        name = self.configs["scheduler"].get("_class_name")
        if name not in CLASS_NAMES:
            raise ModelError("scheduler", None, f"the model's own scheduler is {name!r}, which the farm does not "
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
            raise ModelError("model", url, f"holds an object named {name!r}, which would be written outside "
                                           "the model's folder: refused")
    return names


class Bucket(Protocol):
    """What the loader needs of a bucket folder (renderfarm.storage.Storage has it)."""

    def list(self, prefix: str) -> Iterable[str]: ...

    def get(self, name: str) -> bytes: ...

    def exists(self, name: str) -> bool: ...


_bucket_opener: list[Callable[[str], Bucket]] = []  # the one the application set, if any


def set_bucket_opener(opener: Callable[[str], Bucket]) -> None:
    """Read gs:// model folders and files through `opener` (a folder URL -> its Bucket)."""
    _bucket_opener[:] = [opener]


def _open_bucket(url: str, field: str, ref: str) -> Bucket:
    """The bucket folder `url`, for the reference `ref` in `field`."""
    if not _bucket_opener:
        raise ModelError(field, ref, "names a bucket, but this program set no bucket reader "
                                     "(diffusion.models.set_bucket_opener)")
    return _bucket_opener[0](url)


def _fetch_bucket_folder(url: str) -> Path:
    """Copy a bucket's model folder into the local cache once (with a progress bar); a marker
    says the copy is whole."""
    target = cache_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    marker = target / ".complete"
    if marker.exists():
        return target
    store = _open_bucket(url, "model", url)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    names = contained(url, list(store.list("")))
    if not names:
        raise ModelError("model", url, "is an empty or missing bucket folder")
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


def hub_patterns(variant: str | None, components: Sequence[str] | None = None) -> list[str]:
    """What to fetch of a hub repo: configs, tokenizer files, and the weights of `variant`
    (safetensors, sharded or not; Flax msgpack when no variant is asked for), of `components`
    only when they are named, nothing else: a repo often holds every format and variant of the
    same weights, and pickles."""
    if variant is None:
        weights = ["*model.safetensors", "*model-*-of-*.safetensors", "*.msgpack"]
    else:
        weights = [f"*.{variant}.safetensors", f"*.{variant}-*-of-*.safetensors"]
    if components is not None:
        weights = [f"{component}/{pattern}" for component in components for pattern in weights]
    return [*HUB_CONFIGS, *weights]


def resolve(ref: str, variant: str | None = None, weights: bool | Sequence[str] = True) -> tuple[Path, str | None]:
    """Any model reference -> (local diffusers folder, revision or None); from the hub, only
    its configs and tokenizer files when `weights` is False, and only the named components'
    weights when it lists them (a single file's base: what the file does not hold; Flux's
    transformer alone is 24 GB)."""
    if ref.startswith("gs://"):
        return _fetch_bucket_folder(ref), None
    local = Path(ref.removeprefix("file://")).expanduser()
    if local.exists() or ref.startswith((".", "/", "~", "file://")):
        return local, None
    from huggingface_hub import snapshot_download

    repo, revision = split_ref(ref)
    try:  # huggingface_hub shows a progress bar per file while it downloads
        patterns = hub_patterns(variant, None if weights is True else list(weights or ()))
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as err:  # the hub client raises many types; the user needs the reason
        raise ModelError("model", ref, f"could not be resolved on the hub or its cache ({err})") from err
    return folder, folder.name  # a snapshot folder is named by its commit


def is_single_file(ref: str) -> bool:
    """Whether a model reference names one checkpoint file rather than a pipeline folder."""
    return split_ref(ref)[0].lower().endswith((".safetensors", *PICKLE_SUFFIXES))


def resolve_file(ref: str, field: str) -> tuple[Path, str | None]:
    """A file reference (a checkpoint or a LoRA) -> (local file, revision or None): a path,
    `gs://bucket/x.safetensors` (copied once into the cache) or `org/repo/x.safetensors[@rev]`
    (the hub's cache). Pickle files are refused by name, never opened."""
    name, revision = split_ref(ref)
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise ModelError(field, ref, "is a pickle file, which is never loaded: unpickling runs code from the file. "
                                     "Convert it to .safetensors on a trusted machine (safetensors.torch.save_file)")
    if not name.lower().endswith(".safetensors"):
        raise ModelError(field, ref, "must name a .safetensors file")
    if ref.startswith("gs://"):
        return _fetch_bucket_file(ref, field), None
    local = Path(ref.removeprefix("file://")).expanduser()
    if local.exists() or ref.startswith((".", "/", "~", "file://")):
        if not local.is_file():
            raise ModelError(field, ref, "is not a file")
        return local, None
    parts = name.split("/")
    if len(parts) < 3:
        raise ModelError(field, ref, "is neither a local file nor a hub file (org/repo/path/x.safetensors[@revision])")
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), revision=revision))
    except Exception as err:  # the hub client raises many types; the user needs the reason
        raise ModelError(field, ref, f"could not be resolved on the hub or its cache ({err})") from err
    return path, path.parents[len(parts) - 3].name  # .../snapshots/<commit>/path/x.safetensors


def _fetch_bucket_file(url: str, field: str) -> Path:
    """Copy one bucket file into the local cache once (written whole, then renamed)."""
    folder, _, name = url.rpartition("/")
    target = cache_root() / "files" / hashlib.sha256(url.encode()).hexdigest()[:24] / name
    if target.is_file():
        return target
    store = _open_bucket(folder, field, url)
    if not store.exists(name):
        raise ModelError(field, url, "no such object")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{name}.partial-{os.getpid()}")
    partial.write_bytes(store.get(name))
    os.replace(partial, target)
    return target


def _read_json(ref: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError("model", ref, f"has no {path.parent.name}/{path.name}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ModelError("model", ref, f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ModelError("model", ref, f"{path}: must be a JSON object")
    return data


def replicated(devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """Whole copies on each of `devices` (default: all local devices), on the mesh the engine
    keeps its weights on (so it keeps them without a copy)."""
    return make_placement(list(devices or jax.local_devices()), 1).replicated


def load_model(ref: str, dtype: str = "float32", variant: str | None = None, base: str | None = None,
               loras: tuple[Lora, ...] | None = None, devices: Sequence[jax.Device] | None = None,
               model_parallel: int | None = 1) -> LoadedModel:
    """Load a model for the farm: a diffusers pipeline folder (any reference), or a single
    checkpoint file with `base`'s configs and tokenizers; then merge `loras` (reference,
    scale) into its weights. With bfloat16 the weights are cast (after merging); the
    schedulers keep their state in float32 whatever the dtype. The weights are placed on
    `devices` (default: all local devices) before this returns: a whole copy on each, or
    with `model_parallel` N > 1 one copy per N devices, split over them as its family states
    (diffusion.placement; None: the fewest that fit the devices' memory). The time it took is logged."""
    started = time.perf_counter()
    if dtype not in JAX_DTYPES:
        raise ModelError("dtype", dtype, f"must be one of {', '.join(JAX_DTYPES)}")
    if variant is not None:
        check_variant(variant)
    weights: list[dict[str, Any]] = []
    if is_single_file(ref):
        folder, revision, family, sources = _single_file(ref, variant, base, weights)
        index = _read_json(ref, folder / "model_index.json")
    else:
        if base is not None:
            raise ModelError("base", base, "applies to a single-file --model (x.safetensors) only")
        folder, revision = resolve(ref, variant)
        if not (folder / "model_index.json").is_file():
            raise ModelError("model", ref, "must be a diffusers pipeline folder (no model_index.json found)")
        index = _read_json(ref, folder / "model_index.json")
        family = detect(ref, index)
        sources = _folder_weights(folder, family.components, variant, weights)
    configs = {name: _read_json(ref, folder / name / "config.json") for name in family.components}
    configs["scheduler"] = _read_json(ref, folder / "scheduler" / "scheduler_config.json")
    deltas = _lora_deltas(ref, loras or (), family, sources, configs, weights)
    devices = list(devices or jax.local_devices())
    placement = _placement(ref, folder, family, sources, dtype, devices, model_parallel)
    model_parallel = placement.model_parallel
    # Split weights are converted on the host and placed shard by shard; whole copies go the fast way.
    sharding = placement.replicated if model_parallel == 1 and not placement.text_split else None
    modules: dict[str, Any] = {}
    # Each component's weights load on a thread of their own, in order, while the next component's
    # expected shapes are traced here (seconds for a UNet, once per architecture: diffusion.nn.parameter_shapes).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load") as loader:
        loading: dict[str, concurrent.futures.Future] = {}
        try:
            for name, component in family.components.items():
                modules[name] = component.module(_config(ref, family, name, configs), dtype=JAX_DTYPES[dtype])
                expected = parameter_shapes(modules[name])
                if name in sources:
                    loading[name] = loader.submit(load_tensors, _where(folder / name, sources[name]), component.kind,
                                                  sources[name], expected, JAX_DTYPES[dtype], deltas.get(name),
                                                  sharding=sharding)
                else:  # Flax msgpack
                    loading[name] = loader.submit(load_weights, folder, name, component.kind, expected, JAX_DTYPES[dtype],
                                                  variant, sharding=sharding)
        except BaseException:
            for future in loading.values():  # an earlier component's error first, as if loaded one by one
                future.cancel()
                if not future.cancelled():
                    future.result()
            raise
        params = {name: future.result() for name, future in loading.items()}
    if sharding is None:
        params = placement.place(family, params)
    try:
        tokenizers = [load(folder / name) for name, load in family.tokenizers.items()]
    except TokenizerError as err:
        raise ModelError("model", ref, str(err)) from None
    options = tuple((name, index.get(name, default)) for name, default in family.options)
    networks = Networks(tuple(modules.items()), options)
    leaves = jax.block_until_ready(jax.tree.leaves(params))
    log.info("loaded %s (%s) in %.2f s: %d tensors, %.2f GB on %d devices%s", ref, dtype,
             time.perf_counter() - started, len(leaves), sum(leaf.nbytes for leaf in leaves) / 1e9, len(devices),
             (f", split over {model_parallel} per copy" if model_parallel > 1 else "")
             + (", the text encoders spread over all of them" if placement.text_split else ""))
    return LoadedModel(ref=ref, revision=revision, family=family, dtype=dtype, variant=variant, networks=networks,
                       params=params, tokenizers=tokenizers, configs=configs, base=base, loras=loras or None,
                       weights=tuple(weights), model_parallel=model_parallel, placement=placement)


def _placement(ref: str, folder: Path, family: Family, sources: dict[str, dict[str, TensorInfo]], dtype: str,
               devices: list[jax.Device], model_parallel: int | None) -> Placement:
    """Where this model's weights go on `devices`: `model_parallel` devices per copy (None: the
    fewest that fit, `choose_model_parallel`), the text encoders spread over every device where
    whole they would not fit (`split_text_encoders`); counted from the weights' sizes in `dtype`
    (safetensors: their tensors'; Flax msgpack: the files') and the memory JAX may use there."""
    size = JAX_DTYPES[dtype].itemsize
    component_bytes = {name: sum(math.prod(info.shape) * size for info in tensors.values())
                       for name, tensors in sources.items()}
    component_bytes |= {name: sum(path.stat().st_size for path in (folder / name).glob("*.msgpack"))
                        for name in family.components if name not in sources}
    weight_bytes = sum(component_bytes.values())
    text_bytes = sum(component_bytes.get(name, 0) for name in family.text_encoders)
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    usable = int(limit * usable_share(devices[0].platform)) if limit else None
    if model_parallel is None:
        try:
            model_parallel = choose_model_parallel(weight_bytes, usable, len(devices), text_bytes)
        except ValueError as err:
            raise ModelError("model", ref, str(err)) from None
    return make_placement(devices, model_parallel,
                          split_text_encoders(weight_bytes, text_bytes, usable, model_parallel, len(devices)))


def _single_file(ref: str, variant: str | None, base: str | None, weights: list[dict[str, Any]],
                 ) -> tuple[Path, str | None, Family, dict[str, dict[str, TensorInfo]]]:
    """A single-file checkpoint: its lineage from its tensors, the base pipeline's family,
    configs and tokenizers (the lineage's standard one by default), each component's tensors
    from the file and, for components the file does not hold (a UNet or a Flux transformer
    saved alone), from the base's weights."""
    if variant is not None:
        raise ModelError("variant", variant, "a single-file checkpoint has no variants")
    path, revision = resolve_file(ref, "model")
    base_ref = base or STANDARD_BASES[read_single_file(path).lineage]
    folder, _ = resolve(base_ref, weights=False)
    if not (folder / "model_index.json").is_file():
        raise ModelError("base", base_ref, "must be a diffusers pipeline folder (no model_index.json found)")
    family = detect(base_ref, _read_json(base_ref, folder / "model_index.json"))
    configs = {name: _read_json(base_ref, folder / name / "config.json") for name in family.components}
    single = read_single_file(path, configs)
    check_family(single, family.name, base_ref)
    weights.append({"role": "single_file", "file": ref, "sha256": file_sha256(path, cache_root() / DIGESTS)})
    sources = dict(single.components)
    missing = [name for name in family.components if name not in sources]
    if missing:
        folder, _ = resolve(base_ref, weights=missing)
        sources |= _folder_weights(folder, missing, None, weights)
    return folder, revision, family, sources


def _where(component: Path, tensors: dict[str, TensorInfo]) -> Path:
    """Where a component's tensors are, for its errors: its folder, or the single file."""
    file = next(iter(tensors.values())).file if tensors else None
    return component if file is None or component in file.parents else file


def _folder_weights(folder: Path, components: Iterable[str], variant: str | None,
                    weights: list[dict[str, Any]]) -> dict[str, dict[str, TensorInfo]]:
    """Each component's safetensors tensors (a component with Flax msgpack weights is left
    out: load_weights reads it); every file used goes into `weights` with its sha256."""
    sources, files = {}, []
    for name in components:
        chosen = choose_weights(folder / name, variant)
        if chosen.suffix == ".msgpack":
            files.append(chosen)
        else:
            sources[name] = safetensors_tensors(chosen)
            files += sorted({info.file for info in sources[name].values()})
    weights += [{"role": "pipeline", "file": str(path.relative_to(folder)), "sha256": file_sha256(path, cache_root() / DIGESTS)}
                for path in files]
    return sources


def _config(ref: str, family: Family, name: str, configs: dict[str, dict[str, Any]]) -> Any:
    """A component's config object from its config.json."""
    try:
        return family.components[name].config.from_dict(configs[name])
    except (ValueError, TypeError) as err:
        raise ModelError("model", ref, f"{name}/config.json: {err}") from None


def _lora_deltas(ref: str, loras: tuple[Lora, ...], family: Family, sources: dict[str, dict[str, TensorInfo]],
                 configs: dict[str, dict[str, Any]], weights: list[dict[str, Any]]) -> dict[str, dict[str, Delta]]:
    """Every LoRA placed on the model (all checked before any weight is read; on the components
    the family's LoRAs may change, the denoiser's modules named as its kohya files name them,
    which may depend on its config), as a delta per changed weight, by component and PyTorch
    tensor name: the sum of the LoRAs' scaled deltas, computed when that weight is read, so no
    more than one weight's delta is held at once."""
    msgpack = [name for name in family.components if name not in sources]
    if loras and msgpack:
        raise ModelError("loras", loras[0][0], f"merge into safetensors weights; this model's {msgpack[0]} has "
                                               "Flax msgpack weights (LoRAs need the model's safetensors weights)")
    shapes = {name: {key: info.shape for key, info in tensors.items()} for name, tensors in sources.items()}
    targets = family.loras
    named = loras and targets.kohya_modules is not None and targets.denoiser in family.components
    denoiser_config = _config(ref, family, targets.denoiser, configs) if named else None
    patches: dict[str, dict[str, list[tuple[Patch, float]]]] = {}
    for lora_ref, scale in loras:
        path, _ = resolve_file(lora_ref, "loras")
        for component, placed in read_lora(path).fit(shapes, targets, denoiser_config).items():
            for key, patch in placed.items():
                patches.setdefault(component, {}).setdefault(key, []).append((patch, scale))
        weights.append({"role": "lora", "file": lora_ref, "scale": scale, "sha256": file_sha256(path, cache_root() / DIGESTS)})
    return {component: {key: functools.partial(_summed, placed) for key, placed in by_key.items()}
            for component, by_key in patches.items()}


def _summed(placed: list[tuple[Patch, float]]) -> Any:
    return sum(patch.delta(scale) for patch, scale in placed)
