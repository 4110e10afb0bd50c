"""Checkpoint files -> our Flax parameter trees, without torch and without unpickling anything.

A worker loads whatever a diffusers pipeline folder holds, often downloaded from strangers, so
the file formats are read by this module's own small code and checked before they are trusted:

- safetensors (PyTorch layout and names, converted by diffusion/convert.py): an 8-byte little-endian
  header length, a JSON header, then the data. The header is checked whole (bounds on its length
  and its tensors, JSON, dtypes, shapes, data offsets inside the file, no overlaps, sizes that
  match dtype x shape) and the shapes are matched against the model before any tensor data is
  read; the data is then read from an mmap, so a header that lies cannot make us allocate what
  it claims.
- loading to the devices (`sharding`: what load_model does): after the same checks, a pool of
  threads preads each tensor's bytes into an array of its stored dtype and layout, group by group
  (GROUP_BYTES, GROUP_TENSORS); each group goes to the devices, replicated, in one device_put as
  stored (F16, BF16, F32), and each tensor is permuted and cast there by the program of its
  conversion (stored shape and dtype, permutation, target dtype), compiled from the shapes alone
  while the files are read, once a process: a model's repeated blocks, and every model of the
  same architecture, share them. On CPU devices (which are the host) the reading threads permute
  and cast with numpy instead (`convert_on_device`). Either way the parameters equal the host
  path's bit for bit; a tensor with a LoRA delta, or stored as F64 or float8 (F8_E4M3, F8_E5M2:
  upcast exactly, as torch's `.float()`), is made on the host as before.
- sharded safetensors: `*.safetensors.index.json` (`weight_map`: tensor -> shard file) + shards.
- variants (`*.fp16.safetensors`, `*.safetensors.index.bf16.json`, ...), named as diffusers and
  transformers name them.
- Flax msgpack (`diffusion_flax_model.msgpack`, `flax_model.msgpack`): already our names;
  flax.serialization.msgpack_restore decodes plain arrays and never unpickles.
- Pickle files (`.bin`, `.ckpt`, `.pt`, `.pth`) are refused: unpickling runs code from the file.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import json
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
from flax.core import unfreeze
from flax.serialization import msgpack_restore
from flax.traverse_util import flatten_dict, unflatten_dict

from diffusion import convert
from diffusion.choices import check_variant
from diffusion.convert import WeightsError
from diffusion.errors import ModelError, shown

STEMS = ("diffusion_pytorch_model", "model")  # diffusers models, transformers models
FLAX_FILES = ("diffusion_flax_model.msgpack", "flax_model.msgpack")
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")
# Real headers are ~200 KB (SDXL's UNet) to a few MB (a shard of a 30B-parameter model lists a
# few thousand tensors); parsing one costs far more than its bytes (a 96 MB header of 1.7 M
# tensors took 34 s and 1.75 GB), so a file past these caps is refused before it is parsed
# (the bytes) or checked tensor by tensor (the count), with room to spare for real checkpoints.
MAX_HEADER = 16 * 2**20
MAX_TENSORS = 100_000  # in one file
MAX_INDEX = 16 * 2**20  # a shard index lists names only
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_SHARD_RE = re.compile(r".*-\d+-of-\d+")


class _Dtype(NamedTuple):
    itemsize: int
    numpy: np.dtype | None  # None: valid in a header, but not a weight we load


# Every dtype of the safetensors format with a whole number of bytes per element. The float8 ones
# (torch's float8_e4m3fn and float8_e5m2, as float8 checkpoints store their weights) are upcast
# exactly at load, by ml_dtypes, like any other dtype to the load's.
ST_DTYPES = {
    "F64": _Dtype(8, np.dtype("<f8")), "F32": _Dtype(4, np.dtype("<f4")),
    "F16": _Dtype(2, np.dtype("<f2")), "BF16": _Dtype(2, np.dtype(ml_dtypes.bfloat16)),
    "F8_E4M3": _Dtype(1, np.dtype(ml_dtypes.float8_e4m3fn)), "F8_E5M2": _Dtype(1, np.dtype(ml_dtypes.float8_e5m2)),
    **{name: _Dtype(size, None) for name, size in (
        ("I64", 8), ("U64", 8), ("I32", 4), ("U32", 4), ("I16", 2), ("U16", 2), ("I8", 1), ("U8", 1), ("BOOL", 1),
    )},
}
_FLOATS = frozenset(d.numpy for d in ST_DTYPES.values() if d.numpy is not None)
FLOAT_DTYPES = ", ".join(name for name, d in ST_DTYPES.items() if d.numpy is not None)  # for errors
# Loading to the devices: these dtypes are moved as stored and cast there (F64 is cast on the
# host: a device without 64-bit floats would round twice; so is float8, by ml_dtypes: not every
# accelerator takes float8 arrays); a group's size (one device_put and one compiled conversion
# each); the threads that read files and those that compile the conversions.
DEVICE_DTYPES = frozenset({"F32", "F16", "BF16"})
GROUP_BYTES = 256 * 2**20
GROUP_TENSORS = 128
READ_THREADS = min(16, os.cpu_count() or 1)
COMPILE_THREADS = min(8, os.cpu_count() or 1)


Delta = Callable[[], np.ndarray]  # what is added to a weight at load (a LoRA's), made when it is read


class TensorInfo(NamedTuple):
    """One tensor of a checked safetensors header: where its bytes are in which file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]  # as the model sees it
    start: int  # absolute byte offset in the file
    nbytes: int
    transposed: bool = False  # the bytes hold the 2-D transpose of `shape` (diffusion/single_file.py)
    rolled: int = 0  # the tensor's row i is the bytes' row (i + rolled) % rows (diffusion/single_file.py)


def load_weights(folder: Path, component: str, kind: str, expected: Any, dtype: Any,
                 variant: str | None = None, sharding: jax.sharding.Sharding | None = None) -> Any:
    """The parameters of `folder/component` in our Flax names, as numpy arrays of `dtype`.

    `kind` is one of diffusion/convert.py's KINDS; `expected` the module's parameter tree
    (leaves with `.shape`, e.g. from jax.eval_shape; bare or under "params", and the result is
    shaped alike); `dtype` float32 or bfloat16. The first of these present is loaded:
    `{diffusion_pytorch_model,model}[.VARIANT].safetensors`, then the sharded
    `{diffusion_pytorch_model,model}.safetensors.index[.VARIANT].json`, then (only without a
    variant) `diffusion_flax_model.msgpack` / `flax_model.msgpack`. A missing variant is an error
    listing the variants present; pickle files are never loaded. Raises WeightsError.
    With `sharding` (fully replicated), jax arrays placed with it instead of numpy arrays.
    """
    _check_kind(Path(folder) / component, kind)
    source = choose_weights(Path(folder) / component, variant)
    if source.suffix == ".msgpack":
        wanted, wrapped = _flat_expected(expected)
        params = unflatten_dict(_read_msgpack(source, wanted, _target_dtype(dtype)))
        if sharding is not None:
            params = jax.device_put(params, _checked_sharding(sharding))
        return {"params": params} if wrapped else params
    return load_tensors(source.parent, kind, safetensors_tensors(source), expected, dtype, sharding=sharding)


def safetensors_tensors(source: Path) -> dict[str, TensorInfo]:
    """The checked tensors of a safetensors file or of a shard index and its shards."""
    return read_index(source) if source.name.endswith(".json") else read_header(source)


def load_tensors(where: Path, kind: str, tensors: Mapping[str, TensorInfo], expected: Any, dtype: Any,
                 deltas: Mapping[str, Delta] | None = None, sharding: jax.sharding.Sharding | None = None) -> Any:
    """`load_weights` for tensors already found (a folder's files, or a single-file checkpoint's
    share of its tensors): PyTorch names, converted and checked against `expected`. `deltas`
    (PyTorch name -> a function giving an array of the tensor's PyTorch shape: merged LoRAs,
    computed as each weight is read) are added in float32 before the cast to `dtype`. Without
    `sharding`, numpy arrays made on the host; with it (fully replicated), jax arrays placed with
    it, moved as stored and converted on the devices (the same values, bit for bit)."""
    _check_kind(where, kind)
    wanted, wrapped = _flat_expected(expected)
    target = _target_dtype(dtype)
    if sharding is None:
        flat = _read_safetensors(where, kind, tensors, wanted, target, deltas or {})
    else:
        flat = _place_safetensors(where, kind, tensors, wanted, target, deltas or {}, _checked_sharding(sharding))
    params = unflatten_dict(flat)
    return {"params": params} if wrapped else params


def _check_kind(where: Path, kind: str) -> None:
    if kind not in convert.KINDS:
        raise WeightsError(where, f"weights kind {kind!r} is not one of {', '.join(convert.KINDS)}")


# ------------------------------------------------------------------------------------ choosing a file

def _add_variant(name: str, variant: str | None) -> str:
    """diffusers' and transformers' `_add_variant`: the variant goes before the last suffix."""
    if variant is None:
        return name
    head, _, last = name.rpartition(".")
    return f"{head}.{variant}.{last}"


def _variants(names: set[str]) -> list[str]:
    """The variants the folder has safetensors weights of; "default" for those without one."""
    found = set()
    for name in names:
        for stem in STEMS:
            if name in (f"{stem}.safetensors", f"{stem}.safetensors.index.json"):
                found.add("default")
            for pattern in (rf"{stem}\.([^.]+)\.safetensors", rf"{stem}\.safetensors\.index\.([^.]+)\.json"):
                match = re.fullmatch(pattern, name)
                if match and not _SHARD_RE.fullmatch(match[1]):
                    found.add(match[1])
    return sorted(found)


def choose_weights(where: Path, variant: str | None) -> Path:
    """The file to load from the component folder (see load_weights for the order)."""
    if variant is not None:
        check_variant(variant)  # the job contract's one rule: it names files
    if not where.is_dir():
        raise WeightsError(where, "is not a folder (the pipeline has no such component)")
    names = {p.name for p in where.iterdir() if p.is_file()}
    candidates = [_add_variant(f"{stem}{suffix}", variant)
                  for suffix in (".safetensors", ".safetensors.index.json") for stem in STEMS]
    if variant is None:
        candidates += FLAX_FILES
    for name in candidates:
        if name in names:
            return where / name
    pickles = sorted(name for name in names if name.endswith(PICKLE_SUFFIXES))
    present = set(_variants(names)) | ({"default"} if names & set(FLAX_FILES) else set())
    problems = []
    if present:
        wanted = f"of variant {variant!r}" if variant else "without a variant"
        problems.append(f"has no weights {wanted} (none of {', '.join(candidates)}); "
                        f"variants present: {', '.join(sorted(present))}")
    if pickles:
        problems.append(
            f"{pickles[0]} is a pickle file, which is never loaded: unpickling runs code from the file. "
            "Convert it to safetensors on a trusted machine with torch and diffusers/transformers: "
            "`<ModelClass>.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)`"
            + (f" ({len(pickles) - 1} more pickle files: {', '.join(pickles[1:4])})" if len(pickles) > 1 else ""))
    if not problems:
        problems.append(f"holds no weights (looked for {', '.join(candidates)})")
    raise WeightsError(where, "; ".join(problems))


# ---------------------------------------------------------------------------------------- safetensors

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _json(raw: bytes) -> Any:
    """JSON without duplicate keys. Nesting too deep for the parser is a ValueError like any
    other bad JSON: json.loads raises RecursionError, which its callers here would not catch."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("nested deeper than Python's JSON parser goes") from None


def _is_count(value: Any) -> bool:
    """A JSON non-negative integer (not a bool, not 2.0)."""
    return type(value) is int and value >= 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The checked header of one safetensors file: tensor name -> TensorInfo. Reads only the
    header; refuses (WeightsError naming the file and the tensor) anything the format forbids."""
    def bad(rule: str) -> WeightsError:
        return WeightsError(path.parent, f"{path.name}: {rule}")

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise bad(f"is {size} bytes, too short for a safetensors header")
        length = int.from_bytes(f.read(8), "little")
        if length > MAX_HEADER:
            raise bad(f"declares a {length}-byte header, over the {MAX_HEADER}-byte limit")
        if length > size - 8:
            raise bad(f"declares a {length}-byte header in a {size}-byte file")
        raw = f.read(length)
    try:
        header = _json(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise bad(f"header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise bad("header's __metadata__ is not a JSON object")
    if len(header) > MAX_TENSORS:
        raise bad(f"header lists {len(header)} tensors, over the {MAX_TENSORS}-tensor limit")
    data_start, data_size = 8 + length, size - 8 - length
    tensors = {}
    for name, entry in header.items():
        where = f"tensor {shown(name)}"  # shown(): a hostile header's megabyte name stays short
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise bad(f"{where} is not an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:
            raise bad(f"{where} has unknown dtype {shown(dtype)} (known: {', '.join(ST_DTYPES)})")
        if not isinstance(shape, list) or not all(map(_is_count, shape)):
            raise bad(f"{where} has shape {shown(shape)}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise bad(f"{where} has data_offsets {shown(offsets)}, not [begin, end] in bytes")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise bad(f"{where} has data_offsets {offsets} outside the file's {data_size} bytes of data")
        need = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if end - begin != need:
            raise bad(f"{where} has {end - begin} bytes of data, but {dtype} x {shown(shape)} needs {need}")
        tensors[name] = TensorInfo(path, dtype, tuple(shape), data_start + begin, end - begin)
    spans = sorted((t.start, t.start + t.nbytes, name) for name, t in tensors.items() if t.nbytes)
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise bad(f"tensor {shown(second)} overlaps tensor {shown(first)} in the data")
    return tensors


def read_index(index: Path) -> dict[str, TensorInfo]:
    """The tensors of a sharded checkpoint: its index (`weight_map`) and every shard's checked
    header, which must agree (each tensor in exactly the shard the index names)."""
    def bad(rule: str) -> WeightsError:
        return WeightsError(index.parent, f"{index.name}: {rule}")

    if index.stat().st_size > MAX_INDEX:
        raise bad(f"is over the {MAX_INDEX}-byte limit for a shard index")
    try:
        weight_map = _json(index.read_bytes()).get("weight_map")
    except (UnicodeDecodeError, ValueError, AttributeError) as err:
        raise bad(f"is not a JSON object with a weight_map ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise bad("weight_map is not an object of tensor name -> shard file name")
    headers = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in (".", ".."):
            raise bad(f"shard {shown(shard)} is not a plain file name in the folder")
        if not (index.parent / shard).is_file():
            raise bad(f"shard {shown(shard)} is missing")
        headers[shard] = read_header(index.parent / shard)
    for shard, header in headers.items():
        for name in header:
            if weight_map.get(name) != shard:
                raise bad(f"tensor {shown(name)} of {shard} is not mapped to it in the weight_map")
    tensors = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise bad(f"tensor {shown(name)} is mapped to {shard}, which does not hold it")
        tensors[name] = headers[shard][name]
    return tensors


def _plan(where: Path, kind: str, tensors: Mapping[str, TensorInfo],
          wanted: Mapping[tuple[str, ...], tuple[int, ...]]) -> dict[str, convert.Target]:
    """Convert names and check shapes against the model, and dtypes: before any data is read."""
    plan = convert.plan(kind, {name: t.shape for name, t in tensors.items()}, wanted, str(where))
    for name in plan:
        info = tensors[name]
        if ST_DTYPES[info.dtype].numpy is None:
            raise WeightsError(where, f"{info.file.name}: tensor {shown(name)} has dtype {info.dtype}; "
                                      f"weights must be one of {FLOAT_DTYPES}")
    return plan


def _read_safetensors(where: Path, kind: str, tensors: Mapping[str, TensorInfo],
                      wanted: Mapping[tuple[str, ...], tuple[int, ...]], target: np.dtype,
                      deltas: Mapping[str, Delta]) -> dict:
    """The host path: check (`_plan`), then read each tensor from an mmap, permute and cast it
    with numpy (adding its delta, if any, in float32)."""
    plan = _plan(where, kind, tensors, wanted)
    flat = {}
    for file in sorted({tensors[name].file for name in plan}):
        with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for name, move in plan.items():
                if tensors[name].file != file:
                    continue
                flat[move.path] = _made(_view(data, tensors[name]), move.axes, target, deltas.get(name))
    return flat


def read_tensor(data: mmap.mmap, info: TensorInfo, axes: tuple[int, ...] | None, target: np.dtype) -> np.ndarray:
    """A copy of one tensor, permuted and cast (no view outlives the mmap)."""
    return _made(_view(data, info), axes, target)


def _view(data: mmap.mmap, info: TensorInfo) -> np.ndarray:
    """One tensor of an mmap in the model's shape, not copied (but a rolled one)."""
    view = np.frombuffer(data, ST_DTYPES[info.dtype].numpy, math.prod(info.shape), info.start)
    return _as_model(view.reshape(_stored_shape(info)), info)


def _stored_shape(info: TensorInfo) -> tuple[int, ...]:
    return info.shape[::-1] if info.transposed else info.shape


def _as_model(stored: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A tensor's stored array in the model's shape: transposed back, its rows rolled back (a copy)."""
    array = stored.T if info.transposed else stored
    return np.roll(array, -info.rolled, axis=0) if info.rolled else array


def _made(view: np.ndarray, axes: tuple[int, ...] | None, target: np.dtype, delta: Delta | None = None) -> np.ndarray:
    """A parameter from a tensor in the model's shape: its delta (if any) added in float32, then
    permuted and cast, as a new array. Both paths make host-side parameters here."""
    if delta is not None:
        view = np.array(view, np.float32, order="C") + delta()
    return np.array(view.transpose(axes) if axes else view, dtype=target, order="C")


# ------------------------------------------------------------------------------------ to the devices

class _Conversion(NamedTuple):
    """How one stored array becomes its parameter on the devices, all static: the key of its
    compiled program."""

    shape: tuple[int, ...]  # as stored (`_stored_shape`)
    dtype: str  # as stored (a DEVICE_DTYPES name)
    transposed: bool  # the stored array is the 2-D transpose of the tensor (TensorInfo.transposed)
    rolled: int  # then its rows are rolled back by this many (TensorInfo.rolled)
    axes: tuple[int, ...] | None  # then numpy.transpose axes (convert.Target.axes)
    target: str  # then cast to this dtype

    @property
    def needed(self) -> bool:
        """Whether the stored array is not already the parameter."""
        return self.transposed or bool(self.rolled) or bool(self.axes) or ST_DTYPES[self.dtype].numpy != self.target


def _checked_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if not isinstance(sharding, jax.sharding.Sharding) or not sharding.is_fully_replicated:
        raise ValueError(f"weights are placed replicated: {sharding!r} is not a fully replicated jax Sharding")
    return sharding


def convert_on_device(sharding: jax.sharding.Sharding) -> bool:
    """Whether the device path permutes and casts on the devices (accelerators) or with numpy in
    its reading threads (CPU devices, which are the host: there numpy is faster than XLA's CPU
    code, and compiles nothing). RENDERFARM_CONVERT=device or host overrides, for benchmarks."""
    choice = os.environ.get("RENDERFARM_CONVERT", "auto")
    if choice not in ("auto", "device", "host"):
        raise ValueError(f"RENDERFARM_CONVERT={choice!r}: must be auto, device or host")
    return choice == "device" or (choice == "auto" and any(d.platform != "cpu" for d in sharding.device_set))


def _place_safetensors(where: Path, kind: str, tensors: Mapping[str, TensorInfo],
                       wanted: Mapping[tuple[str, ...], tuple[int, ...]], target: np.dtype,
                       deltas: Mapping[str, Delta], sharding: jax.sharding.Sharding) -> dict:
    """The device path: check (`_plan`), then read the tensors in file order, in groups, on a pool
    of threads (preads of the raw bytes into arrays of the stored dtype and layout), the next
    group read while this one goes to the devices in one device_put, each tensor then permuted and
    cast there by its conversion's program (`_program`: compiled on other threads meanwhile, from
    the shapes alone, once a process). A tensor with a delta, or not in DEVICE_DTYPES, is made on
    the host exactly as `_read_safetensors` makes it (`_made`), and so is every tensor when not
    `convert_on_device`."""
    plan = _plan(where, kind, tensors, wanted)
    on_device = convert_on_device(sharding)
    names = sorted(plan, key=lambda name: (tensors[name].file, tensors[name].start))
    conversions = {name: _conversion(tensors[name], plan[name].axes, target) for name in names
                   if on_device and name not in deltas and tensors[name].dtype in DEVICE_DTYPES}  # the rest: on the host
    groups = list(_groups(names, tensors))
    flat: dict[tuple[str, ...], Any] = {target_.path: None for target_ in plan.values()}  # in plan order
    files: dict[Path, int] = {}
    try:
        for file in sorted({tensors[name].file for name in plan}):
            files[file] = os.open(file, os.O_RDONLY)

        def fetch(name: str) -> np.ndarray:
            raw = _read_raw(where, files[tensors[name].file], name, tensors[name])
            if name in conversions:
                return raw
            return _made(_as_model(raw, tensors[name]), plan[name].axes, target, deltas.get(name))

        with concurrent.futures.ThreadPoolExecutor(READ_THREADS, "weights-read") as reader, \
                concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "weights-compile") as compiler:
            # in order of first use, so that the first group's programs come first
            programs = {conversion: compiler.submit(_program, conversion, sharding)
                        for conversion in dict.fromkeys(c for c in conversions.values() if c.needed)}
            reading = [reader.submit(fetch, name) for name in groups[0]] if groups else []
            try:
                for i, group in enumerate(groups):
                    arrays = [future.result() for future in reading]
                    reading = [reader.submit(fetch, name) for name in groups[i + 1]] if i + 1 < len(groups) else []
                    placed = jax.device_put(arrays, sharding)
                    del arrays
                    for name, array in zip(group, placed, strict=True):
                        conversion = conversions.get(name)
                        if conversion in programs:
                            array = programs[conversion].result()(array)
                        flat[plan[name].path] = array
                    del placed
            except BaseException:
                for future in [*reading, *programs.values()]:
                    future.cancel()
                raise
    finally:
        for fd in files.values():
            os.close(fd)
    return flat


def _groups(names: Sequence[str], tensors: Mapping[str, TensorInfo]) -> Iterator[list[str]]:
    """Consecutive runs of at most GROUP_TENSORS tensors and about GROUP_BYTES (a larger tensor alone)."""
    group: list[str] = []
    size = 0
    for name in names:
        if group and (size + tensors[name].nbytes > GROUP_BYTES or len(group) == GROUP_TENSORS):
            yield group
            group, size = [], 0
        group.append(name)
        size += tensors[name].nbytes
    if group:
        yield group


def _read_raw(where: Path, fd: int, name: str, info: TensorInfo) -> np.ndarray:
    """One tensor's bytes as stored (dtype, and the stored layout's shape), read with pread into a
    new array; its header was checked, and its shape matched to the model's, before."""
    array = np.empty(_stored_shape(info), ST_DTYPES[info.dtype].numpy)
    buffer = memoryview(array.reshape(-1).view(np.uint8))
    done = 0
    while done < info.nbytes:
        count = os.preadv(fd, [buffer[done:]], info.start + done)
        if count <= 0:
            raise WeightsError(where, f"{info.file.name}: ends inside tensor {shown(name)} "
                                      "(the file changed while it was read?)")
        done += count
    return array


def _conversion(info: TensorInfo, axes: tuple[int, ...] | None, target: np.dtype) -> _Conversion:
    return _Conversion(_stored_shape(info), info.dtype, info.transposed, info.rolled, axes, np.dtype(target).name)


@functools.lru_cache(maxsize=1024)
def _program(conversion: _Conversion, sharding: jax.sharding.Sharding) -> Any:
    """The compiled conversion of a stored array placed with `sharding`: one per distinct
    conversion in a process, which every tensor and every load that needs it shares."""
    spec = jax.ShapeDtypeStruct(conversion.shape, ST_DTYPES[conversion.dtype].numpy, sharding=sharding)
    return _converted.lower(spec, conversion).compile()


@functools.partial(jax.jit, static_argnums=1)
def _converted(array: jax.Array, conversion: _Conversion) -> jax.Array:
    if conversion.transposed:
        array = array.T
    if conversion.rolled:
        array = jnp.roll(array, -conversion.rolled, axis=0)
    if conversion.axes:
        array = jnp.transpose(array, conversion.axes)
    return array.astype(conversion.target)


# --------------------------------------------------------------------------------------------- msgpack

def _read_msgpack(path: Path, wanted: Mapping[tuple[str, ...], tuple[int, ...]], target: np.dtype) -> dict:
    """A Flax msgpack checkpoint: already our names; checked against the model, then cast."""
    try:
        tree = msgpack_restore(path.read_bytes())
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as err:
        raise WeightsError(path.parent, f"{path.name}: not a Flax msgpack checkpoint ({err})") from None
    flat = flatten_dict(tree) if isinstance(tree, dict) else {(): tree}
    for name, leaf in flat.items():
        if not isinstance(leaf, np.ndarray) or leaf.dtype not in _FLOATS:
            raise WeightsError(path.parent, f"{path.name}: {'/'.join(map(str, name))} is a "
                                            f"{type(leaf).__name__}, not a float array")
    convert.fit({"/".join(name): (name, leaf.shape) for name, leaf in flat.items()}, wanted, str(path.parent))
    return {name: leaf.astype(target) for name, leaf in flat.items()}


# ------------------------------------------------------------------------------------------- arguments

def _target_dtype(dtype: Any) -> np.dtype:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in NUMPY_DTYPES:
        raise ModelError("dtype", name, f"must be one of {', '.join(NUMPY_DTYPES)}")
    return NUMPY_DTYPES[name]


def _flat_expected(expected: Any) -> tuple[dict[tuple[str, ...], tuple[int, ...]], bool]:
    """The expected tree as flat path -> shape, and whether it sat under "params"."""
    tree = unfreeze(expected)
    wrapped = isinstance(tree, dict) and list(tree) == ["params"]
    flat = flatten_dict(tree["params"] if wrapped else tree)
    return {path: tuple(leaf.shape) for path, leaf in flat.items()}, wrapped
