"""The tensor index of a GGUF file: each tensor's name, block type, shape and bytes (a read-only map of the
file), and its architecture, read without parsing the rest of its metadata.

`gguf.GGUFReader` turns every metadata value into numpy views, the tokenizer's many parts included, for
values the lowering never reads (its cost per process: docs/experiments.md, "A warm start in seconds");
here a value is skipped by its length, and only `general.architecture` and `general.alignment` are
decoded. Format (GGUF v2 and v3, little-endian): magic "GGUF", uint32 version, uint64 tensor and
key-value counts; key-value pairs (string key, uint32 type, value: a string is a uint64 length and its
bytes, an array a uint32 item type, a uint64 count and its items); per tensor its name, uint32
dimension count, uint64 dimensions (innermost first), uint32 block type and uint64 offset into the
data section, which starts at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ...common.errors import InvalidParameterError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # value types with a length of their own
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor of the file: `data` [rows, bytes a row] uint8, a read-only view of the mapped file."""

    name: str
    block_type: str  # the block type's name in gguf's GGMLQuantizationType: "Q4_0", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # innermost first, as GGUF lists it
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    tensors: dict[str, IndexedTensor]


def read_index(path: str) -> GGUFIndex:
    """The index of the GGUF file at `path`; a clear error for a file that is not one."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse(path, mapped)
    except (ValueError, KeyError) as error:  # a truncated header, an unknown value or block type
        raise InvalidParameterError(f"{path} is not a GGUF file specpass can read: {error}") from None


def _parse(path: str, mapped: np.memmap) -> GGUFIndex:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = _Cursor(memoryview(mapped))
    if header.take(4) != MAGIC:
        raise InvalidParameterError(f"{path} is not a GGUF file (no GGUF magic)")
    version = header.unpack("<I")
    if version not in (2, 3):
        raise InvalidParameterError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, value_count = header.unpack("<Q"), header.unpack("<Q")
    architecture, alignment = None, DEFAULT_ALIGNMENT
    for _ in range(value_count):
        key = header.string()
        kind = header.unpack("<I")
        if key == "general.architecture" and kind == STRING:
            architecture = header.string()
        elif key == "general.alignment" and kind == 4:
            alignment = header.unpack("<I")
        else:
            header.skip_value(kind)
    infos = []
    for _ in range(tensor_count):
        name = header.string()
        shape = tuple(header.unpack("<Q") for _ in range(header.unpack("<I")))
        infos.append((name, header.unpack("<I"), shape, header.unpack("<Q")))
    if architecture is None:
        raise InvalidParameterError(f"{path}: the GGUF file names no general.architecture")
    start = -(-header.offset // alignment) * alignment
    tensors = {}
    for name, type_id, shape, offset in infos:
        block_type = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[block_type]
        row_bytes = shape[0] // block * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = IndexedTensor(name, block_type.name, shape, data)
    return GGUFIndex(architecture, tensors)


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buffer: memoryview):
        self.buffer = buffer
        self.offset = 0

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.buffer):
            raise ValueError("the file ends inside its header")
        value = bytes(self.buffer[self.offset : self.offset + size])
        self.offset += size
        return value

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in FIXED_SIZES:
            self.offset += FIXED_SIZES[kind]
        elif kind == STRING:
            length = self.unpack("<Q")  # read before the offset moves past it
            self.offset += length
        elif kind == ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in FIXED_SIZES:
                self.offset += count * FIXED_SIZES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"metadata value type {kind} is unknown")
