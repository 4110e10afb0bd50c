"""diffusion/tokenizer.py against transformers 5.23's CLIPTokenizer, whose ids for hard prompts in each
kind of tokenizer folder (SD 1.x, SD 2.x, SDXL's two, the tiny byte-level ones) are committed in
tests/data/tokenizer/ by tests/oracle/tokenizer.py. No torch or transformers needed."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from diffusion.tokenizer import CLIPTokenizer, TokenizerError
from harness.tokenizer import build_folder, read_merges, vocab_json
from tests.oracle.tokenizer import (
    CLIP_FOLDERS,
    MERGES_SHA256,
    TINY_FOLDERS,
    VOCAB_SHA256,
)

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "tokenizer" / "ids.json").read_text(encoding="utf-8"))
TEXTS: list[str] = REFERENCE["texts"]
NAMES = [*CLIP_FOLDERS, *TINY_FOLDERS, "tiny_5"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tokenizers")
    built = {name: build_folder(DATA, name, tmp / name) for name in [*CLIP_FOLDERS, *TINY_FOLDERS]}
    return {**built, "tiny_5": DATA / "tokenizer" / "tiny_5"}  # tokenizer.json only, as transformers 5 saves


@pytest.fixture(scope="module")
def loaded(folders: dict[str, Path]) -> dict[str, CLIPTokenizer]:
    return {name: CLIPTokenizer.from_folder(folder) for name, folder in folders.items()}


def test_the_reference_covers_every_folder() -> None:
    assert sorted(REFERENCE["folders"]) == sorted(NAMES)
    assert REFERENCE["transformers"].startswith("5.")


def test_vocab_and_merges_are_clips(folders: dict[str, Path]) -> None:
    """Byte for byte the files of HF's CLIP ViT-L/14 tokenizer (as in SD 1.5's tokenizer/ folder)."""
    merges = DATA / "tokenizer" / "merges.txt"
    assert hashlib.sha256(merges.read_bytes()).hexdigest() == MERGES_SHA256
    assert hashlib.sha256(vocab_json(read_merges(merges)).encode()).hexdigest() == VOCAB_SHA256
    assert (folders["sd"] / "vocab.json").read_text(encoding="utf-8") == vocab_json(read_merges(merges))


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_transformers(loaded: dict[str, CLIPTokenizer], name: str) -> None:
    expected = REFERENCE["folders"][name]
    ids, cut = loaded[name](TEXTS)
    assert ids.dtype == np.int32 and ids.shape == (len(TEXTS), 77)
    wrong = [(text, row[:12]) for text, row, want in zip(TEXTS, ids.tolist(), expected["ids"]) if row != want]
    assert not wrong, f"{len(wrong)} texts differ, e.g. {wrong[:3]}"
    assert cut == expected["truncated"]


@pytest.mark.parametrize(("name", "bos", "eos", "pad"), [
    ("sd", 49406, 49407, 49407), ("sd2", 49406, 49407, 0), ("sdxl", 49406, 49407, 49407),
    ("sdxl_2", 49406, 49407, 0), ("tiny", 512, 513, 513), ("tiny_2", 512, 513, 0), ("tiny_5", 512, 513, 0),
])
def test_special_ids(loaded: dict[str, CLIPTokenizer], name: str, bos: int, eos: int, pad: int) -> None:
    tok = loaded[name]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.max_length) == (bos, eos, pad, 77)
    ids, cut = tok(["a photo of a cat"])
    assert ids[0, 0] == bos and cut == [False]
    (end,) = np.flatnonzero(ids[0] == eos)[:1]
    assert (ids[0, end + 1 :] == pad).all()


def test_known_clip_ids(loaded: dict[str, CLIPTokenizer]) -> None:
    ids, _ = loaded["sd"](["a photo of a cat", "A  PHOTO of a\tcat!"])
    assert ids[0, :7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert ids[1, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 256, 49407]
    # transformers 5 makes every special token an added token, so with pad "!" each "!" is id 0
    ids, _ = loaded["sdxl_2"](["wow!!! a cat!"])
    assert ids[0, :9].tolist() == [49406, 2781, 0, 0, 0, 320, 2368, 0, 49407]


def test_truncation(loaded: dict[str, CLIPTokenizer]) -> None:
    tok = loaded["sd"]
    word = "supercalifragilisticexpialidocious"
    ids, cut = tok(["a " * 75, "a " * 76, "a " * 72 + word, ""])
    assert cut == [False, True, True, False]
    assert ids[0].tolist() == [49406] + [320] * 75 + [49407]
    assert ids[1].tolist() == ids[0].tolist()
    word_ids = tok([word])[0][0]
    pieces = word_ids[1 : np.flatnonzero(word_ids == 49407)[0]].tolist()
    assert len(pieces) >= 4  # so the cut (after 75 tokens) falls inside the word
    assert ids[2].tolist() == [49406] + [320] * 72 + pieces[:3] + [49407]
    assert ids[3].tolist() == [49406] + [49407] * 76


def test_batch_order_and_duplicates(loaded: dict[str, CLIPTokenizer]) -> None:
    tok = loaded["sdxl_2"]
    singles = {text: tok([text]) for text in TEXTS[:12]}
    batch = [TEXTS[3], TEXTS[0], TEXTS[3], TEXTS[11], TEXTS[0], "a " * 90]
    ids, cut = tok(batch)
    for row, flag, text in zip(ids, cut, batch[:5]):
        assert row.tolist() == singles[text][0][0].tolist() and [flag] == singles[text][1]
    assert cut[5] is True
    empty_ids, empty_cut = tok([])
    assert empty_ids.shape == (0, 77) and empty_ids.dtype == np.int32 and empty_cut == []


def test_crlf_merges_read_the_same(folders: dict[str, Path], loaded: dict[str, CLIPTokenizer],
                                   tmp_path: Path) -> None:
    """Some public SDXL copies carry merges.txt with Windows line ends."""
    folder = shutil.copytree(folders["sdxl_2"], tmp_path / "crlf")
    merges = folder / "merges.txt"
    merges.write_bytes(merges.read_bytes().replace(b"\n", b"\r\n"))
    np.testing.assert_array_equal(CLIPTokenizer.from_folder(folder)(TEXTS)[0], loaded["sdxl_2"](TEXTS)[0])


def _break(folder: Path, file: str, content: str | None) -> None:
    if content is None:
        (folder / file).unlink()
    else:
        (folder / file).write_text(content, encoding="utf-8")


@pytest.mark.parametrize(("source", "file", "content", "message"), [
    ("tiny_2", "vocab.json", None, "vocab.json: missing"),
    ("tiny_2", "vocab.json", '{"a": 0,', "vocab.json: not a readable JSON"),
    ("tiny_2", "vocab.json", '["a", "b"]', "vocab.json: must hold a JSON object"),
    ("tiny_2", "vocab.json", '{"a": "zero"}', "vocab.json: must map each token"),
    ("tiny_2", "merges.txt", None, "merges.txt: missing"),
    ("tiny_2", "merges.txt", "#version: 0.2\na b c\n", "merges.txt: line 2 is not a pair"),
    ("tiny_2", "merges.txt", "#version: 0.2\nq z\n", "merges.txt: the merges do not fit the vocabulary"),
    ("tiny_2", "tokenizer_config.json", None, "tokenizer_config.json: missing"),
    ("tiny_2", "tokenizer_config.json", '{"pad_token": "!"}', "tokenizer_config.json: model_max_length=None"),
    ("tiny_2", "tokenizer_config.json", '{"model_max_length": 77, "pad_token": "<pad>", "added_tokens_decoder": {}}',
     "tokenizer_config.json: pad_token '<pad>' is not in the vocabulary"),
    ("tiny_5", "tokenizer.json", '{"model": {"type": "BPE", "vocab": {}, "merges": "x"}}',
     "tokenizer.json: model.merges must be a list"),
    ("tiny_5", "tokenizer.json", "not json", "tokenizer.json: not a readable JSON"),
])
def test_broken_folders_name_the_file(folders: dict[str, Path], tmp_path: Path, source: str, file: str,
                                      content: str | None, message: str) -> None:
    folder = shutil.copytree(folders[source], tmp_path / source)
    CLIPTokenizer.from_folder(folder)  # intact, it loads
    _break(folder, file, content)
    with pytest.raises(TokenizerError, match="^" + re.escape(str(folder))) as err:
        CLIPTokenizer.from_folder(folder)
    assert message in str(err.value)


def test_tiny_models_tokenizer_folders_are_the_committed_ones(tmp_path: Path) -> None:
    """diffusion/tiny.py writes the folders whose ids are committed (as transformers saved them)."""
    from diffusion.tiny_parts import clip_tokenizer_files

    for name, pad in TINY_FOLDERS.items():
        clip_tokenizer_files(tmp_path / name, pad)
        for file in (DATA / "tokenizer" / name).iterdir():
            assert (tmp_path / name / file.name).read_bytes() == file.read_bytes(), (name, file.name)
