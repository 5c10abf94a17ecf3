"""A GGUF file's header read with bounds: every count, length and offset is checked against the
file's size before anything is read or allocated for it, so a hostile or truncated file is a clear
`GGUFFileInvalid` (a ModelLoadError naming the file and what is wrong) at once. The `gguf`
package's reader trusts them: an array count past the end of the file makes it loop with growing
memory (items past the end read as nothing). Node loads and the gateway's placement estimate read
headers here (shared/gguf_header.py keeps the record), and the loader reads a file's header here
before transformers' GGUF code (the `gguf` reader) opens it (node_agent/model/loader.py).

It reads what the `gguf` reader would give (tests/unit/shared/test_gguf_hostile.py compares them):
each scalar field's value, the vocabulary's size, and each tensor's place, type and array shape."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from shared.gguf_header import GGUFHeader, TensorInfo
from shared.model_files import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays (the format allows them; no model file nests more than once)
DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}
# the reader's array dtype for each unquantized type (others: rows of blocks as uint8)
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFileInvalid(ModelLoadError):
    """A file that is not a GGUF file Cortex can read, or whose header points outside it."""


class _Cursor:
    """Reads forward through the file's bytes, refusing any read past the end."""

    def __init__(self, data, path: str, order: str = "<"):
        self.data, self.path, self.order, self.at = data, path, order, 0

    def fail(self, what: str) -> GGUFFileInvalid:
        return GGUFFileInvalid(
            f"{self.path} is not a GGUF file Cortex can read: {what} (at byte {self.at} of "
            f"{len(self.data)})"
        )

    def need(self, size: int, what: str) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise self.fail(
                f"{what} needs {size} bytes, the file has {len(self.data) - self.at} left"
            )

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(self.order + fmt)
        self.need(size, what)
        value = struct.unpack_from(self.order + fmt, self.data, self.at)[0]
        self.at += size
        return value

    def string(self, what: str) -> bytes:
        length = self.unpack("Q", f"{what}'s length")
        self.need(length, f"{what} ({length} bytes)")
        value = self.data[self.at : self.at + length]
        self.at += length
        return value

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings, each its length then its bytes, checked and skipped."""
        self.need(8 * count, f"{what}: {count} strings")
        size = len(self.data)
        for _ in range(count):
            length = self.unpack("Q", what)
            if self.at + length > size:
                raise self.fail(f"{what}: a string of {length} bytes")
            self.at += length

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.unpack("I", f"{what}'s type")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has an unknown value type {raw}") from None


def read(path: Path | str) -> GGUFHeader:
    """The header of the GGUF file at `path`; GGUFFileInvalid for anything the bounds refuse."""
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size == 0:
            raise GGUFFileInvalid(f"{path} is not a GGUF file Cortex can read: it is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _header(_Cursor(data, str(path)))


def _header(cursor: _Cursor) -> GGUFHeader:
    cursor.need(4, "the magic number")
    if cursor.data[:4] != MAGIC:
        raise cursor.fail("it does not start with GGUF's magic number")
    cursor.at = 4
    version = cursor.unpack("I", "the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cursor.order, cursor.at = ">", 4
        version = cursor.unpack("I", "the version")
    if version not in VERSIONS:
        raise cursor.fail(f"version {version} (Cortex reads {VERSIONS})")
    tensor_count = cursor.unpack("Q", "the tensor count")
    kv_count = cursor.unpack("Q", "the field count")
    numbers: dict[str, int | float] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    # the least each takes: a field a key length, a type and a byte; a tensor its name's length,
    # its dimension count, one dimension, its type and its offset
    cursor.need(13 * kv_count, f"{kv_count} fields")
    strings: dict[str, bytes] = {}
    counts: dict[str, int] = {}
    for _ in range(kv_count):
        key = _text(cursor, cursor.string("a field's key"))
        if key in numbers or key in strings or key in counts:
            raise cursor.fail(f"the field {key} twice")
        kind = cursor.value_type(key)
        if kind == GGUFValueType.STRING:
            strings[key] = cursor.string(key)
        elif kind == GGUFValueType.ARRAY:
            counts[key] = _skip_array(cursor, key, 1)
        else:
            numbers[key] = cursor.unpack(_SCALARS[kind], key)
    cursor.need(32 * tensor_count, f"{tensor_count} tensors")
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = numbers.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment} is not a power of two")
    start = cursor.at + (-cursor.at % alignment)
    tensors = tuple(_tensor(cursor, start, *info) for info in infos)
    if len({t.name for t in tensors}) != len(tensors):
        raise cursor.fail("two tensors of one name")
    if "general.architecture" not in strings:
        raise cursor.fail("no general.architecture field")
    architecture = _text(cursor, strings["general.architecture"])
    vocab = int(numbers.get(f"{architecture}.vocab_size", 0)) or counts.get(
        "tokenizer.ggml.tokens", 0
    )
    return GGUFHeader(architecture, numbers, vocab, tensors)


def _text(cursor: _Cursor, raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise cursor.fail(f"a name that is not UTF-8 ({raw[:40]!r})") from None


def _skip_array(cursor: _Cursor, key: str, depth: int) -> int:
    """Skip an array's items (each checked against the end); returns its count."""
    if depth > MAX_NESTING:
        raise cursor.fail(f"{key} nests arrays more than {MAX_NESTING} deep")
    kind = cursor.value_type(f"{key}'s items")
    count = cursor.unpack("Q", f"{key}'s count")
    if kind == GGUFValueType.STRING:
        cursor.skip_strings(count, key)
    elif kind == GGUFValueType.ARRAY:
        cursor.need(12 * count, f"{key}: {count} arrays")
        for _ in range(count):
            _skip_array(cursor, key, depth + 1)
    else:
        size = struct.calcsize(_SCALARS[kind]) * count
        cursor.need(size, f"{key}: {count} items")
        cursor.at += size
    return count


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = _text(cursor, cursor.string("a tensor's name"))
    n_dims = cursor.unpack("I", f"{name}'s dimension count")
    if not 0 < n_dims <= MAX_DIMS:
        raise cursor.fail(f"{name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = tuple(cursor.unpack("Q", f"{name}'s dimensions") for _ in range(n_dims))
    raw_type = cursor.unpack("I", f"{name}'s type")
    offset = cursor.unpack("Q", f"{name}'s offset")
    return name, dims, raw_type, offset


def _tensor(
    cursor: _Cursor, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cursor.fail(f"{name} has an unknown tensor type {raw_type}") from None
    elements = int(np.prod(dims, dtype=object))
    if elements * type_size > len(cursor.data) * block_size or elements % block_size:
        raise cursor.fail(f"{name}'s dimensions {dims} do not fit the file as {qtype.name}")
    n_bytes = elements * type_size // block_size
    data_offset = start + offset
    if data_offset + n_bytes > len(cursor.data):
        raise cursor.fail(
            f"{name}'s {n_bytes} bytes at byte {data_offset} lie past the end of the file"
        )
    shape = tuple(reversed(dims))
    plain = _PLAIN.get(qtype)
    if plain is None:
        if dims[0] % block_size:
            raise cursor.fail(f"{name}'s rows of {dims[0]} are not whole {qtype.name} blocks")
        shape = quant_shape_to_byte_shape(shape, qtype)
    return TensorInfo(
        name,
        dims,
        qtype.name,
        elements,
        n_bytes,
        data_offset,
        np.dtype(plain or np.uint8).str,
        tuple(int(d) for d in shape),
    )
