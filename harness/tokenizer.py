"""Tokenizer folders from the committed tokenizer data (tests/data/tokenizer/), for the tests
and the benchmarks: CLIP's real vocabulary is derived from the one committed merges.txt, so it
is written once per folder when a folder is built, never committed. tests/oracle/tokenizer.py
writes that data and says where it comes from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which CLIP's vocabulary is written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def read_merges(path: Path) -> list[str]:
    """The merges of a committed merges.txt (HF format: a `#version` line, then "a b" lines)."""
    return path.read_text(encoding="utf-8").splitlines()[1:]


def clip_vocab(merges: list[str]) -> dict[str, int]:
    """CLIP's vocabulary for its merges, ids in OpenAI's order."""
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + [m.replace(" ", "") for m in merges] + [BOS, EOS]
    return {token: i for i, token in enumerate(tokens)}


def vocab_json(merges: list[str]) -> str:
    """vocab.json exactly as HF's CLIP tokenizer folders hold it."""
    return json.dumps(clip_vocab(merges), ensure_ascii=False, sort_keys=True)


def build_folder(data: Path, name: str, dest: Path) -> Path:
    """A complete tokenizer folder `dest` for one of data/tokenizer/'s folders. A CLIP folder
    is committed without a vocabulary of its own (no vocab.json, no tokenizer.json): it gets
    the shared merges.txt and the vocab.json derived from it."""
    root = data / "tokenizer"
    shutil.copytree(root / name, dest)
    if not (dest / "vocab.json").exists() and not (dest / "tokenizer.json").exists():
        shutil.copy(root / "merges.txt", dest / "merges.txt")
        (dest / "vocab.json").write_text(vocab_json(read_merges(root / "merges.txt")), encoding="utf-8")
    return dest
