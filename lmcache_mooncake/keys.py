"""Chunk keys: chained SHA-256 over token ids, in a namespace.

A prompt is cut into chunks of ``chunk_size`` tokens (the last one may be
shorter). Chunk *i*'s key is

    key_i = SHA-256(b"lmcm-chunk\\0" || key_{i-1} || u32le(n) || n x u32le(token))

and ``key_{-1}`` (the root) is SHA-256 over the namespace digest, the
request's ``cache_salt`` and LoRA name. So a chunk's key fixes every token
before it; tenants with different salts never share a chunk; and the
namespace fixes everything that changes the bytes of a chunk (model, KV
dtype, layer count, KV heads, head size, chunk size, parallel layout).

Only ``hashlib`` and fixed byte encodings are used: every process on every
host derives the same keys, with no ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

FORMAT_TAG = b"lmcache-mooncake/keys/v1"


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that changes the bytes of a stored chunk."""

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_size: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def digest(self) -> bytes:
        """SHA-256 of a canonical JSON encoding (sorted keys, no spaces)."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(FORMAT_TAG + b"\0" + blob.encode()).digest()

    def hex(self) -> str:
        """A short stable name for this namespace (first 16 hex digits of the digest)."""
        return self.digest().hex()[:16]


@dataclass(frozen=True)
class ChunkKey:
    """The key of tokens ``[start, end)`` of a prompt."""

    digest: bytes
    start: int
    end: int

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def as_int(self) -> int:
        """First 8 bytes as an unsigned int: LMCache's ``chunk_hash`` field."""
        return int.from_bytes(self.digest[:8], "big")


def root_digest(namespace: KeyNamespace, cache_salt: str | None = None, lora: str | None = None) -> bytes:
    """The parent of a prompt's first chunk; salt and LoRA enter here."""
    h = hashlib.sha256(b"lmcm-root\0")
    h.update(namespace.digest())
    for part in (cache_salt, lora):
        if part is None:
            h.update(b"\0")
        else:
            raw = part.encode("utf-8")
            h.update(b"\1" + struct.pack("<I", len(raw)) + raw)
    return h.digest()


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return struct.pack("<I", arr.size) + arr.astype("<u4").tobytes()


def chunk_keys(
    namespace: KeyNamespace,
    tokens: Sequence[int],
    cache_salt: str | None = None,
    lora: str | None = None,
    *,
    include_partial: bool = True,
) -> list[ChunkKey]:
    """Keys of every chunk of ``tokens``, in order.

    With ``include_partial`` the trailing piece shorter than ``chunk_size``
    gets a key too (it is stored when ``save_unfull_chunk`` is on).
    """
    size = namespace.chunk_size
    parent = root_digest(namespace, cache_salt, lora)
    keys: list[ChunkKey] = []
    n = len(tokens)
    for start in range(0, n, size):
        end = min(start + size, n)
        if end - start < size and not include_partial:
            break
        h = hashlib.sha256(b"lmcm-chunk\0")
        h.update(parent)
        h.update(_encode_tokens(tokens[start:end]))
        parent = h.digest()
        keys.append(ChunkKey(parent, start, end))
    return keys
