"""The copies between paged KV and chunk buffers, for any layout's K/V views.

:mod:`lmcache_mooncake.kv.layouts` says where a layout keeps K and V (strided
``[B, N, H, D]`` views of a layer's tensor); this module moves the bytes.
Chunk buffers are LMCache's ``KV_2LTD`` format: for a chunk of ``T`` tokens
over ``L`` layers, a ``[2, L, T, H * D]`` tensor (``[0]`` = K, ``[1]`` = V;
``H`` KV heads of ``D`` elements, head-major within a token). Per layer that
is a ``[2, T, H * D]`` slice.

- :class:`PagedKV` validates a model's layers once for many chunk copies.
  Whole blocks of a chunk (:func:`_block_runs`: runs of whole, consecutive
  blocks) move with one strided copy per run and K/V, for all layers at once
  when vLLM keeps them in one allocation.
- Single tokens (a partial block at either end, or random slots): from the
  views' strides we compute, once per chunk, the storage offsets of each
  token's K and V in the largest contiguous unit the layout allows (a whole
  ``H * D`` token row, one ``D`` head row, or single elements; in the GPU
  layout K and V alternate every ``D`` elements, so it is a head row unless
  padding misaligns it; :func:`_side`), and move data with one
  ``index_select(..., out=...)`` (gather) or ``index_copy_`` (scatter) per
  layer and per K/V. No per-token Python loops and no intermediate
  chunk-sized copies when the buffers are contiguous. Layers sharing shape
  and strides (all of vLLM's, in every physical order) share the offsets.
  Tiled layouts (AMX) move such tokens one by one instead: an element plan
  cannot describe tiles.

Slots must be distinct and within ``[0, B * N)``. Duplicate slots are not
expected (vLLM never maps two tokens to one slot): gather would just copy the
token twice, but scatter would leave one of the writers' data in the slot,
unspecified which. vLLM's padding slot ``-1`` must be stripped by the caller.
Out-of-range slots raise ``ValueError`` when ``slots`` is a CPU tensor; for
device tensors the check would need a host sync, so it is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmcache_mooncake.kv.shape import infer_kv_shape

if TYPE_CHECKING:
    from lmcache_mooncake.kv.layouts import PagedLayout

__all__ = ["PagedKV", "gather_chunk", "gather_layer", "scatter_chunk", "scatter_layer"]


@dataclass(frozen=True)
class _Side:
    """Where K (or V) of each token lives in one layer's storage.

    ``rows`` indexes :func:`_rows` of the layer (its storage from its storage
    offset on, as ``unit``-element rows); ``rows[i]`` is the ``i``-th
    ``unit``-element piece of the ``[T, H * D]`` K (or V) buffer, in order.
    """

    rows: torch.Tensor
    unit: int


@dataclass(frozen=True)
class _Plan:
    k: _Side
    v: _Side


def _span(t: torch.Tensor) -> int:
    """Number of storage elements from ``t``'s storage offset to its last element."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _side(view: torch.Tensor, rel_base: int, blocks: torch.Tensor, offsets: torch.Tensor) -> _Side:
    """Offsets of the tokens ``(blocks[i], offsets[i])`` of a ``[B, N, H, D]`` view.

    ``rel_base``: the view's storage offset minus its layer tensor's.
    """
    _, _, heads, dim = view.shape
    s_block, s_off, s_head, s_dim = view.stride()
    # Strides of size-1 dims carry no information (and torch may set them to
    # anything); normalise them so they don't block the contiguous-unit paths.
    if dim == 1:
        s_dim = 1
    if heads == 1:
        s_head = dim * s_dim
    # Largest piece of a token's [H, D] that is contiguous in storage and
    # aligned to its own size from the layer's storage offset, so storage can
    # be viewed as rows of that size.
    unit = 1
    for cand, contiguous, strides in (
        (heads * dim, s_dim == 1 and s_head == dim, (rel_base, s_block, s_off)),
        (dim, s_dim == 1, (rel_base, s_block, s_off, s_head)),
    ):
        if contiguous and all(s % cand == 0 for s in strides):
            unit = cand
            break
    dev = blocks.device
    token_start = rel_base + blocks * s_block + offsets * s_off  # [T]
    if unit == heads * dim:
        starts = token_start
    elif unit == dim:
        starts = token_start[:, None] + torch.arange(heads, device=dev) * s_head
    else:
        starts = (
            token_start[:, None, None]
            + (torch.arange(heads, device=dev) * s_head)[:, None]
            + torch.arange(dim, device=dev) * s_dim
        )
    return _Side(rows=(starts.reshape(-1) // unit), unit=unit)


def _rows(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``t``'s storage from its storage offset on, as rows of ``unit`` elements (no copy).

    Single elements get a 1-D view: index_select/index_copy_ on ``[n, 1]``
    rows take a per-row copy path that is several times slower.
    """
    span = _span(t)
    if unit == 1:
        return t.as_strided((span,), (1,))
    return t.as_strided((span // unit, unit), (unit, 1))


def _gather_side(kv: torch.Tensor, side: _Side, dst: torch.Tensor) -> None:
    rows = _rows(kv, side.unit)
    if dst.is_contiguous():
        torch.index_select(rows, 0, side.rows, out=dst.view(-1, *rows.shape[1:]))
    else:
        # Only reached for strided output buffers; a temporary is unavoidable.
        dst.copy_(torch.index_select(rows, 0, side.rows).view(dst.shape))


def _scatter_side(kv: torch.Tensor, side: _Side, src: torch.Tensor) -> None:
    rows = _rows(kv, side.unit)
    # reshape() copies only if src's [T, H*D] isn't already row-contiguous.
    rows.index_copy_(0, side.rows, src.reshape(-1, *rows.shape[1:]))


def _block_runs(slots: torch.Tensor, block_size: int) -> tuple[list[tuple[int, int, int]], torch.Tensor | None]:
    """Split a chunk's slots into runs of whole blocks and the tokens left over.

    Returns ``(runs, rest)``: each run ``(first_block, first_token, num_blocks)``
    says that tokens ``[first_token, first_token + num_blocks * block_size)``
    fill blocks ``first_block ..`` completely and in order, so they move with
    one strided copy per run, layer and K/V (a transpose where the layout
    stores K column-major), never element by element. ``rest``: indices of the
    other tokens (a partial first or last block), or None. Whole blocks are
    what a chunk is in vLLM (chunks are a multiple of the block size); the
    remainder is at most a block at each end.
    """
    n = slots.numel()
    if n < block_size or slots.device.type != "cpu":
        return [], (torch.arange(n, device=slots.device) if n else None)
    s = slots.tolist()
    runs: list[tuple[int, int, int]] = []
    rest: list[int] = []
    i = 0
    while i < n:
        first = s[i]
        if first % block_size == 0 and i + block_size <= n and s[i + block_size - 1] == first + block_size - 1 \
                and s[i : i + block_size] == list(range(first, first + block_size)):
            block = first // block_size
            if runs and runs[-1][0] + runs[-1][2] == block and runs[-1][1] + runs[-1][2] * block_size == i:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((block, i, 1))
            i += block_size
        else:
            rest.append(i)
            i += 1
    return runs, (torch.tensor(rest, dtype=torch.long) if rest else None)


# -- argument checks --------------------------------------------------------------


def _check_slots(slots: torch.Tensor, num_slots: int, device: torch.device) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D tensor, got {getattr(slots, 'shape', type(slots).__name__)}")
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise ValueError(f"slots must be an integer tensor, got {slots.dtype}")
    if slots.device.type == "cpu" and slots.numel() > 0:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slots must be in [0, {num_slots}), got values in [{lo}, {hi}]")
    return slots.to(device=device, dtype=torch.int64, non_blocking=True)


def _check_buffer(what: str, buf: torch.Tensor, shape: Sequence[int], kv: torch.Tensor) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(buf.shape)}")
    if buf.dtype != kv.dtype:
        raise ValueError(f"{what} dtype {buf.dtype} differs from the KV cache's {kv.dtype}")
    if buf.device != kv.device:
        raise ValueError(f"{what} is on {buf.device} but the KV cache is on {kv.device}")


# -- one layer ------------------------------------------------------------------------


def gather_layer(layout: PagedLayout, kv_layer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """:meth:`PagedLayout.gather <lmcache_mooncake.kv.layouts.PagedLayout.gather>` through an element plan."""
    plan = _checked_plan(layout, kv_layer, slots, "out", out)
    _gather_side(kv_layer, plan.k, out[0])
    _gather_side(kv_layer, plan.v, out[1])


def scatter_layer(layout: PagedLayout, kv_layer: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """:meth:`PagedLayout.scatter <lmcache_mooncake.kv.layouts.PagedLayout.scatter>` through an element plan."""
    plan = _checked_plan(layout, kv_layer, slots, "src", src)
    _scatter_side(kv_layer, plan.k, src[0])
    _scatter_side(kv_layer, plan.v, src[1])


def _checked_plan(layout: PagedLayout, kv_layer: torch.Tensor, slots: torch.Tensor, what: str,
                  buf: torch.Tensor) -> _Plan:
    """The plan of one layer's copy, after checking its slots and its ``[2, T, H * D]`` buffer."""
    shape = layout.kv_shape(kv_layer)
    slots = _check_slots(slots, shape[0] * shape[2], kv_layer.device)
    _check_buffer(what, buf, (2, slots.numel(), shape[1] * shape[3]), kv_layer)
    return _layer_plan(layout, kv_layer, slots, shape[2])


def _layer_plan(layout: PagedLayout, kv_layer: torch.Tensor, slots: torch.Tensor, block_size: int) -> _Plan:
    """Row indices of ``slots`` for a layer; depends only on the layer's shape and strides."""
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    k, v = layout.kv_views(kv_layer)
    base = kv_layer.storage_offset()
    return _Plan(
        k=_side(k, k.storage_offset() - base, blocks, offsets),
        v=_side(v, v.storage_offset() - base, blocks, offsets),
    )


# -- whole chunks ---------------------------------------------------------------


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
        self._views = [layout.kv_views(kv) for kv in self.kv_caches]
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
        heads, dim = self.shape.num_kv_heads, self.shape.head_size
        self._copy_runs(runs, out, into_paged=False)
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
        self._copy_runs(runs, src, into_paged=True)
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

    def _copy_runs(self, runs: list[tuple[int, int, int]], buf: torch.Tensor, into_paged: bool) -> None:
        """Move the runs of whole blocks (:func:`_block_runs`) between ``buf`` ``[2, L, T, H * D]``
        and paged KV: one strided copy per run and K/V, for all layers at once where they are
        views of one allocation (:attr:`all_layers`), else per layer."""
        if not runs:
            return
        n_tok = self.shape.block_size
        if self._all_layers is not None:
            groups: list[tuple[int | slice, tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]] = [
                (slice(None), self._all_layers, (self.shape.num_layers,))]
        else:
            groups = [(layer, views, ()) for layer, views in enumerate(self._views)]
        for layer, (k, v), lead in groups:
            for block, tok, n in runs:
                tokens = slice(tok, tok + n * n_tok)
                for side, paged_side, dims in ((0, k, self._kdims), (1, v, self._vdims)):
                    chunk = buf[side, layer, tokens].view(*lead, n, *dims)
                    paged = paged_side.narrow(len(lead), block, n)
                    if into_paged:
                        paged.copy_(chunk)
                    else:
                        chunk.copy_(paged)

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
            plan = cache[key] = _layer_plan(layout, kv, slots, block_size)
        yield layer, kv, plan
