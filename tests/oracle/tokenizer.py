"""Reference ids for diffusion/tokenizer.py: what transformers 5.23's `CLIPTokenizer` (the tokenizer
diffusers' PyTorch pipelines load) gives for hard prompts, for each kind of tokenizer folder.

`write(data)` runs in the oracle venv (transformers 5.23) and writes `data/tokenizer/`. The
folder-building helpers, which need neither torch nor transformers, are harness/tokenizer.py's
(the benchmarks build the same folders).

The real CLIP vocabulary comes from open_clip's `bpe_simple_vocab_16e6.txt.gz`, built as OpenAI's
`simple_tokenizer.py` builds it (and so HF's openai/clip-vit-large-patch14 files): the 256
byte characters of `bytes_to_unicode`, the same with `</w>`, one token per merge for the first
48,894 merges, then `<|startoftext|>` and `<|endoftext|>` (49,408 ids). `write` checks the bytes
of merges.txt and of vocab.json (keys sorted, as HF's file) against the SHA-256 of the files in
public SD 1.5 / 2.x / SDXL pipeline folders. Only merges.txt is committed (525 KB): vocab.json
(961 KB, and once per folder) is derived from it by `clip_vocab` when a folder is built.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from harness.tokenizer import (
    BOS,
    EOS,
    build_folder,
    bytes_to_unicode,
    clip_vocab,
    read_merges,
    vocab_json,
)

CLIP_MERGES = 49152 - 256 - 2  # the slice CLIP's tokenizers take of the 262,144 merges in the file
MERGES_SHA256 = "9fd691f7c8039210e0fced15865466c65820d09b63988b0174bfe25de299051a"
VOCAB_SHA256 = "f3494b2b345fa180ca51ec80ab47d1bbb0218d60089264d5ee9bb0619af4a4b7"


def _legacy(content: str, type_field: bool) -> dict[str, Any]:
    token = {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True}
    return {**token, "__type": "AddedToken"} if type_field else token


def _decoder(*tokens: tuple[int, str, bool]) -> dict[str, Any]:
    return {str(i): {"content": c, "lstrip": False, "normalized": n, "rstrip": False, "single_word": False,
                     "special": True} for i, c, n in tokens}


def _legacy_config(name: str) -> dict[str, Any]:
    return {"errors": "replace", "unk_token": _legacy(EOS, True), "bos_token": _legacy(BOS, True),
            "eos_token": _legacy(EOS, True), "pad_token": EOS, "add_prefix_space": False, "do_lower_case": True,
            "model_max_length": 77, "name_or_path": name, "special_tokens_map_file": "./special_tokens_map.json",
            "tokenizer_class": "CLIPTokenizer"}


def _new_config(pad: str, decoder: dict[str, Any]) -> dict[str, Any]:
    return {"add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": BOS,
            "clean_up_tokenization_spaces": True, "do_lower_case": True, "eos_token": EOS, "errors": "replace",
            "model_max_length": 77, "pad_token": pad, "tokenizer_class": "CLIPTokenizer", "unk_token": EOS}


def _special_map(pad: str, eos_normalized: bool = True) -> dict[str, Any]:
    eos = {**_legacy(EOS, False), "normalized": eos_normalized}
    return {"bos_token": _legacy(BOS, False), "eos_token": eos, "unk_token": eos, "pad_token": pad}


# tokenizer_config.json and special_tokens_map.json of real pipelines (same contents as the files in
# public copies of runwayml SD 1.5, stabilityai SD 2.x and SDXL base 1.0); they share CLIP's vocab.
CLIP_FOLDERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # SD 1.x: the legacy format; pad is <|endoftext|>.
    "sd": (_legacy_config("openai/clip-vit-large-patch14"), _special_map(EOS)),
    # SD 2.x: the config says pad <|endoftext|> but special_tokens_map.json, which wins, says "!".
    "sd2": (_legacy_config("stabilityai/stable-diffusion-2"), _special_map("!")),
    # SDXL tokenizer (CLIP ViT-L) and tokenizer_2 (OpenCLIP bigG, pad "!"): the newer format.
    "sdxl": (_new_config(EOS, _decoder((49406, BOS, True), (49407, EOS, False))),
             {**_special_map(EOS, eos_normalized=False), "pad_token": {**_legacy(EOS, False), "normalized": False}}),
    "sdxl_2": (_new_config("!", _decoder((0, "!", False), (49406, BOS, True), (49407, EOS, False))),
               _special_map("!", eos_normalized=False)),
}

# diffusion/tiny.py's byte-level tokenizers as transformers 4.57's save_pretrained writes them.
TINY_FOLDERS = {
    "tiny": EOS,
    "tiny_2": "!",
}

TYPICAL = [
    "a lighthouse on a cliff at dawn, oil painting",
    "a red fox in fresh snow, telephoto photograph",
    "an astronaut riding a horse on mars",
    "portrait of a woman, highly detailed, 8k, trending on artstation, by greg rutkowski",
    "(masterpiece:1.2), best quality, [blurry], <lora:style:0.8>, ((sharp focus))",
    "low quality, worst quality, jpeg artifacts, watermark, text, signature",
]

_LONG_WORD = "supercalifragilisticexpialidocious"
HARD_TEXTS = TYPICAL + [
    # empty, whitespace, leading/trailing spaces
    "", " ", "   ", "\t\n", "  a cat  ", "\ta cat\n",
    "a\tcat\n\nsitting   on  a mat", "a\r\ncat\rdog\x0bbird\x0cfish",
    "a\u00a0cat\u2003dog\u3000bird\u2028fish\u2029end\u0085x", "a\x1ccat\x1dx\x1ey\x1fz",
    # invisible and control characters
    "zero\u200bwidth", "soft\u00adhyphen", "\ufeffbom first", "a\x00b\x07c", "replacement \ufffd char",
    # quotes and apostrophes
    "the cat's toy", "I'll go, we've been, they're here, I'd say, I'm done, don't",
    "THE CAT'S TOY", "cat\u2019s toy", "\u201cquoted\u201d and \u2018single\u2019", "'single' \"double\"",
    "``backticks`` and ''two''", "it''s", "rock'n'roll", "'s 't 're", "o'clock '90s",
    # case
    "A PHOTO OF A CAT", "MiXeD CaSe", "\u0130stanbul", "STRASSE \u1e9e", "\u039f\u0394\u039f\u03a3 \u03a3\u03a3",
    "\u01c5 digraph", "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0422\u0435\u043a\u0441\u0442",
    # numbers
    "1024x768", "3.14159", "2023\u5e74", "\u2460\u2461\u2462", "\u00bd cup", "\u0663\u0664\u0665",
    "\u216b o'clock", "v1.5 4k 8K UHD", "007 agent 1,000,000",
    # punctuation runs
    "wow!!!", "?!?!", "...", "--", "hello!world", "!important", "a/b\\c", "~`^", "a,b,c", "snake_case_word",
    "#hashtag @user", "&amp; &quot;html&quot;", "(((((((",
    # special tokens' text: matched as added tokens (before or after lower-casing) or split by the regex
    "<|endoftext|>", "<|ENDOFTEXT|>", "<|ENDOFTEXT|>@home", "a<|EndOfText|>.b", "a <|startoftext|> b <|endoftext|> c",
    "<|StartOfText|>",
    # CJK, other scripts
    "\u4e00\u53ea\u732b\u5750\u5728\u57ab\u5b50\u4e0a", "\u5bcc\u58eb\u5c71\u306e\u98a8\u666f",
    "\ud55c\uad6d\uc5b4 \ud504\ub86c\ud504\ud2b8", "cat\u732bdog",
    "\uff26\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48", "\u0928\u092e\u0938\u094d\u0924\u0947",
    "\u0645\u0631\u062d\u0628\u0627", "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",
    # emoji
    "\U0001f431", "\U0001f431\U0001f436 cats and dogs", "\U0001f44d\U0001f3fd", "\U0001f1ef\U0001f1f5",
    "\u2764\ufe0f", "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    # Unicode normalisation: NFC composes, compatibility forms stay
    "caf\u00e9", "cafe\u0301", "\u212b ngstr\u00f6m", "\ufb01ne \ufb02ow", "e\u0301\u0301\u0301", "\u1100\u1161",
    "Ti\u1ebfng Vi\u1ec7t", "n\u0303o\u0308", "q\u0301", "\u2126 ohm",
    # truncation: 75 tokens fit, 76 do not; a cut inside a word; long texts
    "a " * 75, "a " * 76, "a " * 72 + _LONG_WORD, "a photo of " + (_LONG_WORD + " ") * 20,
    "a" * 300, ("a red cat on a mat, " * 40).strip(),
]


def _dump(path: Path, value: Any, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n", encoding="utf-8")


def _write_tiny(folder: Path, pad: str) -> None:
    """diffusion/tiny.py's tokenizer (every UTF-8 byte a token, no merges) as transformers 4.57 saves it."""
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + [BOS, EOS]
    folder.mkdir(parents=True)
    _dump(folder / "vocab.json", {token: i for i, token in enumerate(tokens)}, sort_keys=True)
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    specials = [(0, "!", False)] if pad == "!" else []
    config = {"added_tokens_decoder": _decoder(*specials, (512, BOS, True), (513, EOS, True)),
              "bos_token": BOS, "clean_up_tokenization_spaces": False, "eos_token": EOS, "errors": "replace",
              "extra_special_tokens": {}, "model_max_length": 77, "pad_token": pad,
              "tokenizer_class": "CLIPTokenizer", "unk_token": EOS}
    _dump(folder / "tokenizer_config.json", config)
    special_map = {"bos_token": _legacy(BOS, False), "eos_token": _legacy(EOS, False), "pad_token": pad,
                   "unk_token": _legacy(EOS, False)}
    _dump(folder / "special_tokens_map.json", special_map, sort_keys=True)


def _rows(rows: list[list[int]]) -> str:
    return "[\n" + ",\n".join("      " + json.dumps(r) for r in rows) + "\n    ]"


def write(data: Path) -> None:
    """Writes data/tokenizer/: merges.txt, the CLIP and tiny folders, and ids.json with transformers
    5.23's ids and truncation flags for HARD_TEXTS in every folder."""
    import importlib.util
    import tempfile

    import tokenizers
    import transformers

    root = data / "tokenizer"
    # open_clip may be installed without its dependencies: find its data file without importing it.
    # Without open_clip, the committed merges.txt is kept (its bytes are checked below either way).
    spec = importlib.util.find_spec("open_clip")
    if spec is not None:
        (package,) = spec.submodule_search_locations
        lines = gzip.open(Path(package) / "bpe_simple_vocab_16e6.txt.gz").read().decode("utf-8").split("\n")
        merges = lines[1 : 1 + CLIP_MERGES]
    else:
        merges = read_merges(root / "merges.txt")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    assert hashlib.sha256((root / "merges.txt").read_bytes()).hexdigest() == MERGES_SHA256
    assert len(clip_vocab(merges)) == 49408
    assert hashlib.sha256(vocab_json(merges).encode()).hexdigest() == VOCAB_SHA256
    for name, (config, special_map) in CLIP_FOLDERS.items():
        (root / name).mkdir()
        _dump(root / name / "tokenizer_config.json", config)
        _dump(root / name / "special_tokens_map.json", special_map)
    for name, pad in TINY_FOLDERS.items():
        _write_tiny(root / name, pad)

    with tempfile.TemporaryDirectory() as tmp:
        loaded = {name: transformers.CLIPTokenizer.from_pretrained(build_folder(data, name, Path(tmp) / name))
                  for name in [*CLIP_FOLDERS, *TINY_FOLDERS]}
        # tiny_2 as transformers 5 saves it: tokenizer.json and tokenizer_config.json only
        loaded["tiny_2"].save_pretrained(root / "tiny_5")
        loaded["tiny_5"] = transformers.CLIPTokenizer.from_pretrained(root / "tiny_5")
    results = {}
    for name, tok in loaded.items():
        assert isinstance(tok, transformers.TokenizersBackend), type(tok)
        ids = tok(HARD_TEXTS, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
        full = tok(HARD_TEXTS).input_ids
        results[name] = {"truncated": [len(f) > tok.model_max_length for f in full], "ids": ids}
    cut = HARD_TEXTS.index("a " * 72 + _LONG_WORD)  # the cut must fall inside the long word
    word_ids = loaded["sd"](HARD_TEXTS[cut]).word_ids()
    assert word_ids[75] == word_ids[76] is not None, word_ids[70:]

    folders = ",\n".join(
        f'    "{name}": {{\n      "truncated": {json.dumps(r["truncated"])},\n      "ids": {_rows(r["ids"])}}}'
        for name, r in results.items()
    )
    texts = ",\n".join("    " + json.dumps(t) for t in HARD_TEXTS)
    (root / "ids.json").write_text(
        f'{{\n  "transformers": "{transformers.__version__}",\n  "tokenizers": "{tokenizers.__version__}",\n'
        f'  "texts": [\n{texts}\n  ],\n  "folders": {{\n{folders}\n  }}\n}}\n',
        encoding="utf-8",
    )
