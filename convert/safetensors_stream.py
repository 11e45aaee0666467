"""Safetensors shards read and written one tensor (one row block) at a time.

Reading parses each shard's JSON header and keeps only where every tensor's
bytes are (`TensorRef`); `read_rows` pulls one row block with a plain file
read. Writing plans every output tensor's dtype and shape first, writes each
shard's header, then fills the data region row block by row block. Nothing
ever holds a whole shard, so peak memory is a few row blocks, whatever the
model size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import mlx.core as mx
import numpy as np

from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.files import check_regular_file

INDEX_FILE = "model.safetensors.index.json"
# Source bytes per row block; bounds the working set of one conversion step.
CHUNK_BYTES = 16 << 20

DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F64": (np.dtype("<f8"), mx.float32),
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "I64": (np.dtype("<i8"), mx.int64),
    "I32": (np.dtype("<i4"), mx.int32),
    "I16": (np.dtype("<i2"), mx.int16),
    "I8": (np.dtype("i1"), mx.int8),
    "U64": (np.dtype("<u8"), mx.uint64),
    "U32": (np.dtype("<u4"), mx.uint32),
    "U16": (np.dtype("<u2"), mx.uint16),
    "U8": (np.dtype("u1"), mx.uint8),
    "BOOL": (np.dtype("?"), mx.bool_),
}
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
MX_CODES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.int64: "I64",
    mx.int32: "I32",
    mx.int16: "I16",
    mx.int8: "I8",
    mx.uint64: "U64",
    mx.uint32: "U32",
    mx.uint16: "U16",
    mx.uint8: "U8",
    mx.bool_: "BOOL",
}
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def num_rows(shape: Sequence[int]) -> int:
    return int(shape[0]) if shape else 1


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_CODES

    def read_rows(self, start: int, stop: int) -> mx.array:
        """Rows [start, stop) along the first axis (the whole tensor for a scalar)."""
        np_dtype, mx_dtype = DTYPES[self.dtype]
        rows = num_rows(self.shape)
        row_bytes = self.nbytes // rows if rows else 0
        with open(self.file, "rb") as f:
            f.seek(self.offset + start * row_bytes)
            buf = f.read((stop - start) * row_bytes)
        if len(buf) != (stop - start) * row_bytes:
            raise GlimmerError(f"{self.file}: truncated while reading {self.name}")
        data = np.frombuffer(buf, dtype=np_dtype).reshape((stop - start, *self.shape[1:]) if self.shape else ())
        if self.dtype == "F64":
            data = data.astype(np.float32)
        out = mx.array(data)
        return out.view(mx.bfloat16) if self.dtype == "BF16" else out


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts; truncation is an error."""
    check_regular_file(path, "weights file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or header_len > size - 8:
                raise ValueError
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        raise GlimmerError(f"{path}: not a safetensors file (bad header)") from None
    except OSError as e:
        raise GlimmerError(f"{path}: cannot read ({e.strerror})") from None
    if size < 8 + header_len + end:
        raise GlimmerError(
            f"{path}: truncated safetensors file ({size} bytes, its header promises {8 + header_len + end})"
        )
    return header, 8 + header_len


def list_tensors(path: Path) -> list[TensorRef]:
    header, data_start = read_header(path)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise GlimmerError(f"{path}: tensor {name} has dtype {info['dtype']}, which the converter does not read")
        ref = TensorRef(path, name, info["dtype"], tuple(info["shape"]), data_start + info["data_offsets"][0])
        if info["data_offsets"][1] - info["data_offsets"][0] != ref.nbytes:
            raise GlimmerError(f"{path}: tensor {name}: data size does not match its shape {list(ref.shape)}")
        out.append(ref)
    return out


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a checkpoint: those named by its index, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    check_regular_file(index, "safetensors index")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise GlimmerError(f"{index}: not a safetensors index (no weight_map)") from None
        files = []
        for name in dict.fromkeys(weight_map.values()):
            f = model_dir / name
            check_regular_file(f, "weights file")
            if not f.is_file():
                raise GlimmerError(f"{f}: shard named in {INDEX_FILE} is missing")
            files.append(f)
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (PyTorch .bin checkpoints are not supported)" if list(model_dir.glob("*.bin")) else ""
        raise GlimmerError(f"{model_dir}: no *.safetensors weights{hint}")
    return files


def checkpoint_tensors(model_dir: Path) -> dict[str, TensorRef]:
    tensors: dict[str, TensorRef] = {}
    for f in checkpoint_files(model_dir):
        for ref in list_tensors(f):
            if ref.name in tensors:
                raise GlimmerError(f"{f}: tensor {ref.name} also appears in {tensors[ref.name].file.name}")
            tensors[ref.name] = ref
    return tensors


class Item(Protocol):
    """One source tensor turned into one or more output tensors of equal row count."""

    rows: int
    source_bytes: int

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of every output tensor, before any data is read."""

    def produce(self, start: int, stop: int) -> list[mx.array]:
        """The outputs' rows [start, stop), in `outputs()` order."""

    def chunk_rows(self) -> int:
        """Rows per block."""


def _as_bytes(a: mx.array) -> memoryview:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.asarray(a))).cast("B")


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def plan_shards(items: Sequence[Item], max_shard_bytes: int) -> list[list[Item]]:
    """Consecutive items grouped so each shard stays under the limit; a larger item gets a shard alone."""
    shards: list[list[Item]] = []
    size = 0
    for item in items:
        n = sum(math.prod(shape) * ITEMSIZE[code] for _, code, shape in item.outputs())
        if not shards or (size + n > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def write_model_shards(
    items: Sequence[Item],
    out_dir: Path,
    max_shard_bytes: int,
    on_progress: Callable[[int, int], None] = lambda nbytes, tensors: None,
) -> list[str]:
    """Write every item's outputs into bounded shards plus the index; returns the file names.

    `on_progress(source bytes, tensors)` is called after each row block.
    """
    shards = plan_shards(items, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for shard, file_name in zip(shards, names):
        total += _write_shard(shard, out_dir / file_name, on_progress)
        for item in shard:
            for name, _, _ in item.outputs():
                weight_map[name] = file_name
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=4))
    return [*names, INDEX_FILE]


def _write_shard(items: Sequence[Item], path: Path, on_progress: Callable[[int, int], None]) -> int:
    header: dict = {"__metadata__": {"format": "mlx"}}
    placed: list[list[tuple[int, int]]] = []  # per item, per output: (data offset, bytes per row)
    offset = 0
    for item in items:
        slots = []
        for name, code, shape in item.outputs():
            nbytes = math.prod(shape) * ITEMSIZE[code]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            slots.append((offset, nbytes // item.rows if item.rows else 0))
            offset += nbytes
        placed.append(slots)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        f.truncate(data_start + offset)
        for item, slots in zip(items, placed):
            expected = item.outputs()
            step = max(1, item.chunk_rows())
            for start in range(0, item.rows, step):
                stop = min(start + step, item.rows)
                arrays = item.produce(start, stop)
                mx.eval(arrays)
                for arr, (pos, row_bytes), (name, code, shape) in zip(arrays, slots, expected):
                    assert MX_CODES[arr.dtype] == code and tuple(arr.shape[1:]) == tuple(shape[1:]), (
                        name,
                        arr.shape,
                        shape,
                    )
                    assert arr.nbytes == row_bytes * (stop - start), (name, arr.shape, shape)
                    f.seek(data_start + pos + start * row_bytes)
                    f.write(_as_bytes(arr))
                del arrays
                on_progress(item.source_bytes * (stop - start) // item.rows, int(stop == item.rows))
    return offset
