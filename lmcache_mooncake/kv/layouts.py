"""How each attention backend lays out vLLM's paged KV cache: K and V of a layer as views.

This is the only module that knows a backend's paged layout. Everything else
sees chunk buffers in LMCache's ``KV_2LTD`` format (``[2, L, T, H * D]``, see
:mod:`lmcache_mooncake.kv.paged_copy`).

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
follow its strides, so any of these orders works. How each backend
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

Shapes and their checks are in :mod:`lmcache_mooncake.kv.shape`, the CPU kernel
resolution in :mod:`lmcache_mooncake.kv.cpu_isa`, and the copies that follow
these views in :mod:`lmcache_mooncake.kv.paged_copy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from lmcache_mooncake.chunks.keys import BLOCKS, TOKENS
from lmcache_mooncake.kv import cpu_isa
from lmcache_mooncake.kv.paged_copy import PagedKV, gather_layer, scatter_layer
from lmcache_mooncake.kv.shape import check_block_size, check_head_width, check_layer_tensor

__all__ = [
    "GPU_BACKENDS",
    "SUPPORTED_BACKENDS",
    "CpuAttnLayout",
    "GpuPagedLayout",
    "PagedLayout",
    "chunk_layout_for",
    "layout_for_backend",
]

GPU_BACKENDS: tuple[str, ...] = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
SUPPORTED_BACKENDS: tuple[str, ...] = ("CPU_ATTN", *GPU_BACKENDS)


# -- layouts --------------------------------------------------------------------


class PagedLayout(ABC):
    """One attention backend's per-layer paged KV layout.

    Subclasses describe the layout (``kv_shape`` validates a tensor,
    ``kv_views`` exposes K and V as ``[B, N, H, D]`` views); ``gather`` and
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
        kernel blocks (see :mod:`lmcache_mooncake.kv.shape`); slots are the same either way.
        """

    @abstractmethod
    def kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        gather_layer(self, kv_layer, slots, out)

    def scatter(self, kv_layer: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[2, T, H * D]`` (K, V) into one layer at ``slots``.

        The inverse of :meth:`gather`: afterwards gathering ``slots`` returns
        ``src`` bit for bit. Every other element of ``kv_layer``'s storage is
        left untouched. Same argument rules as :meth:`gather`; ``src`` may have
        any strides.
        """
        scatter_layer(self, kv_layer, slots, src)


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
    SUPPORTED_ISAS: ClassVar[tuple[str, ...]] = cpu_isa.SUPPORTED_ISAS
    _EXPECTED: ClassVar[str] = "[num_blocks, num_kv_heads, block_size, 2 * head_size]"

    def __init__(self, isa: str | None = None) -> None:
        if isa is not None:
            cpu_isa.check_isa(isa)
        self.isa = isa

    def __repr__(self) -> str:
        return f"CpuAttnLayout(isa={self.isa!r})"

    def kv_shape(self, kv_layer: torch.Tensor, block_size: int | None = None) -> tuple[int, int, int, int]:
        check_layer_tensor(self.name, kv_layer, 4, self._EXPECTED)
        blocks, heads, tokens, width = kv_layer.shape
        head_size = check_head_width(self.name, kv_layer)
        check_block_size(self.name, tokens, block_size)
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
        isa = cpu_isa.vllm_cpu_isa(kv_layer.dtype, tokens, width // 2)
        cpu_isa.check_isa(isa)
        return isa

    def kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        check_layer_tensor(self.name, kv_layer, 4, self._EXPECTED)
        blocks, heads, tokens, _ = kv_layer.shape
        head_size = check_head_width(self.name, kv_layer)
        check_block_size(self.name, tokens, block_size)
        return blocks, heads, tokens, head_size

    def kv_views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's own split: (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)).
        key_cache, value_cache = kv_layer.transpose(1, 2).split(kv_layer.shape[-1] // 2, dim=-1)
        return key_cache, value_cache


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
