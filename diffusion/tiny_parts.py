"""The parts tiny random-weight pipelines are made of, which each family's recipe
(`Family.tiny`) puts together and diffusion/tiny.py builds: CLIP and T5 tokenizer files, a tiny
CLIP text encoder's config, seeded random weights, and a diffusers folder with model_index.json,
each component's config.json and weights in diffusers' Flax msgpack format (the oracle's
checkpoints in tests/data/oracle are the PyTorch safetensors side).
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any

import numpy as np
from flax.serialization import msgpack_serialize
from flax.traverse_util import flatten_dict, unflatten_dict

from diffusion.nn import parameter_shapes

if TYPE_CHECKING:
    from diffusion.family import Family

_MAX_LENGTH = 77  # CLIP's context length; every real SD tokenizer pads to it.
TEXT_HIDDEN = 32  # hidden size (and SDXL projection_dim) of each tiny CLIP text encoder
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
DIFFUSERS_KINDS = ("unet", "vae", "flux")  # convert kinds of diffusers' networks (the others are transformers')


def _byte_chars() -> list[str]:
    """CLIP's (GPT-2's) printable stand-in for each byte, in its `bytes_to_unicode` order: the
    printable bytes as themselves, then the others as the characters from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def clip_tokenizer_files(folder: pathlib.Path, pad: str, max_length: int = _MAX_LENGTH) -> int:
    """A byte-level CLIP BPE without merges: every UTF-8 byte is a token, so any text encodes.
    Written as transformers saves a CLIPTokenizer; returns the vocabulary size."""
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + [BOS, EOS]
    vocab = {token: i for i, token in enumerate(tokens)}
    special = {"content": None, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    decoder = {str(vocab[t]): {**special, "content": t, "special": True} for t in (BOS, EOS)}
    if pad != EOS:
        decoder = {str(vocab[pad]): {**special, "content": pad, "normalized": False, "special": True}, **decoder}
    config = {"added_tokens_decoder": decoder, "bos_token": BOS, "clean_up_tokenization_spaces": False,
              "eos_token": EOS, "errors": "replace", "extra_special_tokens": {}, "model_max_length": max_length,
              "pad_token": pad, "tokenizer_class": "CLIPTokenizer", "unk_token": EOS}
    tokens_map = {"bos_token": {**special, "content": BOS}, "eos_token": {**special, "content": EOS},
                  "pad_token": pad, "unk_token": {**special, "content": EOS}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", tokens_map)):
        (folder / name).write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    return len(vocab)


T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in every T5 vocabulary
_T5_WORDS = ("a", "the", "of", "in", "on", "at", "red", "fox", "snow", "light", "house", "cliff", "dusk", "cat",
             "bowl", "ramen", "oil", "paint", "ing", "night", "city", "tree", "blue", "sky")


def t5_tokenizer_files(folder: pathlib.Path, max_length: int = 512) -> int:
    """A T5 Unigram tokenizer.json (made with the `tokenizers` library, as transformers saves
    one) and its tokenizer_config.json: the specials, "▁", the printable ASCII characters and
    a few accented ones, and some words with and without "▁", scored so that whole words win.
    Other characters are unknown (id 2), as in T5. Returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import Unigram

    chars = [chr(c) for c in range(33, 127)] + list("éèüöñç")
    vocab = [(t, 0.0) for t in T5_SPECIALS] + [("▁", -2.0)] + [(c, -8.0) for c in chars]
    vocab += [(prefix + word, -3.0 - 0.1 * n) for n, word in enumerate(_T5_WORDS) for prefix in ("▁", "")]
    tokenizer = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tokenizer.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                             special_tokens=[("</s>", 1)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in T5_SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    write_json(folder / "tokenizer_config.json", {
        "added_tokens_decoder": {str(i): {**flags, "content": t} for i, t in enumerate(T5_SPECIALS)},
        "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "extra_ids": 0,
        "additional_special_tokens": [], "model_max_length": max_length, "tokenizer_class": "T5Tokenizer",
        "clean_up_tokenization_spaces": True})
    return len(vocab)


def text_config(vocab_size: int, **extra: Any) -> dict[str, Any]:
    return {"model_type": "clip_text_model", "vocab_size": vocab_size, "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": _MAX_LENGTH, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
            "bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - 1,
            "projection_dim": TEXT_HIDDEN, **extra}


def random_params(module: Any, seed: int, stream: int) -> dict:
    """Parameters shaped by the module's own initialiser, filled with seeded NumPy values.

    Only the shapes come from JAX (`eval_shape`, no compilation): running the initialisers
    compiles hundreds of them and takes about a minute on a 2-core CPU. The values follow
    Flax's defaults (LeCun-normal kernels and embeddings, zero biases, unit norm scales).
    """
    rng = np.random.default_rng([seed, stream])
    shapes = flatten_dict(parameter_shapes(module))
    params = {}
    for path, leaf in sorted(shapes.items()):
        if path[-1] == "bias":
            value = np.zeros(leaf.shape)
        elif path[-1] == "scale":
            value = np.ones(leaf.shape)
        else:  # "kernel" (Dense, Conv) or "embedding"
            value = rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        params[path] = value.astype(leaf.dtype)
    return unflatten_dict(params)


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_pipeline(out: pathlib.Path, family: Family, configs: dict[str, dict[str, Any]],
                   scheduler: dict[str, Any], seed: int, tokenizers: dict[str, list[str]]) -> None:
    """A diffusers folder of `family`'s components with seeded random weights (Flax msgpack),
    their configs, the scheduler config and model_index.json, which names `tokenizers`
    (folder -> [library, class]); the tokenizers' files are the recipe's to write."""
    index: dict[str, Any] = {"_class_name": family.pipelines[0], "scheduler": ["diffusers", scheduler["_class_name"]],
                             **tokenizers}
    for stream, (name, component) in enumerate(sorted(family.components.items())):
        module = component.module(component.config.from_dict(configs[name]))
        library = "diffusers" if component.kind in DIFFUSERS_KINDS else "transformers"
        weights = "diffusion_flax_model.msgpack" if library == "diffusers" else "flax_model.msgpack"
        write_json(out / name / "config.json", configs[name])
        (out / name / weights).write_bytes(msgpack_serialize(random_params(module, seed, stream)))
        index[name] = [library, type(module).__name__]
    write_json(out / "scheduler" / "scheduler_config.json", scheduler)
    write_json(out / "model_index.json", index)
