"""Chunks kept in the backend's own block layout (chunk layout ``"blocks"``), and their copies.

A chunk buffer is LMCache's ``[2, L, T, H * D]`` tensor whatever its layout
(LMCache sizes, stores and moves it as that). In the ``"tokens"`` chunk layout
its bytes mean what the shape says (:mod:`lmcache_mooncake.kv.layouts`). In the
``"blocks"`` layout the same buffer holds, for a chunk of ``T = n * N + r``
tokens (``N`` the block size):

- first, the ``n`` whole blocks of every layer exactly as the paged tensor
  stores them: ``[L, n, *block]``, where ``block`` is one layer's block
  (``[H, N, 2 * D]`` for ``CPU_ATTN``, K column-major per head as the kernel
  keeps it);
- then the last ``r`` tokens (a partial block) token-major, ``[2, L, r, H * D]``.

So a whole block moves between paged KV and a chunk with a plain memory copy
(one per run of consecutive blocks, for all layers at once when vLLM keeps the
layers in one allocation), instead of the transposing copy the ``"tokens"``
layout needs for ``CPU_ATTN``'s column-major K, and a scatter of whole blocks
runs at about the speed of a plain copy of the same bytes. ``benchmarks/layout_copy.py``
times it against that copy (rows ``(chunk as blocks)``, ``--threads``), and
``benchmarks/tier_load.py`` a whole tier load against memcpy. Tokens of a block that a copy covers only
in part (a load that ends inside a block) move through the layout's K/V views.

The bytes depend on the backend's layout, so the chunk layout is part of the
key namespace (:attr:`lmcache_mooncake.chunks.keys.KeyNamespace.chunk_layout`): a
reader with another layout finds nothing rather than misreading. Only layouts
whose :meth:`~lmcache_mooncake.kv.layouts.PagedLayout.chunk_layout` says
``"blocks"`` use it (``CPU_ATTN`` with the ``vec``/``vec16`` kernels, when the
chunk size is a multiple of the block size); GPU layouts keep ``"tokens"``,
where a block's K and V rows are already contiguous per token.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lmcache_mooncake.kv.paged_copy import PagedKV


def _parts(paged: PagedKV, buf: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(n, blocks, tail)``: the whole-block part ``[L, n, *block]`` and the token-major tail
    ``[2, L, r, H * D]`` of a chunk buffer ``[2, L, T, H * D]`` (views of its memory)."""
    shape = paged.shape
    hidden = shape.num_kv_heads * shape.head_size
    if buf.dim() != 4 or tuple(buf.shape[:2]) != (2, shape.num_layers) or buf.shape[3] != hidden:
        raise ValueError(f"chunk buffer must be [2, {shape.num_layers}, T, {hidden}], got {tuple(buf.shape)}")
    if buf.dtype != shape.dtype or not buf.is_contiguous():
        raise ValueError(f"chunk buffer must be a contiguous {shape.dtype} tensor (got {buf.dtype}, "
                         f"contiguous={buf.is_contiguous()})")
    tokens, n_tok = buf.shape[2], shape.block_size
    n = tokens // n_tok
    flat = buf.view(-1)
    cut = shape.num_layers * n * paged.block_numel
    blocks = flat[:cut].view(shape.num_layers, n, *paged.block_shape)
    tail = flat[cut:].view(2, shape.num_layers, tokens - n * n_tok, hidden)
    return n, blocks, tail


def _block_kv_views(paged: PagedKV, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk's whole-block part as ``[L, n, N, H, D]`` views (the layout's views)."""
    layers, n = blocks.shape[:2]
    k, v = paged.layout.kv_views(blocks.view(layers * n, *paged.block_shape))
    return k.unflatten(0, (layers, n)), v.unflatten(0, (layers, n))


def _runs(slots: list[int], lo: int, hi: int, n_tok: int) -> Iterator[tuple[int, int, int]]:
    """``(chunk_block, paged_block, count)`` runs of the chunk's blocks wholly inside ``[lo, hi)``
    whose slots are one whole paged block each, consecutive chunk blocks on consecutive paged blocks."""
    run: list[int] | None = None
    for j in range(-(-lo // n_tok), hi // n_tok):
        first = slots[j * n_tok]
        whole = first % n_tok == 0 and slots[j * n_tok : (j + 1) * n_tok] == list(range(first, first + n_tok))
        if whole and run is not None and run[0] + run[2] == j and run[1] + run[2] == first // n_tok:
            run[2] += 1
            continue
        if run is not None:
            yield run[0], run[1], run[2]
            run = None
        if whole:
            run = [j, first // n_tok, 1]
    if run is not None:
        yield run[0], run[1], run[2]


def gather(paged: PagedKV, slots: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the tokens at ``slots`` (one per chunk token, in order) from paged KV into the
    ``"blocks"`` chunk buffer ``out`` ``[2, L, T, H * D]``."""
    copy(paged, slots, out, 0, out.shape[2], into_paged=False)


def scatter(paged: PagedKV, slots: torch.Tensor, src: torch.Tensor, lo: int, hi: int, runs: bool = True) -> None:
    """Write tokens ``[lo, hi)`` of the ``"blocks"`` chunk buffer ``src`` into paged KV at their
    slots (``slots[t]`` is chunk token ``t``'s; at least ``hi`` of them). Nothing else changes.
    ``runs=False``: not the runs of whole blocks (already in place, see :func:`read_targets`)."""
    copy(paged, slots, src, lo, hi, into_paged=True, runs=runs)


def read_targets(paged: PagedKV, slots: list[int], tokens: int, scratch: memoryview, lo: int,
                 hi: int) -> tuple[list[memoryview], bool] | None:
    """Where to read a ``tokens``-token ``"blocks"`` chunk's payload so that a load of its tokens
    ``[lo, hi)`` copies most of it once: ``(targets, rest)``, byte views in payload order
    covering the whole payload, and whether anything is left to move afterwards.

    The whole blocks that :func:`scatter` would copy as runs are views of paged KV
    itself; every other byte (blocks a load covers in part, blocks outside
    ``[lo, hi)``, the token-major tail) is a view of ``scratch`` (at least the payload's
    size; a ``[2, L, tokens, H * D]`` buffer's bytes) at the byte's own offset. Once the
    payload is read into them, and checked, ``rest`` says whether
    ``scatter(paged, slots, buf, lo, hi, runs=False)`` must move the rest. ``slots``: chunk
    token ``t``'s slot at ``slots[t]``, at least ``hi`` of them. Plain Python on purpose:
    this runs once per chunk of every direct load. None where paged KV cannot be read into
    (a layer not contiguous, not in CPU memory)."""
    layers = paged.layer_bytes()
    if layers is None:
        return None
    shape = paged.shape
    n_tok = shape.block_size
    if not 0 <= lo <= hi <= tokens or len(slots) < hi:
        raise ValueError(f"tokens [{lo}, {hi}) of a {tokens}-token chunk need {hi} slots, got {len(slots)}")
    n = tokens // n_tok
    itemsize = shape.dtype.itemsize
    payload = 2 * shape.num_layers * tokens * shape.num_kv_heads * shape.head_size * itemsize
    if len(scratch) < payload:
        raise ValueError(f"scratch holds {len(scratch)} bytes, the chunk's payload is {payload}")
    split = min(hi, n * n_tok)
    runs = list(_runs(slots, lo, split, n_tok)) if lo < split else []
    num_blocks = paged.num_slots // n_tok
    for _, b, count in runs:
        if b < 0 or b + count > num_blocks:
            raise ValueError(f"slots name blocks {b}..{b + count - 1}; paged KV has {num_blocks}")
    block_bytes = paged.block_numel * itemsize
    views: list[memoryview] = []
    pos = 0
    for layer, paged_bytes in enumerate(layers):
        base = layer * n * block_bytes
        for j, b, count in runs:
            if base + j * block_bytes > pos:
                views.append(scratch[pos : base + j * block_bytes])
            views.append(paged_bytes[b * block_bytes : (b + count) * block_bytes])
            pos = base + (j + count) * block_bytes
    if payload > pos:
        views.append(scratch[pos:payload])
    covered = sum(count for _, _, count in runs) * n_tok
    return views, hi > split or split - lo > covered


def copy(paged: PagedKV, slots: torch.Tensor, buf: torch.Tensor, lo: int, hi: int, into_paged: bool,
         runs: bool = True) -> None:
    """Move chunk tokens ``[lo, hi)`` between paged KV and a ``"blocks"`` chunk buffer
    (``runs=False``: all but the runs of whole blocks, which :func:`read_targets` put in place)."""
    n, blocks, tail = _parts(paged, buf)
    tokens, n_tok = buf.shape[2], paged.shape.block_size
    if not 0 <= lo <= hi <= tokens or slots.dim() != 1 or slots.numel() < hi:
        raise ValueError(f"tokens [{lo}, {hi}) of a {tokens}-token chunk need {hi} slots, got {tuple(slots.shape)}")
    slots = paged.check_slots(slots[:hi])
    s = slots.tolist()
    split = min(hi, n * n_tok)
    covered: set[int] = set()
    if lo < split:
        raw = paged.raw_all
        for j, b, count in _runs(s, lo, split, n_tok):
            covered.update(range(j, j + count))
            if not runs:
                continue
            if raw is not None:
                pairs = [(raw[:, b : b + count], blocks[:, j : j + count])]
            else:
                pairs = [(kv[b : b + count], blocks[layer, j : j + count])
                         for layer, kv in enumerate(paged.kv_caches)]
            for dst_paged, chunk in pairs:
                if into_paged:
                    dst_paged.copy_(chunk)
                else:
                    chunk.copy_(dst_paged)
        rest = [t for t in range(lo, split) if t // n_tok not in covered]
        if rest:
            _tokens(paged, blocks, s, rest, into_paged)
    if hi > split:
        a = max(lo, n * n_tok)
        part = tail[:, :, a - n * n_tok : hi - n * n_tok]
        if into_paged:
            paged.scatter(slots[a:hi], part)
        else:
            paged.gather(slots[a:hi], part)


def _tokens(paged: PagedKV, blocks: torch.Tensor, s: list[int], rest: list[int], into_paged: bool) -> None:
    """Move single tokens of the whole-block part (a block a copy covers in part) through the
    layout's K/V views: one indexed copy per K/V for all layers, or per layer."""
    n_tok = paged.shape.block_size
    ck, cv = _block_kv_views(paged, blocks)
    j = torch.tensor([t // n_tok for t in rest])
    o = torch.tensor([t % n_tok for t in rest])
    b = torch.tensor([s[t] // n_tok for t in rest])
    p = torch.tensor([s[t] % n_tok for t in rest])
    sides = [(paged.all_layers[0], ck), (paged.all_layers[1], cv)] if paged.all_layers is not None else [
        (view, chunk_side[layer]) for layer, views in enumerate(paged.views)
        for view, chunk_side in zip(views, (ck, cv), strict=True)
    ]
    for paged_side, chunk_side in sides:
        if paged_side.dim() == 5:  # [L, B, N, H, D] and [L, n, N, H, D]
            if into_paged:
                paged_side[:, b, p] = chunk_side[:, j, o]
            else:
                chunk_side[:, j, o] = paged_side[:, b, p]
        elif into_paged:  # one layer: [B, N, H, D] and [n, N, H, D]
            paged_side[b, p] = chunk_side[j, o]
        else:
            chunk_side[j, o] = paged_side[b, p]
