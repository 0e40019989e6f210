"""A GGUF file checked against its own size before anything is read into memory or allocated.

The `gguf` package's GGUFReader trusts the file: a 57-byte file that declares a metadata array of 2^62 items
makes it loop past the end of the file, allocating as it goes. Here the header is parsed by hand, and every
count, length and shape is bounded by the bytes that are actually present before it is used. What comes back
is the metadata (key -> value) and each tensor's name, shape, type and byte range; the loader reads tensor
data from those byte ranges only. Every refusal is a ValueError "not a readable GGUF file: <path>: <field>: ...".
Plain module (validation, not a chapter's teaching); the appendix's loader calls it.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; llama.cpp writes 3
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 256  # tensor names are at most 64 bytes in llama.cpp (GGML_MAX_NAME)
MAX_ARRAY_DEPTH = 2
# value type -> struct format of a scalar (GGUFValueType's numbering: 8 is a string, 9 an array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# types whose tensor data are weights this loader can dequantize with the gguf package
WEIGHT_TYPES = {t for t in GGMLQuantizationType if t.name not in ("I8", "I16", "I32", "I64")}
TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64}


def refuse(path, field: str, why: str) -> ValueError:
    return ValueError(f"not a readable GGUF file: {path}: {field}: {why}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # llama.cpp's order: the fastest-varying dimension (a row's length) first
    tensor_type: GGMLQuantizationType
    start: int  # byte offset in the file
    n_bytes: int

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFLayout:
    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]

    def read_tensor(self, name: str) -> np.ndarray:
        """The tensor's bytes as gguf.dequantize wants them (memory-mapped, nothing copied): typed for float
        tensors, else uint8 rows of whole quantization blocks, in numpy's (slowest-first) order."""
        info = self.tensors[name]
        dtype = TYPED.get(info.tensor_type)
        rows = tuple(reversed(info.shape[1:]))
        if dtype is not None:
            data = np.memmap(self.path, dtype=dtype, mode="r", offset=info.start, shape=(info.numel(),))
            return data.reshape(*rows, info.shape[0])
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.n_bytes,))
        return data.reshape(*rows, info.n_bytes // max(1, math.prod(rows)))


class Cursor:
    """Reads little-endian values from the file's bytes, refusing any read past their end."""

    def __init__(self, data: memoryview, path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, size: int, field: str) -> memoryview:
        if size < 0 or size > len(self.data) - self.pos:
            raise refuse(self.path, field, f"needs {size:,} bytes at offset {self.pos:,}, and the file has "
                                           f"{len(self.data) - self.pos:,} left")
        self.pos += size
        return self.data[self.pos - size:self.pos]

    def scalar(self, fmt: str, field: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def string(self, field: str, limit: int | None = None) -> str:
        size = self.scalar("<Q", field)
        if limit is not None and size > limit:
            raise refuse(self.path, field, f"a string of {size:,} bytes (at most {limit})")
        try:
            return bytes(self.take(size, field)).decode("utf-8")
        except UnicodeDecodeError as error:
            raise refuse(self.path, field, f"not UTF-8 ({error.reason} at byte {error.start})") from None

    def remaining(self) -> int:
        return len(self.data) - self.pos


def read_value(cur: Cursor, value_type: int, field: str, depth: int = 0):
    if value_type in SCALARS:
        return cur.scalar(SCALARS[value_type], field)
    if value_type == STRING:
        return cur.string(field)
    if value_type != ARRAY:
        raise refuse(cur.path, field, f"unknown value type {value_type}")
    if depth >= MAX_ARRAY_DEPTH:
        raise refuse(cur.path, field, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
    item_type, count = cur.scalar("<I", field), cur.scalar("<Q", field)
    smallest = struct.calcsize(SCALARS[item_type]) if item_type in SCALARS else 8 if item_type in (STRING, ARRAY) else 1
    if count * smallest > cur.remaining():  # bounded by the bytes present, before anything is allocated
        raise refuse(cur.path, field, f"an array of {count:,} items needs at least {count * smallest:,} bytes, "
                                      f"and the file has {cur.remaining():,} left")
    if item_type in SCALARS and item_type != 7:  # numbers: one view of the bytes
        return np.frombuffer(cur.take(count * smallest, field), dtype=SCALARS[item_type]).tolist()
    return [read_value(cur, item_type, field, depth + 1) for _ in range(count)]


def read_layout(path) -> GGUFLayout:
    """The file's metadata and tensor table, every size checked against the file's size."""
    path = Path(path)
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as error:
        raise refuse(path, "file", error.strerror) from None
    if not regular:
        raise refuse(path, "file", "not a regular file")
    if os.path.getsize(path) < 24:  # magic, version and the two counts
        raise refuse(path, "header", f"{os.path.getsize(path)} bytes; a GGUF header alone takes 24")
    with open(path, "rb") as file:
        data = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    cur = Cursor(data, path)
    if bytes(cur.take(4, "magic")) != MAGIC:
        raise refuse(path, "magic", "the file does not start with 'GGUF'")
    version = cur.scalar("<I", "version")
    if version not in VERSIONS:
        raise refuse(path, "version", f"{version}; this reader knows versions {VERSIONS}")
    tensor_count, kv_count = cur.scalar("<Q", "tensor_count"), cur.scalar("<Q", "metadata_kv_count")
    for name, count, smallest in (("metadata_kv_count", kv_count, 8 + 4 + 1), ("tensor_count", tensor_count, 8 + 4 + 8 + 4 + 8)):
        if count * smallest > cur.remaining():
            raise refuse(path, name, f"{count:,} entries cannot fit in the {cur.remaining():,} bytes left")
    metadata = {}
    for i in range(kv_count):
        key = cur.string(f"metadata[{i}].key", limit=MAX_NAME_BYTES)
        if key in metadata:
            raise refuse(path, key, "appears twice")
        metadata[key] = read_value(cur, cur.scalar("<I", key), key)
    infos = [read_tensor_info(cur, i) for i in range(tensor_count)]
    alignment = metadata.get("general.alignment", 32)
    if not (isinstance(alignment, int) and 0 < alignment <= 2**16 and alignment & (alignment - 1) == 0):
        raise refuse(path, "general.alignment", f"{alignment!r}: must be a power of 2 up to 65536")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, tensor_type, offset, n_bytes in infos:
        if name in tensors:
            raise refuse(path, name, "two tensors have this name")
        if offset % alignment or data_start + offset + n_bytes > len(data):
            raise refuse(path, name, f"{n_bytes:,} bytes at data offset {offset:,}: past the end of the file "
                                     f"({len(data):,} bytes) or not aligned to {alignment}")
        tensors[name] = TensorInfo(name, shape, tensor_type, data_start + offset, n_bytes)
    return GGUFLayout(path, metadata, tensors)


def read_tensor_info(cur: Cursor, i: int):
    name = cur.string(f"tensors[{i}].name", limit=MAX_NAME_BYTES)
    n_dims = cur.scalar("<I", name)
    if not 1 <= n_dims <= MAX_DIMS:
        raise refuse(cur.path, name, f"{n_dims} dimensions (1 to {MAX_DIMS})")
    shape = tuple(cur.scalar("<Q", name) for _ in range(n_dims))
    raw_type = cur.scalar("<I", name)
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise refuse(cur.path, name, f"unknown tensor type {raw_type}") from None
    if tensor_type not in WEIGHT_TYPES or tensor_type not in GGML_QUANT_SIZES:
        raise refuse(cur.path, name, f"tensor type {tensor_type.name} is not a weight type")
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if min(shape) < 1 or shape[0] % block:
        raise refuse(cur.path, name, f"shape {list(shape)}: every dimension >= 1, the first a multiple of {block}")
    n_bytes = math.prod(shape) // block * block_bytes
    offset = cur.scalar("<Q", name)
    if n_bytes > len(cur.data):  # so huge shapes never reach the offset arithmetic
        raise refuse(cur.path, name, f"shape {list(shape)} needs {n_bytes:,} bytes, more than the whole file")
    return name, shape, tensor_type, offset, n_bytes


# ------------------------------------------------------------------ the model the metadata describes


def positive(layout: GGUFLayout, key: str, kind: type = int, default=None):
    """A hyperparameter that must be a positive integer (kind int) or a positive finite number (kind float)."""
    value = layout.metadata.get(key, default)
    if value is None:
        raise refuse(layout.path, key, "missing")
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not number or not math.isfinite(value) or value <= 0:
        raise refuse(layout.path, key, f"{value!r}: must be a positive {'integer' if kind is int else 'finite number'}")
    return value


def check_tensors(layout: GGUFLayout, shapes: dict, our_name, optional: set[str]) -> None:
    """Every parameter of the model the metadata describes (`shapes`: our name -> shape) has a tensor of that
    shape in the file (llama.cpp's order is reversed); `optional` may be absent (a tied output layer)."""
    found = {}
    for info in layout.tensors.values():
        name = our_name(info.name)
        if name in shapes:
            if tuple(reversed(info.shape)) != tuple(shapes[name]):
                raise refuse(layout.path, info.name, f"shape {list(info.shape)}; the metadata's model needs "
                                                     f"{list(reversed(shapes[name]))}")
            found[name] = info
    missing = sorted(set(shapes) - set(found) - optional)
    if missing:
        raise refuse(layout.path, "tensors", f"{len(missing)} of the model's {len(shapes)} parameters have no "
                                             f"tensor, e.g. {missing[:3]}")


def check_memory(path, model_bytes: int, device) -> None:
    """The model, once dequantized, must fit in the memory available on its device."""
    import psutil
    import torch

    device = torch.device(device)
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if model_bytes > available:
        raise refuse(path, "tensors", f"the model takes {model_bytes / 2**30:,.1f} GiB loaded, and "
                                      f"{available / 2**30:,.1f} GiB are available on {device}")


# what transformers' GGUF tokenizer converter reads (transformers/integrations/ggml.py), per tokenizer model
TOKENIZER_ARRAYS = {"llama": ("tokenizer.ggml.scores",), "gpt2": ("tokenizer.ggml.merges",)}


def check_tokenizer_metadata(layout: GGUFLayout) -> None:
    """The tokenizer's arrays are present, of strings (or numbers), and as long as the vocabulary."""
    meta, path = layout.metadata, layout.path
    tokens, model = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.model")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise refuse(path, "tokenizer.ggml.tokens", "must be a non-empty array of strings")
    if model not in TOKENIZER_ARRAYS:
        raise refuse(path, "tokenizer.ggml.model", f"{model!r}; supported: {sorted(TOKENIZER_ARRAYS)}")
    for key in TOKENIZER_ARRAYS[model]:
        if not isinstance(meta.get(key), list):
            raise refuse(path, key, f"missing: a {model!r} tokenizer needs it")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in meta and (not isinstance(meta[key], list) or len(meta[key]) != len(tokens)):
            raise refuse(path, key, f"must be an array as long as tokenizer.ggml.tokens ({len(tokens)})")
    if "tokenizer.ggml.merges" in meta and not all(isinstance(m, str) for m in meta["tokenizer.ggml.merges"]):
        raise refuse(path, "tokenizer.ggml.merges", "must be an array of strings")
