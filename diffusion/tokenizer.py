"""CLIP's byte-level BPE tokenizer, giving the ids the PyTorch Stable Diffusion pipelines get.

The reference is transformers 5.x `CLIPTokenizer`, which is no longer a Python BPE: its constructor
builds a `tokenizers` pipeline (NFC; every run of whitespace to one space; lower case; CLIP's split
regex; byte-level mapping; BPE with `</w>` word ends; BOS/EOS around the tokens) from the folder's
vocabulary and merges, whatever other pipeline a `tokenizer.json` in the folder describes. We build
the same pipeline here, so the worker needs neither transformers nor ftfy (transformers 5 never uses
ftfy), and a batch is encoded in one call into Rust.

The folder's config decides two things that change ids: the pad token (SD 1.x pads with
`<|endoftext|>`, SD 2.x and SDXL's tokenizer_2 with `!`) and the "added tokens" that are matched in
the raw text before any splitting. transformers 5 registers every special token (pad included) as an
added token, so with pad `!` every `!` in a prompt becomes id 0 on its own; whether `<|endoftext|>`
in a prompt is matched before or after lower-casing depends on each token's `normalized` flag. We
gather the added tokens from the config files the way transformers 5 does (see `_added_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

# transformers 5.23 `CLIPTokenizer.__init__`, verbatim.
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_DEFAULTS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"}
# The order transformers adds named special tokens in (`SPECIAL_TOKENS_ATTRIBUTES`): when two share
# a content with different flags, the later one's flags win.
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used; the message names the file."""


class CLIPTokenizer:
    """Encodes prompts to fixed-length id rows: `tokenizer(texts, padding="max_length",
    max_length=model_max_length, truncation=True).input_ids`, as diffusers' pipelines call it."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, bos: str, eos: str, pad: str) -> None:
        self.max_length = max_length
        self.bos_id, self.eos_id, self.pad_id = (_token_id(tokenizer, t) for t in (bos, eos, pad))
        tokenizer.post_processor = processors.RobertaProcessing(
            (eos, self.eos_id), (bos, self.bos_id), trim_offsets=False, add_prefix_space=False
        )
        tokenizer.enable_truncation(max_length)
        tokenizer.enable_padding(length=max_length, pad_id=self.pad_id, pad_token=pad)
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: Path) -> CLIPTokenizer:
        """Reads a diffusers `tokenizer/` or `tokenizer_2/` folder: `tokenizer_config.json`, optional
        `special_tokens_map.json`, and the vocabulary and merges from `tokenizer.json` if present (as
        transformers 5 does; it is all it writes), else from `vocab.json` and `merges.txt`."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json", missing_ok=True)
        serialized = _read_json(folder / "tokenizer.json", missing_ok=True)
        if serialized is not None:
            source = folder / "tokenizer.json"
            vocab, merges = _from_serialized(source, serialized)
        else:
            source = folder / "merges.txt"
            vocab, merges = _read_vocab(folder / "vocab.json"), _read_merges(source)
        max_length = config.get("model_max_length")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or not 2 <= max_length <= 4096:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: model_max_length={max_length!r} "
                                 "must be the text encoder's sequence length (77 for CLIP)")

        try:
            added, named = _added_tokens(config, special_map, serialized)
        except (ValueError, TypeError, AttributeError) as err:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'} (or special_tokens_map.json, "
                                 f"tokenizer.json): unusable added or special tokens ({err})") from err
        declared = {token.content for token, token_id in added if token_id is not None}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if named[key] not in vocab and named[key] not in declared:
                raise TokenizerError(f"{folder / 'tokenizer_config.json'}: {key} {named[key]!r} is not in the "
                                     "vocabulary")
        try:
            bpe = BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                      end_of_word_suffix="</w>", fuse_unk=False, unk_token=named["unk_token"])
        except Exception as err:  # tokenizers raises a bare Exception naming the token
            raise TokenizerError(f"{source}: the merges do not fit the vocabulary ({err})") from err
        tokenizer = Tokenizer(bpe)
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
        )
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        for token, expected_id in added:
            if token.special:
                tokenizer.add_special_tokens([token])
            else:
                tokenizer.add_tokens([token])
            if expected_id is not None and tokenizer.token_to_id(token.content) != expected_id:
                raise TokenizerError(f"{folder / 'tokenizer_config.json'}: added token {token.content!r} "
                                     f"has id {expected_id} but the vocabulary gives it "
                                     f"{tokenizer.token_to_id(token.content)}")
        try:
            return cls(tokenizer, max_length, named["bos_token"], named["eos_token"], named["pad_token"])
        except TokenizerError as err:
            raise TokenizerError(f"{folder}: {err}") from err

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """(len(texts), max_length) int32 ids: BOS, at most max_length - 2 tokens, EOS, then pad ids;
        and, per text, whether tokens were cut."""
        if not texts:
            return np.zeros((0, self.max_length), np.int32), []
        encodings = self._tokenizer.encode_batch_fast(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int32)
        return ids, [bool(e.overflowing) for e in encodings]


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"special token {token!r} is in neither the vocabulary nor the added tokens")
    return token_id


def _added_tokens(config: dict[str, Any], special_map: dict[str, Any] | None,
                  serialized: dict[str, Any] | None) -> tuple[list[tuple[AddedToken, int | None]], dict[str, str]]:
    """The added tokens in the order transformers 5 registers them (with the id the files promise, if
    any), and the named special tokens' contents.

    A config with `added_tokens_decoder` (written by transformers >= 4.34) lists them; else, the legacy
    way, special_tokens_map.json overrides the config's named tokens and tokenizer.json's
    `added_tokens` come first. Named tokens whose content is not listed yet follow, in `_NAMED` order.
    """
    values = {**_DEFAULTS, **{k: config[k] for k in _NAMED if config.get(k) is not None}}
    listed: list[tuple[AddedToken, int | None]] = []
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"]
        listed = [(_added_token(decoder[i], special=None), int(i)) for i in sorted(decoder, key=int)]
    else:
        values.update({k: v for k, v in (special_map or {}).items() if k in _NAMED and v is not None})
        for entry in (serialized or {}).get("added_tokens", []):
            listed.append((_added_token(entry, special=None), entry.get("id")))
    contents = {token.content for token, _ in listed}
    named_tokens = [(_added_token(values[k], special=True), None) for k in _NAMED if k in values]
    # Same content twice (eos, unk and pad are all <|endoftext|> in SD 1.x): the last one's flags
    # win. tokenizers >= 0.23 does that itself; 0.22 would keep matching with the earlier flags too.
    unique = {token.content: (token, i) for token, i in listed}
    unique.update((token.content, (token, i)) for token, i in named_tokens if token.content not in contents)
    return list(unique.values()), {k: _added_token(v, special=True).content for k, v in values.items()}


def _added_token(value: str | dict[str, Any], special: bool | None) -> AddedToken:
    """An AddedToken from a config string or dict; `special` forces the flag (named tokens)."""
    if isinstance(value, str):
        return AddedToken(value, special=bool(special))
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        raise TokenizerError(f"special token {value!r} must be a string or a dict with a content")
    flags = {k: bool(value[k]) for k in _FLAGS if k in value}
    if special is not None:
        flags["special"] = special
    return AddedToken(value["content"], **flags)


def _read_json(path: Path, missing_ok: bool = False) -> Any:
    """A JSON object file (None if missing and missing_ok)."""
    if missing_ok and not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise TokenizerError(f"{path}: missing from the tokenizer folder") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path}: not a readable JSON file ({err})") from err
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: must hold a JSON object")
    return value


def _is_vocab(vocab: Any) -> bool:
    return isinstance(vocab, dict) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vocab.values()
    )


def _read_vocab(path: Path) -> dict[str, int]:
    vocab = _read_json(path)
    if not _is_vocab(vocab):
        raise TokenizerError(f"{path}: must map each token to a non-negative integer id")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt as the `tokenizers` library reads it: an optional `#version` line, then one
    space-separated pair per line (text mode reads CRLF line ends as LF)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError as err:
        raise TokenizerError(f"{path}: missing from the tokenizer folder") from err
    except (OSError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{path}: not a readable UTF-8 file ({err})") from err
    if lines and lines[-1] == "":
        lines.pop()
    merges = []
    for number, line in enumerate(lines, start=1):
        if line.startswith("#version"):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise TokenizerError(f"{path}: line {number} is not a pair of tokens separated by a space: {line!r}")
        merges.append((pair[0], pair[1]))
    return merges


def _from_serialized(path: Path, serialized: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary and merges of a tokenizer.json (merges as "a b" strings or [a, b] pairs)."""
    model = serialized.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        raise TokenizerError(f"{path}: model must be a BPE model")
    vocab, raw = model.get("vocab"), model.get("merges")
    if not _is_vocab(vocab):
        raise TokenizerError(f"{path}: model.vocab must map each token to a non-negative integer id")
    if not isinstance(raw, list):
        raise TokenizerError(f"{path}: model.merges must be a list")
    merges = []
    for merge in raw:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise TokenizerError(f"{path}: model.merges holds {merge!r}, not a pair of tokens")
        merges.append((pair[0], pair[1]))
    return vocab, merges
