"""The copy engine between paged KV and chunk buffers, for any layout's K/V views.

:mod:`lmcache_mooncake.kv.layouts` says where a layout keeps K and V (strided
``[B, N, H, D]`` views of a layer's tensor); this module moves the bytes:

- whole blocks: :func:`_block_runs` finds the runs of whole, consecutive
  blocks of a chunk, which move with one strided copy per run, layer and K/V;
- single tokens (a partial block at either end, or random slots): the storage
  offsets of each token's K and V in the largest contiguous unit the layout
  allows (:func:`_side`), moved with one ``index_select`` / ``index_copy_``
  per layer and K/V;
- argument checks shared by every copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
