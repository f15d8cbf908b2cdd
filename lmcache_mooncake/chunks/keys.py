"""Chunk keys: chained SHA-256 over token ids, in a namespace.

A prompt is cut into chunks of ``chunk_size`` tokens (the last one may be
shorter). Chunk *i*'s key is

    key_i = SHA-256(b"lmcm-chunk\\0" || key_{i-1} || u32le(n) || n x u32le(token))

and ``key_{-1}`` (the root) is SHA-256 over the namespace digest, the
request's ``cache_salt`` and LoRA name. So a chunk's key fixes every token
before it; tenants with different salts never share a chunk; and the
namespace fixes everything that changes the bytes of a chunk (model, KV
dtype, layer count, KV heads, head size, chunk size, parallel layout, and
the chunk layout: token-major, or the backend's own blocks).

Only ``hashlib`` and fixed byte encodings are used: every process on every
host derives the same keys, with no ``PYTHONHASHSEED``.

This module is also the one place that *names* chunks: :func:`namespace_for`
builds the namespace (the worker from its KV tensors, warm-up from the model's
config), and :func:`chunk_name` / :func:`object_name` / :func:`file_name` turn
a namespace and a chunk key into the store object name and the disk file
name. Names carry the full 256-bit namespace digest and the full 256-bit key,
never a truncation, so two different prefixes are never one object.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

FORMAT_TAG = b"lmcache-mooncake/keys/v1"


#: Chunk layouts (:attr:`KeyNamespace.chunk_layout`): token-major ``[2, L, T, H * D]``, or the
#: paged blocks' own bytes (:mod:`lmcache_mooncake.kv.block_chunks`). The one place these names live.
TOKENS = "tokens"
BLOCKS = "blocks"
CHUNK_LAYOUTS = (TOKENS, BLOCKS)


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
    #: How a chunk keeps its bytes: ``"tokens"`` (token-major) or ``"blocks"`` (the paged
    #: blocks' own layout, :mod:`lmcache_mooncake.kv.block_chunks`); see ``PagedLayout.chunk_layout``.
    chunk_layout: str = TOKENS

    def digest(self) -> bytes:
        """SHA-256 of a canonical JSON encoding (sorted keys, no spaces). ``chunk_layout`` enters
        only when it is not ``"tokens"``, so token-major namespaces keep the digests they had."""
        fields = asdict(self)
        if fields["chunk_layout"] == TOKENS:
            del fields["chunk_layout"]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(FORMAT_TAG + b"\0" + blob.encode()).digest()

    def hex(self) -> str:
        """The namespace's name in file and object names: its full digest, 64 hex digits."""
        return self.digest().hex()


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
        """The whole 256-bit digest as an unsigned int: LMCache's ``chunk_hash`` field."""
        return int.from_bytes(self.digest, "big")


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


# -- names -------------------------------------------------------------------

#: Prefix of every store object name of ours.
OBJECT_PREFIX = "lmcm/"
#: Suffix of every disk-tier chunk file.
FILE_SUFFIX = ".lmcm"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def model_identity(configured: str | None, served_model_name: str) -> str:
    """The model id that enters the namespace: ``model_id`` from the config, else vLLM's served name."""
    return configured or served_model_name


def namespace_for(
    model_id: str,
    kv_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    chunk_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    chunk_layout: str = TOKENS,
) -> KeyNamespace:
    """The namespace of one worker's chunks. The worker (from its KV tensors) and
    warm-up (from the model config) both call this, so they cannot drift apart.

    ``kv_dtype`` is torch's name without ``torch.`` (``"float32"``); ``chunk_layout``
    is ``"tokens"`` or ``"blocks"`` (``PagedLayout.chunk_layout``); raises
    ``ValueError`` for impossible values.
    """
    if chunk_layout not in CHUNK_LAYOUTS:
        raise ValueError(f"chunk_layout {chunk_layout!r} is not one of {CHUNK_LAYOUTS}")
    kv_dtype = str(kv_dtype).removeprefix("torch.")
    if not kv_dtype.isalnum():
        raise ValueError(f"kv dtype {kv_dtype!r} is not a torch dtype name such as 'float32'")
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size), ("chunk_size", chunk_size), ("tp_size", tp_size)):
        if int(value) <= 0:
            raise ValueError(f"{name}={value} must be positive")
    if not 0 <= int(tp_rank) < int(tp_size):
        raise ValueError(f"tp_rank={tp_rank} is not in [0, tp_size={tp_size})")
    return KeyNamespace(
        model=str(model_id), kv_dtype=kv_dtype, num_layers=int(num_layers), num_kv_heads=int(num_kv_heads),
        head_size=int(head_size), chunk_size=int(chunk_size), tp_size=int(tp_size), tp_rank=int(tp_rank),
        chunk_layout=chunk_layout,
    )


def chunk_name(namespace: KeyNamespace | str, key: ChunkKey | bytes | int) -> str:
    """``<namespace digest>/<chunk key>``, both as 64 hex digits: the one name of a chunk.

    ``namespace``: a :class:`KeyNamespace` or its :meth:`~KeyNamespace.hex`;
    ``key``: a :class:`ChunkKey`, its 32-byte digest, or :attr:`ChunkKey.as_int`.
    Every part is validated, so a key never becomes an unchecked path: raises
    ``ValueError`` for anything that is not a namespace digest and a key.
    """
    ns = namespace.hex() if isinstance(namespace, KeyNamespace) else str(namespace)
    if not _HEX64.match(ns):
        raise ValueError(f"namespace {ns!r} is not a 64-hex-digit namespace digest")
    if isinstance(key, ChunkKey):
        digest = key.digest
    elif isinstance(key, int) and not isinstance(key, bool):
        if not 0 <= key < 2**256:
            raise ValueError("chunk key out of range")
        digest = key.to_bytes(32, "big")
    else:
        digest = bytes(key)
    if len(digest) != 32:
        raise ValueError(f"chunk key has {len(digest)} bytes, expected 32")
    return f"{ns}/{digest.hex()}"


def object_name(namespace: KeyNamespace | str, key: ChunkKey | bytes | int) -> str:
    """The chunk's Mooncake Store object name: ``lmcm/<namespace>/<key>``."""
    return OBJECT_PREFIX + chunk_name(namespace, key)


def file_name(namespace: KeyNamespace | str, key: ChunkKey | bytes | int) -> str:
    """The chunk's disk-tier path relative to the tier's folder: ``<namespace>/<key>.lmcm``."""
    return chunk_name(namespace, key) + FILE_SUFFIX


def object_names(
    namespace: KeyNamespace,
    tokens: Sequence[int],
    cache_salt: str | None = None,
    lora: str | None = None,
    *,
    include_partial: bool = True,
) -> list[str]:
    """Store object names of every chunk of ``tokens``, in order."""
    return [object_name(namespace, k)
            for k in chunk_keys(namespace, tokens, cache_salt, lora, include_partial=include_partial)]
