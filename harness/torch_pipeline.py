"""Diffusers folders in PyTorch's format with random weights, written without torch and without a
download, at any size: what bench/engine.py's device part loads into the worker and into
diffusers' own pipelines, so both sides time the same model.

The tensor names and shapes are diffusion/convert.py's rules inverted (`torch_name`,
`torch_shape`); tests/test_torch_pipeline.py checks them against the checkpoints diffusers saved
for the oracle and reads every family's written folder back through the worker's loader. The
tokenizers are diffusion/tiny_parts.py's (a 514-token byte-level CLIP BPE, a small T5 Unigram) in
front of text encoders of the configured size: the ids change, the work does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WRITER_VERSION = 2  # part of a kept folder's marker: a change of the writer rewrites it
_DIFFUSERS_VERSION = "0.42.1"  # the version model_index.json names (diffusers reads any)
_TOKENIZER_CLASSES = {"clip": "CLIPTokenizer", "t5": "T5TokenizerFast"}
_MODEL_TYPES = {"clip": "clip_text_model", "clip_projection": "clip_text_model", "t5": "t5"}


class RandomValues:
    """Random float16 values fast enough for billions of parameters: one pool of standard normals,
    pre-scaled once per distinct scale, read at a random offset per tensor (cyclically). Flax's
    default initialisers' shapes: LeCun normal kernels and embeddings, zero biases, unit norm
    scales. For timing, not for images: the weights only have to be finite and sane."""

    POOL = 1 << 22

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.standard_normal(self.POOL, dtype=np.float32)
        self.scaled: dict[float, bytes] = {}

    def chunks(self, leaf: str, flax_shape: tuple[int, ...]) -> Iterator[bytes]:
        """The float16 bytes of one parameter named `leaf` of Flax shape `flax_shape`, in pieces."""
        np = self.np
        n = math.prod(flax_shape)
        if leaf in ("bias", "scale"):
            data = (np.zeros(min(n, self.POOL), np.float16) + (1.0 if leaf == "scale" else 0.0)).tobytes()
            start = 0
        else:
            scale = float(1.0 / math.sqrt(max(1, math.prod(flax_shape[:-1]))))
            if scale not in self.scaled:
                self.scaled[scale] = (self.pool * scale).astype(np.float16).tobytes()
            data = self.scaled[scale]
            start = int(self.rng.integers(self.POOL)) * 2
        left = n * 2
        while left:
            piece = data[start:start + left]
            yield piece
            left -= len(piece)
            start = 0


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Any]]) -> int:
    """A safetensors file of float16 tensors (name, shape, iterator of their bytes), streamed:
    an 8-byte little-endian header length, the JSON header, the data in header order. Returns
    the data's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for _, _, chunks in tensors:
            for chunk in chunks:
                out.write(chunk)
    os.replace(partial, path)
    return offset


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _tokenizers(out: Path, family: Any) -> tuple[dict[str, str], int]:
    """Write the family's tokenizer folders; returns each one's kind ("clip" or "t5") and the
    CLIP tokenizers' vocabulary size."""
    from diffusion.tiny_parts import EOS, clip_tokenizer_files, t5_tokenizer_files

    kinds, clip_vocab = {}, 0
    for name in family.tokenizers:
        encoder = family.components["text_encoder" + name.removeprefix("tokenizer")]
        if encoder.kind == "t5":
            t5_tokenizer_files(out / name)
            kinds[name] = "t5"
        else:  # SDXL's second CLIP tokenizer pads with "!", the others with their end token
            clip_vocab = clip_tokenizer_files(out / name, pad="!" if name == "tokenizer_2" else EOS)
            kinds[name] = "clip"
    return kinds, clip_vocab


def write_torch_pipeline(out: Path, family_name: str, configs: dict[str, dict[str, Any]],
                         scheduler: dict[str, Any], seed: int = 0,
                         options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A diffusers folder of family `family_name` in PyTorch's format: model_index.json (with the
    pipeline's `options`, such as SDXL's `force_zeros_for_empty_prompt`), each component's
    config.json (from `configs`) and float16 safetensors of random weights, the tokenizers, the
    scheduler config. Kept: a second call with the same arguments returns at once. Returns
    whether it wrote, the seconds and the weights' bytes."""
    from flax.traverse_util import flatten_dict

    from diffusion.convert import torch_name, torch_shape
    from diffusion.families import FAMILIES
    from diffusion.nn import parameter_shapes
    from diffusion.tiny_parts import DIFFUSERS_KINDS

    digest = hashlib.sha256(json.dumps([family_name, configs, scheduler, seed, options, WRITER_VERSION],
                                       sort_keys=True).encode()).hexdigest()
    marker = out / ".complete"
    if marker.is_file() and marker.read_text() == digest:
        return {"written": False, "seconds": 0.0, "bytes": weights_bytes(out)}
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    family = FAMILIES[family_name]
    tokenizers, clip_vocab = _tokenizers(out, family)
    index: dict[str, Any] = {"_class_name": family.pipelines[0], "_diffusers_version": _DIFFUSERS_VERSION,
                             "scheduler": ["diffusers", scheduler["_class_name"]], **(options or {})}
    index |= {name: ["transformers", _TOKENIZER_CLASSES[kind]] for name, kind in tokenizers.items()}
    if family_name == "sd":
        index |= {"safety_checker": [None, None], "feature_extractor": [None, None]}
    values = RandomValues(seed)
    for name, component in sorted(family.components.items()):
        config = dict(configs[name])
        module = component.module(component.config.from_dict(config))
        library = "diffusers" if component.kind in DIFFUSERS_KINDS else "transformers"
        if library == "diffusers":
            config.setdefault("_class_name", type(module).__name__)
        else:
            config.setdefault("model_type", _MODEL_TYPES[component.kind])
            config.setdefault("architectures", [type(module).__name__])
        if component.kind.startswith("clip"):  # the tokenizer's special ids, whatever the embedding rows
            config |= {"bos_token_id": clip_vocab - 2, "eos_token_id": clip_vocab - 1, "pad_token_id": clip_vocab - 1}
        shapes = flatten_dict(parameter_shapes(module))
        tensors = sorted((torch_name(component.kind, path), torch_shape(path[-1], tuple(leaf.shape)),
                          values.chunks(path[-1], tuple(leaf.shape))) for path, leaf in shapes.items())
        _write_json(out / name / "config.json", config)
        weights = "diffusion_pytorch_model.safetensors" if library == "diffusers" else "model.safetensors"
        write_safetensors(out / name / weights, tensors)
        index[name] = [library, type(module).__name__]
    _write_json(out / "scheduler" / "scheduler_config.json", scheduler)
    _write_json(out / "model_index.json", index)
    marker.write_text(digest)
    return {"written": True, "seconds": time.perf_counter() - started, "bytes": weights_bytes(out)}


def weights_bytes(folder: Path) -> int:
    """The bytes of a folder's safetensors files."""
    return sum(path.stat().st_size for path in folder.rglob("*.safetensors"))
