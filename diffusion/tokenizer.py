"""The tokenizers of the text encoders, giving the ids diffusers' PyTorch pipelines get: CLIP's
byte-level BPE (every family) and T5's SentencePiece Unigram (Flux's second encoder, `T5Tokenizer`).

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
T5's tokenizer is rebuilt the same way from its tokenizer.json (see `T5Tokenizer`), so the worker
needs no sentencepiece either.
"""

from __future__ import annotations

import base64
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
from tokenizers.models import BPE, Unigram

# transformers 5.23 `CLIPTokenizer.__init__`, verbatim.
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_DEFAULTS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"}
# transformers 5's T5Tokenizer: its named tokens' defaults, and the id it gives unknown pieces
# (always 2, whatever the file says: it rebuilds the Unigram model).
_T5_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_T5_UNK_ID = 2
# The order transformers adds named special tokens in (`SPECIAL_TOKENS_ATTRIBUTES`): when two share
# a content with different flags, the later one's flags win.
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used; the message names the file."""


class FixedLength:
    """Encodes prompts to fixed-length id rows: `tokenizer(texts, padding="max_length",
    max_length=max_length, truncation=True).input_ids`, as diffusers' pipelines call it; the
    `tokenizers` pipeline (truncation, special tokens, padding) is the subclass's."""

    max_length: int
    _tokenizer: Tokenizer

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """(len(texts), max_length) int32 ids, padded or cut; and, per text, whether tokens were cut."""
        if not texts:
            return np.zeros((0, self.max_length), np.int32), []
        encodings = self._tokenizer.encode_batch_fast(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int32)
        return ids, [bool(e.overflowing) for e in encodings]


class CLIPTokenizer(FixedLength):
    """CLIP's tokenizer: BOS, at most max_length - 2 tokens, EOS, then pad ids."""

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

        added, named = _special_tokens(folder, config, special_map, serialized, _DEFAULTS, vocab)
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
        _add_tokens(folder, tokenizer, added)
        try:
            return cls(tokenizer, max_length, named["bos_token"], named["eos_token"], named["pad_token"])
        except TokenizerError as err:
            raise TokenizerError(f"{folder}: {err}") from err


class T5Tokenizer(FixedLength):
    """T5's SentencePiece Unigram tokenizer as transformers 5's T5Tokenizer (T5TokenizerFast)
    rebuilds it from a tokenizer.json, whatever else the file describes: the vocabulary and
    scores, unknown pieces as id 2, the file's precompiled SentencePiece normalizer (if any),
    whitespace split then Metaspace ("▁" before every word), `</s>` appended, padded with the
    pad id or cut to `max_length` (diffusers' max_sequence_length, which the pipeline chooses,
    not the folder)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, eos: str, pad: str) -> None:
        self.max_length = max_length
        eos_id, pad_id = _token_id(tokenizer, eos), _token_id(tokenizer, pad)
        tokenizer.post_processor = processors.TemplateProcessing(single=["$A", eos], pair=["$A", eos, "$B", eos],
                                                                 special_tokens=[(eos, eos_id)])
        tokenizer.enable_truncation(max_length)
        tokenizer.enable_padding(length=max_length, pad_id=pad_id, pad_token=pad)
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: Path, max_length: int) -> T5Tokenizer:
        """Reads a diffusers `tokenizer_2/` folder: tokenizer.json (a Unigram model) and
        tokenizer_config.json (special and added tokens)."""
        folder = Path(folder)
        source = folder / "tokenizer.json"
        serialized = _read_json(source)
        config = _read_json(folder / "tokenizer_config.json")
        model = serialized.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if (not isinstance(model, dict) or model.get("type") != "Unigram" or not isinstance(vocab, list)
                or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                           and isinstance(v[1], (int, float)) for v in vocab)):
            raise TokenizerError(f"{source}: model must be a Unigram model whose vocab lists [piece, score] pairs")
        if len(vocab) <= _T5_UNK_ID:
            raise TokenizerError(f"{source}: model.vocab has {len(vocab)} pieces; T5's unknown piece is id {_T5_UNK_ID}")
        pieces = {piece: i for i, (piece, _) in enumerate(vocab)}
        added, named = _special_tokens(folder, config, None, serialized, _T5_DEFAULTS, pieces)
        tokenizer = Tokenizer(Unigram([(piece, float(score)) for piece, score in vocab], unk_id=_T5_UNK_ID,
                                      byte_fallback=False))
        charsmap = _precompiled_charsmap(serialized.get("normalizer"))
        if charsmap is not None:
            try:
                tokenizer.normalizer = normalizers.Precompiled(charsmap)
            except Exception as err:  # tokenizers raises a bare Exception
                raise TokenizerError(f"{source}: normalizer's precompiled_charsmap is unusable ({err})") from err
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ])
        _add_tokens(folder, tokenizer, added)
        try:
            return cls(tokenizer, max_length, named["eos_token"], named["pad_token"])
        except TokenizerError as err:
            raise TokenizerError(f"{folder}: {err}") from err


def _precompiled_charsmap(normalizer: Any) -> bytes | None:
    """The SentencePiece charsmap of a tokenizer.json's normalizer, as transformers 5 takes it
    (the first `Precompiled` one, alone or in a Sequence; the other normalizers are dropped)."""
    if not isinstance(normalizer, dict):
        return None
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "Precompiled" and "precompiled_charsmap" in part:
            return base64.b64decode(part["precompiled_charsmap"])
    return None

def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"special token {token!r} is in neither the vocabulary nor the added tokens")
    return token_id


def _special_tokens(folder: Path, config: dict[str, Any], special_map: dict[str, Any] | None,
                    serialized: dict[str, Any] | None, defaults: dict[str, str],
                    vocab: dict[str, int]) -> tuple[list[tuple[AddedToken, int | None]], dict[str, str]]:
    """`_added_tokens`, each named token checked to be in the vocabulary or declared."""
    try:
        added, named = _added_tokens(config, special_map, serialized, defaults)
    except (ValueError, TypeError, AttributeError) as err:
        raise TokenizerError(f"{folder / 'tokenizer_config.json'} (or special_tokens_map.json, "
                             f"tokenizer.json): unusable added or special tokens ({err})") from err
    declared = {token.content for token, token_id in added if token_id is not None}
    for key in defaults:
        if named[key] not in vocab and named[key] not in declared:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: {key} {named[key]!r} is not in the vocabulary")
    return added, named


def _add_tokens(folder: Path, tokenizer: Tokenizer, added: list[tuple[AddedToken, int | None]]) -> None:
    """Registers the added tokens (matched in the raw text before any splitting), each checked
    to get the id the files promise."""
    for token, expected_id in added:
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if expected_id is not None and tokenizer.token_to_id(token.content) != expected_id:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: added token {token.content!r} "
                                 f"has id {expected_id} but the vocabulary gives it "
                                 f"{tokenizer.token_to_id(token.content)}")


def _added_tokens(config: dict[str, Any], special_map: dict[str, Any] | None, serialized: dict[str, Any] | None,
                  defaults: dict[str, str]) -> tuple[list[tuple[AddedToken, int | None]], dict[str, str]]:
    """The added tokens in the order transformers 5 registers them (with the id the files promise, if
    any), and the named special tokens' contents.

    A config with `added_tokens_decoder` (written by transformers >= 4.34) lists them; else, the legacy
    way, special_tokens_map.json overrides the config's named tokens and tokenizer.json's
    `added_tokens` come first. Named tokens whose content is not listed yet follow, in `_NAMED` order.
    """
    values = {**defaults, **{k: config[k] for k in _NAMED if config.get(k) is not None}}
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
