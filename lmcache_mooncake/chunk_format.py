"""The byte format of a stored chunk: a safetensors file with a checked header.

A chunk is one tensor named ``kv`` (shape ``[2, layers, tokens, heads*head_size]``)
saved with safetensors, whose ``__metadata__`` carries:

- ``format``: :data:`FORMAT_VERSION`
- ``key``: the chunk's own key (so a file renamed or served for another key fails)
- ``dtype`` and ``shape``: repeated from the tensor entry and cross-checked
- ``sha256``: SHA-256 of the tensor bytes

:func:`decode` checks all of them and raises :class:`ChunkVerificationError`
on any mismatch; callers treat that as a miss. Nothing is unpickled: the
header is JSON and the payload is raw tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import save as st_save

FORMAT_VERSION = "lmcm-chunk-1"
TENSOR_NAME = "kv"

_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
}
# Header sizes above this are not a chunk: refuse before parsing.
_MAX_HEADER = 1 << 20


class ChunkVerificationError(ValueError):
    """Stored bytes are not the chunk they claim to be (damaged, truncated or misnamed)."""


def encode(key: str, tensor: torch.Tensor) -> bytes:
    """Serialize ``tensor`` as the chunk named ``key``."""
    tensor = tensor.contiguous()
    payload_digest = hashlib.sha256(_tensor_bytes(tensor)).hexdigest()
    metadata = {
        "format": FORMAT_VERSION,
        "key": key,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": json.dumps(list(tensor.shape)),
        "sha256": payload_digest,
    }
    return st_save({TENSOR_NAME: tensor}, metadata=metadata)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


def decode(data: bytes | bytearray | memoryview, expected_key: str) -> torch.Tensor:
    """Return the chunk's tensor (a copy, CPU) or raise :class:`ChunkVerificationError`."""
    view = memoryview(data)
    if len(view) < 8:
        raise ChunkVerificationError("truncated: no safetensors header")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > _MAX_HEADER or 8 + hlen > len(view):
        raise ChunkVerificationError(f"bad header length {hlen}")
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except ValueError as e:
        raise ChunkVerificationError(f"header is not JSON: {e}") from None
    meta = header.get("__metadata__") or {}
    entry = header.get(TENSOR_NAME)
    if meta.get("format") != FORMAT_VERSION:
        raise ChunkVerificationError(f"unknown format {meta.get('format')!r}")
    if meta.get("key") != expected_key:
        raise ChunkVerificationError(f"holds key {meta.get('key')!r}, expected {expected_key!r}")
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise ChunkVerificationError("missing or unsupported tensor entry")
    dtype = _DTYPES[entry["dtype"]]
    shape = entry.get("shape")
    if str(dtype).removeprefix("torch.") != meta.get("dtype") or json.dumps(shape) != meta.get("shape"):
        raise ChunkVerificationError("dtype or shape in the header disagree")
    begin, end = entry.get("data_offsets", (0, -1))
    payload = view[8 + hlen + begin : 8 + hlen + end]
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if end - begin != nbytes or len(payload) != nbytes:
        raise ChunkVerificationError(f"payload is {len(payload)} bytes, shape needs {nbytes}")
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        raise ChunkVerificationError("checksum mismatch: the chunk bytes are damaged")
    out = torch.empty(shape, dtype=dtype)
    if nbytes:
        out.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return out
