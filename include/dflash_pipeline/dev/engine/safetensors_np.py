"""Read and write safetensors files with numpy only (the pipeline's ``.venv`` has no torch).

Why: the dev checkpoints (the tiny designed target, drafters for it) are written and inspected
without torch. The format: a little-endian u64 header length, the JSON header (names, dtypes,
shapes, byte offsets; padded with spaces to 8 bytes), then the raw little-endian buffers.

bfloat16 has no numpy dtype: :func:`to_bf16` rounds float32 to bfloat16 (round to nearest even)
and returns a :class:`Bf16` holding the 16-bit patterns, which the writer stores as ``BF16``;
:func:`read_tensor` widens ``BF16`` back to float32.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
_NUMPY = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BF16": np.uint16}


@dataclass(frozen=True)
class Bf16:
    """A bfloat16 tensor as its 16-bit patterns (``bits``: uint16, the upper half of float32)."""

    bits: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)


def to_bf16(values: np.ndarray) -> Bf16:
    """float32 -> bfloat16 by round-to-nearest-even on the dropped 16 bits (as torch does)."""
    u32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = u32 + np.uint32(0x7FFF) + ((u32 >> np.uint32(16)) & np.uint32(1))
    return Bf16((rounded >> np.uint32(16)).astype(np.uint16))


def _raw(arr: np.ndarray | Bf16) -> tuple[str, list[int], bytes]:
    if isinstance(arr, Bf16):
        return "BF16", list(arr.bits.shape), np.ascontiguousarray(arr.bits).astype("<u2", copy=False).tobytes()
    data = np.ascontiguousarray(arr)
    return _DTYPES[data.dtype], list(data.shape), data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()


def write_safetensors(path: Path, named: Mapping[str, np.ndarray | Bf16],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `named` tensors to `path` (through a temporary file, then renamed)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    buffers = []
    offset = 0
    for name, arr in named.items():
        dtype, shape, raw = _raw(arr)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        buffers.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in buffers:
            f.write(raw)
    tmp.replace(path)


def read_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file: name -> {dtype, shape, data_offsets} (and ``__metadata__``)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(size))
    return header


def read_tensor(path: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file as a numpy array (``BF16`` widened to float32)."""
    header = read_header(path)
    entry = header[name]
    start, end = entry["data_offsets"]
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        f.seek(8 + size + start)
        raw = f.read(end - start)
    values = np.frombuffer(raw, dtype=np.dtype(_NUMPY[entry["dtype"]]).newbyteorder("<")).reshape(entry["shape"])
    if entry["dtype"] == "BF16":
        return (values.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return values.astype(values.dtype.newbyteorder("="))
