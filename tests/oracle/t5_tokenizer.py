"""A T5 tokenizer.json with the real models' normalizer, and the ids transformers gives with it.

Every T5 v1.1 tokenizer (FLUX.1's `tokenizer_2/` among them) was trained by SentencePiece with its
`nmt_nfkc` normalization, which tokenizer.json keeps as a `Precompiled` charsmap followed by a
`Replace` of runs of spaces. The flux part's tiny tokenizer has none, so this part trains a tiny
SentencePiece Unigram model with that rule and writes:

    t5_tokenizer/tokenizer.json.gz       tokenizer.json in the layout of the released files: the
                                         trained pieces and scores, the normalizer Sequence
                                         [Precompiled(the model's charsmap), Replace(" {2,}", " ")],
                                         WhitespaceSplit + Metaspace (gzip: the charsmap is 240 KB)
    t5_tokenizer/tokenizer_config.json   as transformers' T5Tokenizer saves it
    t5_tokenizer/ids.json                per text, the ids transformers' T5Tokenizer.from_pretrained
                                         gives at max_length 24 (padded, truncated)

The texts need the normalizer: ligatures, full-width and circled characters, composed accents,
runs of spaces and tabs.
"""

from __future__ import annotations

import base64
import gzip
import json
import pathlib
import shutil
import tempfile

import sentencepiece
from sentencepiece import sentencepiece_model_pb2
from transformers import T5Tokenizer

from tests.oracle import flux, pipelines

CORPUS = ["a red fox in the snow", "ﬁne ﬂowers at dawn", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "café naïve résumé",
          "a lighthouse on a cliff", "two  spaces\tand tabs", "①②③ ㍻ ½", "the quick brown fox jumps over the lazy dog"]
TEXTS = ["ﬁne ﬂowers", "Ｆｕｌｌ ＡＢＣ １２３", "①② and ½", "cafe\u0301 naïve", "a   red\t\tfox  ", "㍻", ""]
MAX_LENGTH = 24


def write(data: pathlib.Path) -> None:
    root = pathlib.Path(data) / "t5_tokenizer"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        (work / "corpus.txt").write_text("\n".join(CORPUS * 20), encoding="utf-8")
        sentencepiece.SentencePieceTrainer.train(
            input=str(work / "corpus.txt"), model_prefix=str(work / "spiece"), vocab_size=80, model_type="unigram",
            normalization_rule_name="nmt_nfkc", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
            hard_vocab_limit=False, num_threads=1, minloglevel=2)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString((work / "spiece.model").read_bytes())
        flux.t5_tokenizer(work / "saved")  # transformers' own tokenizer.json layout and tokenizer_config.json
        layout = json.loads((work / "saved" / "tokenizer.json").read_text(encoding="utf-8"))
        layout["model"]["vocab"] = [[piece.piece, piece.score] for piece in proto.pieces]
        charsmap = base64.b64encode(proto.normalizer_spec.precompiled_charsmap).decode()
        layout["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": charsmap},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]}
        folder, bare = work / "tokenizer", work / "bare"
        for where, normalizer in ((folder, layout["normalizer"]), (bare, None)):
            where.mkdir()
            (where / "tokenizer.json").write_text(json.dumps({**layout, "normalizer": normalizer}), encoding="utf-8")
            shutil.copy(work / "saved" / "tokenizer_config.json", where)
        ids = [{"text": text, "ids": _ids(folder, text)} for text in TEXTS]
        assert sum(case["ids"] != _ids(bare, case["text"]) for case in ids) >= 4, "the normalizer must matter"
        with gzip.GzipFile(root / "tokenizer.json.gz", "wb", mtime=0) as out:
            out.write((folder / "tokenizer.json").read_bytes())
        shutil.copy(folder / "tokenizer_config.json", root)
    (root / "ids.json").write_text(json.dumps({"versions": pipelines.versions(), "max_length": MAX_LENGTH,
                                               "cases": ids}, indent=1) + "\n", encoding="utf-8")


def _ids(folder: pathlib.Path, text: str) -> list[int]:
    tokenizer = T5Tokenizer.from_pretrained(folder)
    return tokenizer(text, padding="max_length", max_length=MAX_LENGTH, truncation=True).input_ids
