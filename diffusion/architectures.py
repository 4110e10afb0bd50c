"""Models as programs see them, without their weights: a published architecture by name, a
pipeline folder or a hub id, each as networks, abstract parameters (shapes and dtypes) and
input lengths. Enough to compile a model's programs and count their memory and FLOPs
(`renderfarm plan`) before anyone downloads gigabytes or rents a chip.

The published architectures are the released pipelines' configs, one JSON file each in
diffusion/architectures/ (each component's config.json, the scheduler's, model_index.json's
class and options, and the tokenizers' lengths), under the names `ARCHITECTURES` lists. A
folder or hub id is read as the loader reads it (diffusion.models), configs and tokenizers only:
from the hub nothing but its configs and tokenizer files is fetched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffusion.errors import ModelError

if TYPE_CHECKING:
    from diffusion.family import Family, Networks
    from diffusion.models import LoadedModel

FOLDER = Path(__file__).with_name("architectures")
ARCHITECTURES = tuple(sorted(path.stem for path in FOLDER.glob("*.json")))


@dataclasses.dataclass(frozen=True)
class Length:
    """A tokenizer as a compiled program sees it: the length of its id rows."""

    max_length: int


def architecture(name: str) -> dict[str, Any]:
    """The published configs of architecture `name` (diffusion/architectures/NAME.json)."""
    if name not in ARCHITECTURES:
        raise ModelError("model", name, f"must be a published architecture ({', '.join(ARCHITECTURES)}), a pipeline "
                                        "folder or a hub id (org/name)")
    return json.loads((FOLDER / f"{name}.json").read_text(encoding="utf-8"))


def abstract_model(ref: str, dtype: str = "bfloat16") -> LoadedModel:
    """The model `ref` names (an architecture in `ARCHITECTURES`, a folder or a hub id) with
    abstract parameters in `dtype` (jax.ShapeDtypeStruct leaves) in place of weights. JAX is
    imported here, not with the module: the command line lists the names without it."""
    import jax

    from diffusion.models import JAX_DTYPES, LoadedModel
    from diffusion.nn import parameter_shapes

    family, revision, configs, tokenizers, networks = _describe(ref, dtype)
    cast = lambda leaf: jax.ShapeDtypeStruct(  # noqa: E731 - floating weights in `dtype`, as the loader holds them
        leaf.shape, JAX_DTYPES[dtype] if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) else leaf.dtype)
    params = {name: jax.tree.map(cast, parameter_shapes(module)) for name, module in networks.modules}
    return LoadedModel(ref=ref, revision=revision, family=family, dtype=dtype, variant=None, networks=networks,
                       params=params, tokenizers=tokenizers, configs=configs)


def abstract_networks(ref: str, dtype: str = "bfloat16") -> tuple[Family, Networks]:
    """The family and networks of the model `ref` names, without tracing its parameters (seconds
    for a full-size model): what its geometry (`Family.geometry`: size step, native size) needs."""
    family, _, _, _, networks = _describe(ref, dtype)
    return family, networks


def _describe(ref: str, dtype: str) -> tuple[Family, str | None, dict[str, Any], list[Any], Networks]:
    """Family, revision, configs, tokenizers (or their lengths) and networks of `ref`, read as
    the loader reads them."""
    from diffusion.families import detect
    from diffusion.family import Networks
    from diffusion.models import JAX_DTYPES, _config, _read_json, is_single_file, resolve
    from diffusion.tokenizer import TokenizerError

    if dtype not in JAX_DTYPES:
        raise ModelError("dtype", dtype, f"must be one of {', '.join(JAX_DTYPES)}")
    local = Path(ref).expanduser().exists()
    if not local and "/" not in ref:  # not a folder, not a hub id: a published architecture's name
        published = architecture(ref)
        index, revision, configs = published["model_index"], None, published
        family = detect(ref, index)
        tokenizers: list[Any] = [Length(length) for length in published["tokenizers"].values()]
    else:
        if is_single_file(ref):
            raise ModelError("model", ref, "a single file is planned as its base: name the base pipeline (a folder, "
                                           f"a hub id or one of {', '.join(ARCHITECTURES)})")
        folder, revision = resolve(ref, weights=False)
        index = _read_json(ref, folder / "model_index.json")
        family = detect(ref, index)
        configs = {name: _read_json(ref, folder / name / "config.json") for name in family.components}
        configs["scheduler"] = _read_json(ref, folder / "scheduler" / "scheduler_config.json")
        try:
            tokenizers = [load(folder / name) for name, load in family.tokenizers.items()]
        except TokenizerError as err:
            raise ModelError("model", ref, str(err)) from None
    modules = {name: component.module(_config(ref, family, name, configs), dtype=JAX_DTYPES[dtype])
               for name, component in family.components.items()}
    options = tuple((name, index.get(name, default)) for name, default in family.options)
    return (family, revision, {name: configs[name] for name in (*family.components, "scheduler")}, tokenizers,
            Networks(tuple(modules.items()), options))
