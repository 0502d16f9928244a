"""The GGUF container read the way jinfer uses it: metadata, tensor descriptors, data memory-mapped.

    GGUFFile(path).fields    key -> value: numbers, strings, and arrays (numeric arrays as numpy
                             arrays, string arrays as lists of str)
    GGUFFile(path).tensors   name, ggml type, shape (ggml's order: innermost first), byte range,
                             and `data`, a view of the memory-mapped file shaped as the `gguf`
                             package shapes it (its dequantizers take it as it is)

The `gguf` package's reader makes a NumPy view for every element of every metadata array before
anything can be read: a 256k-token vocabulary with its merges took ~20 s to open. Here a numeric
array is one `frombuffer` and a string array one pass over its lengths, so the same file opens in
well under a second. Little-endian GGUF versions 2 and 3 (what llama.cpp writes) are read;
anything else, or a file that ends early, is a `GGUFFormatError`.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Metadata value types: GGUF's numbering -> NumPy dtype (strings and arrays are read apart).
_SCALARS = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
    7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file jinfer can read (or is cut short)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: innermost first
    data_offset: int  # bytes from the start of the file
    n_bytes: int
    data: np.ndarray  # memory-mapped: float32 / float16 / ... elements, or uint8 blocks of a quantized type


class GGUFFile:
    """A GGUF file opened for reading (the mapping lives as long as the tensors' data is used)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from None
        self._buffer = memoryview(self._map)
        self._at = 0
        if bytes(self._take(4)) != _MAGIC:
            raise GGUFFormatError("no GGUF magic at the start of the file")
        version = self._scalar(np.uint32)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (jinfer reads versions 2 and 3, little-endian)")
        tensor_count, field_count = self._scalar(np.uint64), self._scalar(np.uint64)
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar(np.uint32))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(int(d) for d in self._array_of(np.uint64, self._scalar(np.uint32)))
            infos.append((name, dims, self._scalar(np.uint32), self._scalar(np.uint64)))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ----------------------------------------------------------------------------- reading
    def _take(self, n: int) -> memoryview:
        if self._at + n > len(self._buffer):
            raise GGUFFormatError(f"the file ends at byte {len(self._buffer)}, inside its header")
        view = self._buffer[self._at : self._at + n]
        self._at += n
        return view

    def _scalar(self, dtype) -> Any:
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self._take(size), dtype=np.dtype(dtype).newbyteorder("<"))[0].item()

    def _array_of(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype).newbyteorder("<")
        return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype)

    def _string(self) -> str:
        return bytes(self._take(self._scalar(np.uint64))).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF metadata type {kind}")
        item, count = self._scalar(np.uint32), self._scalar(np.uint64)
        if item in _SCALARS:
            return self._array_of(_SCALARS[item], count).copy()
        if item == _STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        buffer, at, out = self._buffer, self._at, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack(buffer, at)
            out.append(bytes(buffer[at + 8 : at + 8 + length]).decode("utf-8", errors="replace"))
            at += 8 + length
        if at > len(buffer):
            raise GGUFFormatError(f"the file ends at byte {len(buffer)}, inside its header")
        self._at = at
        return out

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        import gguf

        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has an unknown ggml type {kind}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        elements = int(np.prod(dims))
        n_bytes = elements // block * block_bytes
        at = start + offset
        if at + n_bytes > len(self._buffer):
            raise GGUFFormatError(
                f"truncated GGUF: tensor {name}'s data ends past the file's {len(self._buffer)} bytes"
            )
        shape = tuple(reversed(dims))
        element = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16}
        element |= {"I32": np.int32, "I64": np.int64}
        if tensor_type.name in element:
            data = np.frombuffer(self._buffer, element[tensor_type.name], elements, at).reshape(shape)
        else:  # blocks as raw bytes, rows of (elements per row / block) x block_bytes
            data = np.frombuffer(self._buffer, np.uint8, n_bytes, at)
            data = data.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return GGUFTensor(name, tensor_type, dims, at, n_bytes, data)
