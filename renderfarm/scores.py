"""Image scores as the farm's contract states them: the names a job may ask for (SCORES, the
model layer's: diffusion/choices.py), what each puts in its sidecar, the small expression
language that filters on them (`renderfarm export --where`, a campaign's `gate`). Importable
without JAX: the producer checks a job's scores and a filter before anything is enqueued; the
worker computes the scores (diffusion/scores.py).

A sidecar's `scores` holds what was asked for:
  safety     nsfw (bool) and safety_concepts: {concept index: score} for the concepts that
             flagged (diffusers' StableDiffusionSafetyChecker)
  clip       clip: 100 x the cosine of CLIP ViT-L/14's image and prompt embeddings, floored at 0
  aesthetic  aesthetic: LAION's improved aesthetic predictor (about 1..10)
  phash      phash: the 64-bit perceptual hash, 16 hex digits (imagehash.phash's string)
and `scores_missing`: {score: why} for a score that could not be computed (the image is kept).

An expression compares the values `nsfw`, `clip` and `aesthetic` with numbers (`-1` too), joined by
`and`, `or`, `not` and parentheses: `clip >= 28 and aesthetic >= 5.5 and not nsfw`. It is
parsed by Python's own parser and evaluated by the walker here, which knows no other node:
no call, attribute, subscript or name beyond those three can run.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from diffusion.choices import SCORES
from renderfarm.errors import JobError

# What the scores put in a sidecar's `scores`, each an export column of this Arrow type.
COLUMNS = {"nsfw": "bool", "safety_concepts": "string", "clip": "float64", "aesthetic": "float64",
           "phash": "string"}
# The values an expression may name, and the score that gives each.
VALUES = {"nsfw": "safety", "clip": "clip", "aesthetic": "aesthetic"}
MAX_EXPRESSION = 1000  # characters
NEAR_BLOCK = 2048  # rows of a bucket compared at once (a bucket of one repeated slice can be huge)
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne}
_WORDS = {"true": True, "false": False}  # as JSON and YAML write them; Python's True and False parse as they are
_RULE = ("must compare nsfw, clip and aesthetic with numbers (< <= > >= == !=; a number may be negative, "
         "-0.5), joined by and, or, not and parentheses, e.g. 'clip >= 28 and aesthetic >= 5.5 and not nsfw'")


class Expression:
    """A parsed filter. `needs`: the scores it reads; calling it on a sidecar's `scores`
    gives whether the image passes, or None when a value it reads is missing."""

    def __init__(self, text: str, field: str = "where") -> None:
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_EXPRESSION:
            raise JobError(field, text, f"{_RULE}; at most {MAX_EXPRESSION} characters")
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as err:
            raise JobError(field, text, f"does not parse at column {err.offset}: {_RULE}") from None
        self.text, self._tree = text.strip(), tree
        self.names: set[str] = set()
        self._check(tree, field)
        self.needs = tuple(score for score in SCORES if score in {VALUES[n] for n in self.names})

    def _check(self, node: ast.AST, field: str) -> None:
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value, field)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._check(node.operand, field)
        elif isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            for part in (node.left, *node.comparators):
                if not isinstance(part, (ast.Name, ast.Constant)) and not _is_minus(part):
                    raise JobError(field, self.text, f"compares {ast.unparse(part)!r}: {_RULE}")
                self._check(part, field)
        elif _is_minus(node):
            if not (isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
                raise JobError(field, self.text, f"negates {ast.unparse(node.operand)!r}: only a number "
                                                 f"may be negated, as in 'clip > -1': {_RULE}")
        elif isinstance(node, ast.Name) and node.id in _WORDS:
            pass
        elif isinstance(node, ast.Name):
            if node.id not in VALUES:
                raise JobError(field, self.text, f"names {node.id!r}, not a score value "
                                                 f"({', '.join(VALUES)}): {_RULE}")
            self.names.add(node.id)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
            pass
        else:
            raise JobError(field, self.text, f"holds {ast.unparse(node)!r}: {_RULE}")

    def __call__(self, scores: Mapping[str, Any] | None) -> bool | None:
        values = scores or {}
        if any(values.get(name) is None for name in self.names):
            return None
        return bool(_evaluate(self._tree, values))


def _is_minus(node: ast.AST) -> bool:
    """A unary minus: Python parses `-1` as minus applied to 1 (_check lets it apply to a number only)."""
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)


def _evaluate(node: ast.AST, values: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        results = (_evaluate(v, values) for v in node.values)
        return all(results) if isinstance(node.op, ast.And) else any(results)
    if _is_minus(node):
        return -node.operand.value  # a negative number: _check let no other operand through
    if isinstance(node, ast.UnaryOp):
        return not _evaluate(node.operand, values)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Name):
        return _WORDS[node.id] if node.id in _WORDS else values[node.id]
    return node.value  # a Constant: _check let nothing else through


def hamming(a: str, b: str) -> int:
    """Bits that differ between two perceptual hashes (hex strings)."""
    return (int(a, 16) ^ int(b, 16)).bit_count()


def near_duplicates(hashes: Sequence[str | None], distance: int) -> list[bool]:
    """For each hash in order, whether it is within `distance` bits of a hash kept before it
    (so dropped): the first of each group of near-duplicates is kept, and a missing hash
    (None) always is. Multi-index hashing: two 64-bit hashes within `distance` bits agree
    exactly on at least one of `distance + 1` disjoint slices of their bits, so only hashes
    that share a slice are compared (in numpy, a block of a slice's bucket at a time), as
    faiss's binary multi-hash index does; the near pairs found are then read in job order."""
    if isinstance(distance, bool) or not isinstance(distance, int) or not 0 <= distance <= 32:
        raise JobError("dedup", distance, "must be a whole Hamming distance from 0 to 32 bits")
    present = [i for i, h in enumerate(hashes) if h is not None]
    values = np.array([int(hashes[i], 16) for i in present], dtype=np.uint64)
    unique, first = np.unique(values, return_index=True)  # an exact repeat is dropped below
    order = np.argsort(first)
    unique, first = unique[order], first[order]  # by first occurrence, as job order is
    earlier: dict[int, list[int]] = {}  # unique index -> the earlier unique ones near it
    for shift, mask in _slices(distance + 1):
        keys = (unique >> np.uint64(shift)) & np.uint64(mask)
        by_key = np.argsort(keys, kind="stable")
        for bucket in np.split(by_key, np.flatnonzero(np.diff(keys[by_key])) + 1):
            for start in range(0, len(bucket), NEAR_BLOCK):
                rows = bucket[start:start + NEAR_BLOCK]
                near = np.bitwise_count(unique[rows, None] ^ unique[None, bucket]) <= distance
                for r, c in zip(*np.nonzero(near & (rows[:, None] > bucket[None, :]))):
                    earlier.setdefault(int(rows[r]), []).append(int(bucket[c]))
    kept = np.ones(len(unique), bool)
    for j in sorted(earlier):
        kept[j] = not any(kept[i] for i in earlier[j])
    dropped = [False] * len(hashes)
    seen: set[int] = set()
    kept_value = dict(zip(unique.tolist(), kept.tolist()))
    for i, value in zip(present, values.tolist()):
        dropped[i] = value in seen or not kept_value[value]
        seen.add(value)
    return dropped


def _slices(count: int) -> list[tuple[int, int]]:
    """(shift, mask) of `count` disjoint slices covering 64 bits, as even as can be."""
    sizes = [64 // count + (i < 64 % count) for i in range(count)]
    return [(sum(sizes[:i]), (1 << size) - 1) for i, size in enumerate(sizes)]
