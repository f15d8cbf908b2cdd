"""How attention backends lay out vLLM's paged KV cache, and copies between it and chunk buffers.

This is the only module that knows a backend's paged layout. Everything else
sees chunk buffers in LMCache's ``KV_2LTD`` format: for a chunk of ``T``
tokens over ``L`` layers, a ``[2, L, T, H * D]`` tensor (``[0]`` = K,
``[1]`` = V; ``H`` KV heads of ``D`` elements, head-major within a token).
Per layer that is a ``[2, T, H * D]`` slice.

A token's *slot* is ``block_id * block_size + offset_in_block``, as in vLLM's
``slot_mapping``.

vLLM 0.32 hands every attention backend, and a connector's
``register_kv_caches``, the same *logical* per-layer tensor ``[B, H, N, C]``
(``B`` blocks of ``N`` tokens, ``H`` KV heads, ``C = 2 * D`` elements of K
then V for standard attention): ``allocate_kv_cache`` in
``vllm/v1/worker/utils.py`` builds it with ``create_kv_cache_views`` in
``vllm/v1/kv_cache_interface.py``. Its *physical* order is the engine-wide
``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``), a permutation of
``[L, B, H, N, C]`` with ``C`` always innermost: ``LBNHC`` ("NHD", the default
when no backend states a preference), ``LBHNC`` ("HND"), ``LHBNC``, and the
block-outer ``BLHNC``, ``BLNHC``, ``BHLNC`` where every block holds all the
layers' pages, so a layer's block stride spans the other layers. Pages may
also be padded. The per-layer tensor is therefore a strided view; the copies
below follow its strides, so any of these orders works. How each backend
reads the logical tensor:

``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN`` (:class:`GpuPagedLayout`)
    ``key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)``, i.e. K
    of (block ``b``, head ``h``, offset ``o``) is ``kv[b, h, o, :D]`` and V is
    ``kv[b, h, o, D:]``; the cache writes put token ``slot`` at block
    ``slot // N``, offset ``slot % N`` of those ``[B, N, H, D]`` views.
    vLLM 0.32: ``vllm/v1/attention/backends/flash_attn.py`` (``forward`` and
    ``do_kv_cache_update``), ``flashinfer.py`` (``forward`` permutes to the
    physical order before the same split; ``do_kv_cache_update``),
    ``triton_attn.py`` (``forward``, ``do_kv_cache_update``), and the write
    kernel ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``. These
    backends accept any ``KVCacheLayout`` (FlashInfer on SM100 asks for
    ``LBHNC`` / ``BLHNC``). Quantized caches (FP8, NVFP4, per-token-head
    INT8/FP8/INT4 with inline scales) are refused by dtype.
``CPU_ATTN`` (vLLM's CPU backend, ``vec`` / ``vec16`` kernels)
    The same logical ``[B, H, N, 2 * D]`` tensor, but the backend only allows
    ``LBHNC`` (``supported_kv_cache_layouts`` in
    ``vllm/v1/attention/backends/cpu_attn.py``), so each (block, head) is one
    contiguous run, which the kernel re-views as ``[B, H, 2N, D]`` and splits
    ``.chunk(2, dim=2)``: per (block, head) the first ``N * D`` elements are K
    and the next ``N * D`` are V. V is token-major (``[N, D]``: V of offset
    ``o`` is row ``o``), but K is stored *column-major* (``[D, N]``: element
    ``d`` of offset ``o`` is at ``d * N + o``), so that the QK kernel reads
    one head dimension for all tokens of a block at once. This was checked
    against vLLM 0.32's own ``cpu_attn_reshape_and_cache`` (see the tests);
    note that K is *not* ``kv[b, h, o, :D]`` as on the GPU backends.
``CPU_ATTN`` with the ``amx`` kernel (bfloat16 on CPUs with AMX tiles)
    The same contiguous (block, head) runs, K then V, packed in tiles for the
    AMX matrix unit: K as ``[N/16, D/2, 16, 2]`` (for 16 tokens at a time,
    pairs of head dims) and V as ``[D/16, N/2, 16, 2]`` (for 16 head dims at
    a time, pairs of tokens), found by writing index patterns with vLLM's
    ``cpu_attn_reshape_and_cache(..., "amx")`` and checked against it in the
    tests. Whole blocks still move with one strided copy (6-D views); a
    partial block moves token by token. The NEON / VSX / VXE / RVV packings
    are not verified here and are refused rather than misread.

vLLM may split each scheduler block of ``M`` tokens into ``M / N`` kernel
blocks of ``N`` tokens (``prepare_kernel_block_sizes`` in
``vllm/v1/worker/utils.py``); the tensor then has ``B * M / N`` blocks of
``N`` tokens, and block ``b`` is kernel blocks ``b * M / N`` onwards, so a
slot ``b * M + o`` is the same token either way and slots need no
translation. ``kv_shape`` therefore accepts a ``block_size`` that is a
multiple of the tensor's.

How the copies work: every layout exposes K and V as strided ``[B, N, H, D]``
views of its tensor (no copy). From their strides we compute, once per chunk,
the storage offsets of each token's K and V, in the largest contiguous unit
the layout allows (a whole ``H * D`` token row, one ``D`` head row, or single
elements; in the GPU layout K and V alternate every ``D`` elements, so it is
a head row unless padding misaligns it), and move data with one
``index_select(..., out=...)`` (gather) or ``index_copy_`` (scatter) per layer
and per K/V. No per-token Python loops and no intermediate chunk-sized copies
when the buffers are contiguous. Layers sharing shape and strides (all of
vLLM's, in every physical order) share the offsets.

Slots must be distinct and within ``[0, B * N)``. Duplicate slots are not
expected (vLLM never maps two tokens to one slot): gather would just copy the
token twice, but scatter would leave one of the writers' data in the slot,
unspecified which. vLLM's padding slot ``-1`` must be stripped by the caller.
Out-of-range slots raise ``ValueError`` when ``slots`` is a CPU tensor; for
device tensors the check would need a host sync, so it is skipped.
"""

from __future__ import annotations

import platform
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import torch

from lmcache_mooncake.chunks.keys import BLOCKS, TOKENS
from lmcache_mooncake.kv.paged_copy import (
    _block_runs,
    _check_buffer,
    _check_slots,
    _gather_side,
    _Plan,
    _scatter_side,
    _side,
)

__all__ = [
    "GPU_BACKENDS",
    "SUPPORTED_BACKENDS",
    "SUPPORTED_DTYPES",
    "CpuAttnLayout",
    "GpuPagedLayout",
    "KVShape",
    "PagedKV",
    "PagedLayout",
    "chunk_layout_for",
    "gather_chunk",
    "infer_kv_shape",
    "layout_for_backend",
    "scatter_chunk",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KVShape:
    """Geometry of a model's paged KV cache, identical for every layer."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def hidden(self) -> int:
        """Elements of K (or V) per token per layer: ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the ``KV_2LTD`` chunk buffer for ``num_tokens`` tokens."""
        return (2, self.num_layers, num_tokens, self.hidden)


# -- layouts --------------------------------------------------------------------


class PagedLayout(ABC):
    """One attention backend's per-layer paged KV layout.

    Subclasses describe the layout (``kv_shape`` validates a tensor,
    ``_kv_views`` exposes K and V as ``[B, N, H, D]`` views); ``gather`` and
    ``scatter`` are shared. Layout objects are immutable and thread-safe.
    """

    name: str
    """The vLLM attention backend name (``backend.get_name()``) this layout is for."""

    @abstractmethod
    def kv_shape(self, kv_layer: torch.Tensor, block_size: int | None = None) -> tuple[int, int, int, int]:
        """``(num_blocks, num_kv_heads, block_size, head_size)`` of one layer's paged tensor.

        Raises ``ValueError`` (saying what was expected) if ``kv_layer`` can't
        be this layout: wrong rank, dtype, or memory order, or (when
        ``block_size``, vLLM's scheduler block size, is given) blocks whose
        size does not divide it. The returned block size is the tensor's,
        which is smaller than ``block_size`` when vLLM split blocks into
        kernel blocks (see the module docstring); slots are the same either way.
        """

    @abstractmethod
    def _kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a validated layer tensor as ``[B, N, H, D]`` views sharing its storage
        (for a tiled layout, ``[B, ...]`` where the dims after ``B`` split ``N``, ``H``, ``D``
        in row-major order, e.g. AMX's ``[B, N/16, 16, H, D/2, 2]``; such a layout copies
        through :class:`PagedKV`, since an element plan cannot describe tiles)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def chunk_layout(self, kv_layer: torch.Tensor, chunk_size: int) -> str:
        """How chunks of this layout keep their bytes (part of the key namespace): ``"tokens"``
        (token-major ``[2, L, T, H * D]``) or ``"blocks"`` (the paged blocks' own bytes, see
        :mod:`lmcache_mooncake.kv.block_chunks`). ``"tokens"`` unless a subclass says otherwise."""
        return TOKENS

    # -- public copies ------------------------------------------------------------

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy K and V of the tokens at ``slots`` of one layer into ``out``.

        ``slots``: 1-D integer tensor of ``T`` distinct slots (any device; it is
        moved to ``kv_layer``'s). ``out``: ``[2, T, H * D]``, same dtype and
        device as ``kv_layer``; ``out[0, i]`` / ``out[1, i]`` receive K / V of
        ``slots[i]``, heads in order. ``kv_layer`` is not modified. Raises
        ``ValueError`` on malformed arguments.
        """
        shape = self.kv_shape(kv_layer)
        slots = _check_slots(slots, shape[0] * shape[2], kv_layer.device)
        _check_buffer("out", out, (2, slots.numel(), shape[1] * shape[3]), kv_layer)
        plan = self._plan(kv_layer, slots, shape[2])
        _gather_side(kv_layer, plan.k, out[0])
        _gather_side(kv_layer, plan.v, out[1])

    def scatter(self, kv_layer: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[2, T, H * D]`` (K, V) into one layer at ``slots``.

        The inverse of :meth:`gather`: afterwards gathering ``slots`` returns
        ``src`` bit for bit. Every other element of ``kv_layer``'s storage is
        left untouched. Same argument rules as :meth:`gather`; ``src`` may have
        any strides.
        """
        shape = self.kv_shape(kv_layer)
        slots = _check_slots(slots, shape[0] * shape[2], kv_layer.device)
        _check_buffer("src", src, (2, slots.numel(), shape[1] * shape[3]), kv_layer)
        plan = self._plan(kv_layer, slots, shape[2])
        _scatter_side(kv_layer, plan.k, src[0])
        _scatter_side(kv_layer, plan.v, src[1])

    # -- internals ----------------------------------------------------------------

    def _plan(self, kv_layer: torch.Tensor, slots: torch.Tensor, block_size: int) -> _Plan:
        """Row indices of ``slots`` for a layer; depends only on the layer's shape and strides."""
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        offsets = slots - blocks * block_size
        k, v = self._kv_views(kv_layer)
        base = kv_layer.storage_offset()
        return _Plan(
            k=_side(k, k.storage_offset() - base, blocks, offsets),
            v=_side(v, v.storage_offset() - base, blocks, offsets),
        )


def _check_layer_tensor(layout: str, kv: torch.Tensor, rank: int, expected: str) -> None:
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"{layout}: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != rank:
        raise ValueError(
            f"{layout}: expected a {rank}-D paged KV tensor {expected}, got shape {tuple(kv.shape)}"
        )
    if kv.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{layout}: KV dtype {kv.dtype} is not supported (supported: "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}; quantized KV caches are not)"
        )
    if kv.numel() == 0:
        raise ValueError(f"{layout}: empty paged KV tensor of shape {tuple(kv.shape)}")


def _check_block_size(layout: str, found: int, block_size: int | None) -> None:
    if block_size is not None and (block_size <= 0 or block_size % found):
        raise ValueError(
            f"{layout}: the paged KV tensor holds blocks of {found} tokens, but block_size={block_size} "
            f"was expected (or a multiple of {found}, when vLLM splits blocks into kernel blocks)"
        )


def _check_width(layout: str, kv: torch.Tensor) -> int:
    """``head_size`` of a ``[..., 2 * head_size]`` tensor (K and V of equal size)."""
    width = kv.shape[-1]
    if width % 2:
        raise ValueError(f"{layout}: last dim must be 2 * head_size (even), got shape {tuple(kv.shape)}")
    return width // 2


class CpuAttnLayout(PagedLayout):
    """vLLM's ``CPU_ATTN`` backend: ``[B, H, N, 2D]``, per (block, head) K as ``[D, N]`` then V as ``[N, D]``.

    ``isa`` is the CPU attention kernel vLLM picked for the model (the
    ``isa`` attribute it sets on each attention layer), since the in-block
    packing depends on it. ``"vec"`` and ``"vec16"`` share the packing above;
    ``"amx"`` (bfloat16 on CPUs with AMX tiles) packs each (block, head) in
    tiles: K as ``[N/16, D/2, 16, 2]`` (pairs of head dims of 16 tokens) and V
    as ``[D/16, N/2, 16, 2]`` (pairs of tokens of 16 head dims), checked
    against vLLM's ``cpu_attn_reshape_and_cache`` in the tests. ``None``
    resolves it per tensor the way vLLM does (by dtype, block size, head size
    and CPU features) and refuses the others.
    """

    name = "CPU_ATTN"
    SUPPORTED_ISAS: ClassVar[tuple[str, ...]] = ("vec", "vec16", "amx")
    _EXPECTED: ClassVar[str] = "[num_blocks, num_kv_heads, block_size, 2 * head_size]"

    def __init__(self, isa: str | None = None) -> None:
        if isa is not None:
            _check_isa(isa)
        self.isa = isa

    def __repr__(self) -> str:
        return f"CpuAttnLayout(isa={self.isa!r})"

    def kv_shape(self, kv_layer: torch.Tensor, block_size: int | None = None) -> tuple[int, int, int, int]:
        _check_layer_tensor(self.name, kv_layer, 4, self._EXPECTED)
        blocks, heads, tokens, width = kv_layer.shape
        head_size = _check_width(self.name, kv_layer)
        _check_block_size(self.name, tokens, block_size)
        # The backend views each (block, head) as one [2N, D] run of memory;
        # only the block and head strides may be arbitrary.
        if (tokens > 1 and kv_layer.stride(2) != width) or (width > 1 and kv_layer.stride(3) != 1):
            raise ValueError(
                f"{self.name}: each (block, head) must be contiguous [block_size, 2 * head_size] memory, "
                f"got strides {kv_layer.stride()} for shape {tuple(kv_layer.shape)}"
            )
        isa = self._isa_of(kv_layer)
        if isa == "amx" and (tokens % 16 or head_size % 16):
            raise ValueError(
                f"{self.name} with the 'amx' kernel: block size {tokens} and head size {head_size} "
                "must be multiples of 16"
            )
        return blocks, heads, tokens, head_size

    def _isa_of(self, kv_layer: torch.Tensor) -> str:
        if self.isa is not None:
            return self.isa
        _, _, tokens, width = kv_layer.shape
        isa = _vllm_cpu_isa(kv_layer.dtype, tokens, width // 2)
        _check_isa(isa)
        return isa

    def _kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, heads, tokens, width = kv_layer.shape
        dim = width // 2
        halves = kv_layer.view(blocks, heads, 2, tokens * dim)  # [B, H, K|V, N*D]
        if self._isa_of(kv_layer) == "amx":
            # Tiles, as views whose dims after the block are a row-major split of [N, H, D]:
            # K [B, N/16, 16, H, D/2, 2] over memory [B, H, N/16, D/2, 16, 2];
            # V [B, N/2, 2, H, D/16, 16] over memory [B, H, D/16, N/2, 16, 2].
            k = halves[:, :, 0].unflatten(-1, (tokens // 16, dim // 2, 16, 2)).permute(0, 2, 4, 1, 3, 5)
            v = halves[:, :, 1].unflatten(-1, (dim // 16, tokens // 2, 16, 2)).permute(0, 3, 5, 1, 2, 4)
            return k, v
        k = halves[:, :, 0].unflatten(-1, (dim, tokens)).permute(0, 3, 1, 2)  # [B,H,D,N] -> [B,N,H,D]
        v = halves[:, :, 1].unflatten(-1, (tokens, dim)).permute(0, 2, 1, 3)  # [B,H,N,D] -> [B,N,H,D]
        return k, v

    def chunk_layout(self, kv_layer: torch.Tensor, chunk_size: int) -> str:
        """``"blocks"`` for the ``vec``/``vec16`` kernels when chunks are whole blocks: K is
        column-major in a block, so token-major chunks cost a transposing copy per block
        (:mod:`lmcache_mooncake.kv.block_chunks`). AMX tiles stay ``"tokens"``."""
        _, _, tokens, _ = self.kv_shape(kv_layer)
        if self._isa_of(kv_layer) == "amx" or chunk_size % tokens:
            return TOKENS
        return BLOCKS

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        if self._isa_of(kv_layer) != "amx":
            return super().gather(kv_layer, slots, out)
        PagedKV(self, [kv_layer]).gather(slots, out.unsqueeze(1))  # tiles: no per-element plan
        return None

    def scatter(self, kv_layer: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        if self._isa_of(kv_layer) != "amx":
            return super().scatter(kv_layer, slots, src)
        PagedKV(self, [kv_layer]).scatter(slots, src.unsqueeze(1))
        return None


class GpuPagedLayout(PagedLayout):
    """vLLM 0.32's GPU layout: logical ``[B, H, N, 2D]``, K then V in each (block, head, offset) row.

    Used by ``FLASH_ATTN``, ``FLASHINFER`` and ``TRITON_ATTN`` alike; ``backend``
    only names the layout in messages. Each of them splits the per-layer
    tensor with ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` into
    ``[B, N, H, D]`` K and V caches (``vllm/v1/attention/backends/flash_attn.py``,
    ``flashinfer.py``, ``triton_attn.py``), and ``reshape_and_cache_flash``
    writes token ``slot`` at ``[slot // N, slot % N]`` of them. The tensor may
    have any strides (vLLM's ``KVCacheLayout`` decides them, see the module
    docstring); nothing here depends on which physical order it is.
    """

    _EXPECTED: ClassVar[str] = "[num_blocks, num_kv_heads, block_size, 2 * head_size]"

    def __init__(self, backend: str = "FLASH_ATTN") -> None:
        key = str(backend).strip().upper()
        if key not in GPU_BACKENDS:
            raise ValueError(f"GpuPagedLayout is the layout of {', '.join(GPU_BACKENDS)}, not {backend!r}")
        self.name = key

    def __repr__(self) -> str:
        return f"GpuPagedLayout({self.name!r})"

    def kv_shape(self, kv_layer: torch.Tensor, block_size: int | None = None) -> tuple[int, int, int, int]:
        _check_layer_tensor(self.name, kv_layer, 4, self._EXPECTED)
        blocks, heads, tokens, _ = kv_layer.shape
        head_size = _check_width(self.name, kv_layer)
        _check_block_size(self.name, tokens, block_size)
        return blocks, heads, tokens, head_size

    def _kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's own split: (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)).
        key_cache, value_cache = kv_layer.transpose(1, 2).split(kv_layer.shape[-1] // 2, dim=-1)
        return key_cache, value_cache


# -- CPU kernel ISA -------------------------------------------------------------


def _check_isa(isa: str) -> None:
    if isa not in CpuAttnLayout.SUPPORTED_ISAS:
        raise ValueError(
            f"CPU_ATTN with the {isa!r} attention kernel is not supported: it packs K/V inside a block "
            f"differently from the {'/'.join(CpuAttnLayout.SUPPORTED_ISAS)} kernels, the only ones "
            "lmcache_mooncake can read and write"
        )


@lru_cache(maxsize=64)
def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU attention kernel vLLM uses for this geometry.

    Inside a vLLM worker running CPU_ATTN the backend module is already
    imported, so ask it. Otherwise (tests, tools) mirror vLLM 0.32's
    ``_get_attn_isa`` rather than importing vLLM, which takes seconds.
    """
    backend = sys.modules.get("vllm.v1.attention.backends.cpu_attn")
    if backend is not None and hasattr(backend, "_get_attn_isa"):
        return str(backend._get_attn_isa(dtype, block_size, head_size))
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return f"{machine} (non-x86)"
    return "vec" if block_size % 32 == 0 else "vec16"


def load_granularity(vllm_config: Any) -> int:
    """Tokens a load must end on a multiple of, for the scheduler side (1: any token).

    vLLM 0.32's ``amx`` CPU attention kernel dies with an illegal instruction
    (SIGILL in ``cpu_attention_with_kv_cache``) when a request's computed tokens
    start inside a block, as they do after a load that ends mid-block; vLLM's
    own prefix cache only ever hits whole blocks. Seen on this project's AMX
    machine, 2026-12-02: a 1,000-token bfloat16 prompt with 999 tokens loaded
    crashed the worker, with 896 (7 blocks) it gave the recomputed tokens. So
    where vLLM will pick ``amx`` (CPU, bfloat16, AMX tiles, block size a
    multiple of 32), loads are whole blocks: the block size.
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 1
        model = vllm_config.model_config
        dtype = model.dtype  # vLLM picks the kernel by the model's dtype: CPU_ATTN caches
        # "auto" (the model's dtype) or fp8, and fp8 under a bfloat16 model is still ``amx``.
        block_size = int(vllm_config.cache_config.block_size)
        isa = _vllm_cpu_isa(dtype, block_size, int(model.get_head_size()))
    except Exception:  # noqa: BLE001 - a config we cannot read: no restriction
        return 1
    return block_size if isa == "amx" else 1


def chunk_layout_for(backend_name: str, dtype: str | torch.dtype, block_size: int, head_size: int,
                     chunk_size: int) -> str:
    """The chunk layout a worker of ``backend_name`` picks (:meth:`PagedLayout.chunk_layout`), from the
    geometry alone: for warm-up, which names chunks before any worker has KV tensors. ``"tokens"``
    for an unknown or empty backend name."""
    if backend_name not in SUPPORTED_BACKENDS or block_size <= 0:
        return TOKENS
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
    layer = torch.empty((1, 1, block_size, 2 * head_size), dtype=torch_dtype, device="meta")
    try:
        return layout_for_backend(backend_name).chunk_layout(layer, chunk_size)
    except ValueError:  # a kernel we cannot read: the worker refuses to start, nothing is named
        return TOKENS


# -- backend names --------------------------------------------------------------

GPU_BACKENDS: tuple[str, ...] = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
SUPPORTED_BACKENDS: tuple[str, ...] = ("CPU_ATTN", *GPU_BACKENDS)

_WHY_NOT: dict[str, str] = {
    # Pre-CPU_ATTN vLLM's CPU backend; its paged layout (x-packed keys) is
    # different, and in current vLLM the name only tags ViT attention.
    "TORCH_SDPA": "it is the old CPU backend (or, in current vLLM, a ViT-only tag) and its KV layout differs",
    "FLASH_ATTN_DIFFKV": "its K and V have different head sizes",
    "TRITON_ATTN_DIFFKV": "its K and V have different head sizes",
}


def layout_for_backend(backend_name: str, *, cpu_isa: str | None = None) -> PagedLayout:
    """The paged layout of vLLM 0.32 attention backend ``backend_name`` (e.g. ``backend.get_name()``).

    Accepts ``"CPU_ATTN"`` (:class:`CpuAttnLayout`) and ``"FLASH_ATTN"``,
    ``"FLASHINFER"``, ``"TRITON_ATTN"`` (:class:`GpuPagedLayout`), case
    insensitive. ``cpu_isa`` pins the CPU kernel for ``CPU_ATTN`` (see
    :class:`CpuAttnLayout`); by default it is resolved from each tensor.
    Raises ``ValueError`` naming the backend and the supported ones otherwise.
    """
    key = str(backend_name).strip().upper()
    if key == "CPU_ATTN":
        return CpuAttnLayout(cpu_isa)
    if key in GPU_BACKENDS:
        return GpuPagedLayout(key)
    if key in _WHY_NOT:
        why = f" ({_WHY_NOT[key]})"
    elif "MLA" in key:
        why = " (MLA backends cache one compressed latent per token, not K and V)"
    else:
        why = ""
    raise ValueError(
        f"vLLM attention backend {backend_name!r} is not supported by lmcache_mooncake{why}. "
        f"Supported backends: {', '.join(SUPPORTED_BACKENDS)}. Choose vLLM's attention backend with "
        "--attention-backend (attention_config.backend)."
    )


# -- whole chunks ---------------------------------------------------------------


def infer_kv_shape(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], block_size: int | None = None
) -> KVShape:
    """Validate that all layers are ``layout`` with one geometry, dtype and device; return it.

    Raises ``ValueError`` if ``kv_caches`` is empty or the layers disagree.
    """
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: expected one paged KV tensor per layer")
    first = kv_caches[0]
    shape = layout.kv_shape(first, block_size)
    for i, kv in enumerate(kv_caches[1:], start=1):
        if layout.kv_shape(kv, block_size) != shape or kv.dtype != first.dtype or kv.device != first.device:
            raise ValueError(
                f"{layout.name}: layer {i} ({tuple(kv.shape)}, {kv.dtype}, {kv.device}) differs from "
                f"layer 0 ({tuple(first.shape)}, {first.dtype}, {first.device})"
            )
    _, heads, tokens, head_size = shape
    return KVShape(
        num_layers=len(kv_caches),
        num_kv_heads=heads,
        head_size=head_size,
        block_size=tokens,
        dtype=first.dtype,
    )


def gather_chunk(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor
) -> None:
    """Copy the tokens at ``slots`` from every layer into ``out`` ``[2, L, T, H * D]`` (``KV_2LTD``).

    ``kv_caches``: the ``L`` per-layer paged tensors, in layer order, all of
    one geometry. Same slot and buffer rules as :meth:`PagedLayout.gather`.
    """
    PagedKV(layout, kv_caches).gather(slots, out)


def scatter_chunk(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, src: torch.Tensor
) -> None:
    """Write ``src`` ``[2, L, T, H * D]`` into every layer at ``slots``; the inverse of :func:`gather_chunk`.

    Nothing else in any layer's storage changes. ``src`` may have any strides
    (e.g. a token range sliced out of a bigger chunk).
    """
    PagedKV(layout, kv_caches).scatter(slots, src)


class PagedKV:
    """One model's paged KV tensors in one layout, validated once, for many chunk copies.

    Building it checks every layer (:func:`infer_kv_shape`) and makes the K and
    V views of each; :meth:`gather` and :meth:`scatter` then only check their
    slots and buffer, so a load of many chunks pays the checks once. Whole
    blocks of a chunk move with one strided copy per run of consecutive
    blocks and K/V (a transpose where the layout stores K column-major): one
    copy for all layers when they are views of one allocation at one layer
    stride, as vLLM allocates them, else one per layer. The rest (a partial
    block at either end) moves token by token.
    """

    def __init__(self, layout: PagedLayout, kv_caches: Sequence[torch.Tensor]):
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.shape = infer_kv_shape(layout, self.kv_caches)
        first = self.kv_caches[0]
        self.num_slots = _num_slots(layout, first)
        self.device = first.device
        self._views = [layout._kv_views(kv) for kv in self.kv_caches]
        # vLLM puts every layer in one allocation at a fixed layer stride: then K (and V)
        # of all layers is one [L, B, N, H, D] view, and a run of blocks moves with one
        # copy for all layers instead of one per layer (24x fewer, each big enough for
        # torch to split across threads).
        self._all_layers = _stacked_views(self._views)
        # Per block, the shapes K and V views take after the block dim: [N, H, D], or a
        # row-major split of it where a layout packs tokens and head dims in tiles (AMX);
        # a chunk buffer's tokens of n blocks are viewed the same way for each copy.
        k0, v0 = self._views[0]
        self._kdims, self._vdims = tuple(k0.shape[1:]), tuple(v0.shape[1:])
        self._tiled = len(self._kdims) != 3 or len(self._vdims) != 3
        # One layer's block as the paged tensor stores it, and every layer's tensor as one
        # [L, B, *block] view when they share one allocation (for "blocks" chunks).
        self.block_shape = tuple(first.shape[1:])
        self.block_numel = first[0].numel()
        self.raw_all = _stack(self.kv_caches)
        self._layer_bytes: list[memoryview] | None = None

    def layer_bytes(self) -> list[memoryview] | None:
        """Each layer's paged tensor as one writable byte view (block ``b`` at ``b *
        block_numel * itemsize``), for reads straight into paged KV; None where a
        layer is not contiguous or not in CPU memory."""
        if self._layer_bytes is None:
            if self.device.type != "cpu" or not all(kv.is_contiguous() for kv in self.kv_caches):
                return None
            self._layer_bytes = [
                memoryview(kv.reshape(-1).view(torch.uint8).numpy()).cast("B") for kv in self.kv_caches
            ]
        return self._layer_bytes

    @property
    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V views ``[B, N, H, D]``."""
        return self._views

    @property
    def all_layers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of every layer as ``[L, B, N, H, D]`` views, or None (layers allocated apart)."""
        return self._all_layers

    def check_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` checked against this cache (1-D integers in range), on its device."""
        return _check_slots(slots, self.num_slots, self.device)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the tokens at ``slots`` from every layer into ``out`` ``[2, L, T, H * D]``."""
        slots = _check_slots(slots, self.num_slots, self.device)
        _check_buffer("out", out, self.shape.chunk_shape(slots.numel()), self.kv_caches[0])
        runs, rest = _block_runs(slots, self.shape.block_size)
        n_tok, heads, dim = self.shape.block_size, self.shape.num_kv_heads, self.shape.head_size
        kd, vd = self._kdims, self._vdims
        if self._all_layers is not None and runs:
            k_all, v_all = self._all_layers
            layers = self.shape.num_layers
            for block, tok, n in runs:
                tokens = slice(tok, tok + n * n_tok)
                out[0, :, tokens].view(layers, n, *kd).copy_(k_all[:, block : block + n])
                out[1, :, tokens].view(layers, n, *vd).copy_(v_all[:, block : block + n])
        else:
            for layer, (k, v) in enumerate(self._views):
                for block, tok, n in runs:
                    tokens = slice(tok, tok + n * n_tok)
                    out[0, layer, tokens].view(n, *kd).copy_(k[block : block + n])
                    out[1, layer, tokens].view(n, *vd).copy_(v[block : block + n])
        if rest is None:
            return
        if self._tiled:
            self._tokenwise(slots, rest, out, into_paged=False)
            return
        if not runs:
            self._gather_tokens(slots, out)
            return
        sub = torch.empty((2, self.shape.num_layers, rest.numel(), heads * dim), dtype=out.dtype, device=out.device)
        self._gather_tokens(slots[rest], sub)
        out[:, :, rest] = sub

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[2, L, T, H * D]`` into every layer at ``slots``."""
        slots = _check_slots(slots, self.num_slots, self.device)
        _check_buffer("src", src, self.shape.chunk_shape(slots.numel()), self.kv_caches[0])
        runs, rest = _block_runs(slots, self.shape.block_size)
        n_tok = self.shape.block_size
        kd, vd = self._kdims, self._vdims
        if self._all_layers is not None and runs:
            k_all, v_all = self._all_layers
            layers = self.shape.num_layers
            for block, tok, n in runs:
                tokens = slice(tok, tok + n * n_tok)
                k_all[:, block : block + n].copy_(src[0, :, tokens].view(layers, n, *kd))
                v_all[:, block : block + n].copy_(src[1, :, tokens].view(layers, n, *vd))
        else:
            for layer, (k, v) in enumerate(self._views):
                for block, tok, n in runs:
                    tokens = slice(tok, tok + n * n_tok)
                    k[block : block + n].copy_(src[0, layer, tokens].view(n, *kd))
                    v[block : block + n].copy_(src[1, layer, tokens].view(n, *vd))
        if rest is None:
            return
        if self._tiled:
            self._tokenwise(slots, rest, src, into_paged=True)
            return
        if runs:
            slots, src = slots[rest], src[:, :, rest]
        for layer, kv, plan in _plans(self.layout, self.kv_caches, slots, self.shape.block_size):
            _scatter_side(kv, plan.k, src[0, layer])
            _scatter_side(kv, plan.v, src[1, layer])

    def _tokenwise(self, slots: torch.Tensor, rest: torch.Tensor, buf: torch.Tensor, into_paged: bool) -> None:
        """Copy the tokens at positions ``rest`` of ``slots`` one by one, per layer and K/V,
        between ``buf`` ``[2, L, T, H * D]`` and a tiled layout (a partial block at either end;
        an element plan cannot describe tiles). At most a block per end, so this stays small."""
        n_tok = self.shape.block_size
        picks = []
        for side, dims in ((0, self._kdims), (1, self._vdims)):
            # The leading dims of a block's view that split its token offset, e.g. (N/16, 16).
            count, split = 1, 0
            while count < n_tok:
                count *= dims[split]
                split += 1
            picks.append((side, dims[:split], dims[split:]))
        s = slots.tolist()
        for i in rest.tolist():
            block, offset = divmod(s[i], n_tok)
            for side, tok_dims, row_dims in picks:
                # The token's index in the block's view: the same in every layer.
                index, rem = [], offset
                for size in reversed(tok_dims):
                    rem, r = divmod(rem, size)
                    index.append(r)
                at = (block, *reversed(index))
                for layer, views in enumerate(self._views):
                    paged = views[side][at]
                    row = buf[side, layer, i].view(row_dims)
                    if into_paged:
                        paged.copy_(row)
                    else:
                        row.copy_(paged)

    def _gather_tokens(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        for layer, kv, plan in _plans(self.layout, self.kv_caches, slots, self.shape.block_size):
            _gather_side(kv, plan.k, out[0, layer])
            _gather_side(kv, plan.v, out[1, layer])


def _stacked_views(views: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V of every layer as ``[L, B, N, H, D]`` views (no copy), or None where the
    layers are not equally strided views of one storage at one layer stride, or where
    such a view would address an element twice: then each layer is copied on its own."""
    k = _stack([k for k, _ in views])
    v = _stack([v for _, v in views])
    return None if k is None or v is None else (k, v)


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Equally strided, equally shaped views of one storage at one positive step, as one
    ``[L, ...]`` view (no copy); None otherwise, or where it would address an element twice."""
    if len(tensors) < 2:
        return None
    t0 = tensors[0]
    storage = t0.untyped_storage().data_ptr()
    step = tensors[1].storage_offset() - t0.storage_offset()
    if step <= 0:
        return None
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != storage or t.stride() != t0.stride() or t.shape != t0.shape
                or t.storage_offset() - t0.storage_offset() != i * step):
            return None
    view = t0.as_strided((len(tensors), *t0.shape), (step, *t0.stride()), t0.storage_offset())
    return view if _distinct_addresses(view) else None


def _distinct_addresses(view: torch.Tensor) -> bool:
    """Whether no two elements of ``view`` share an address: sorted by stride, each
    stride must pass the span of the dims inside it (sufficient, and true of every
    layout vLLM allocates)."""
    span = 1
    for size, stride in sorted(((sz, st) for sz, st in zip(view.shape, view.stride(), strict=True) if sz > 1),
                               key=lambda d: d[1]):
        if stride < span:
            return False
        span = stride * (size - 1) + span
    return True


def _num_slots(layout: PagedLayout, kv: torch.Tensor) -> int:
    blocks, _, tokens, _ = layout.kv_shape(kv)
    return blocks * tokens


def _plans(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, block_size: int
) -> Iterator[tuple[int, torch.Tensor, _Plan]]:
    """Yield ``(layer, tensor, plan)``; layers of one shape and strides share a plan."""
    cache: dict[tuple[tuple[int, ...], tuple[int, ...]], _Plan] = {}
    for layer, kv in enumerate(kv_caches):
        key = (tuple(kv.shape), kv.stride())
        plan = cache.get(key)
        if plan is None:
            plan = cache[key] = layout._plan(kv, slots, block_size)
        yield layer, kv, plan
