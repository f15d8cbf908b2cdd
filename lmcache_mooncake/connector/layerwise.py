"""Layer-wise save and load (config ``layerwise: true``): KV moves one layer at a time, as
vLLM's attention layers run, instead of all layers once per step.

What it does
------------
Save: the step that computes a prompt's last token has its save planned
(:class:`~lmcache_mooncake.connector.metadata.SaveOp`). :meth:`LayerwiseSaver.begin`
(from the step's first ``save_kv_layer``: vLLM calls ``start_load_kv`` after the
forward pass when the step has no synchronous load) picks the paged blocks those
tokens sit in; ``save_kv_layer(layer)`` (vLLM calls it as each attention layer
returns) copies that layer's blocks out into a host staging copy (on CUDA: a
gather on the device and one asynchronous copy to pinned memory on the
device-to-host stream, so it overlaps the next layers' compute); ``wait_for_save``
waits for the copies and hands the staging copy to LMCache's ``store``, which cuts
it into chunks exactly as it would cut paged KV (the staging copy *is* a paged KV
tensor per layer, of the same layout, holding only those blocks).

Load (synchronous loads only: ``layerwise`` turns asynchronous loading off, since an
asynchronous load's request is not in the step): :meth:`LayerwiseLoader.begin`
reads the planned chunks from the tiers into a host staging copy of the request's
blocks (LMCache's ``retrieve`` or the direct disk/store path, the same code as
whole-prompt loads, writing into the staging copy instead of paged KV), then
queues the copy of every layer's blocks to the device on the host-to-device
stream; ``wait_for_layer_load(layer)`` makes the compute stream wait for that
layer's copy only, so layer ``l``'s attention runs while layers ``l + 1 ...`` are
still on their way. On vLLM's CPU build there are no streams: each hook does its
layer's copy when called (:mod:`lmcache_mooncake.kv.device_copy`).

Blocks, not tokens, are staged: a layer's copy is one ``index_select`` /
``index_copy_`` over whole blocks of its tensor, whatever the backend's layout
(every supported layout is ``[num_blocks, ...]`` in its first dimension). A load
writes back whole blocks only where every token is loaded, and the tokens of its
first and last, partly loaded blocks one by one: by the time vLLM waits for a
layer, that layer's KV update of the step has already written the step's new
tokens (the free tail of the last block), and a whole-block copy would undo it.

Contract
--------
Who calls: :class:`~lmcache_mooncake.connector.worker.WorkerSide`, on vLLM's
worker process and its main thread, once per step: the loader's ``begin`` from
``start_load_kv`` (vLLM calls it before the forward pass when a step has a
synchronous load), the saver's from the first ``save_kv_layer``; per layer from
the hooks in layer order; ``finish`` from ``wait_for_save``. A layer whose hook never came (vLLM skipped the
hooks) is handled in ``finish``: the saver reports it and the worker saves from
paged KV as in whole-prompt mode (still correct: paged KV holds the step's KV
then); the loader reports the blocks of an unloaded layer as failed, so vLLM
recomputes them. Staging memory is allocated once per worker and direction and
reused (grown when a step needs more); it is pinned on CUDA.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_mooncake.kv import device_copy
from lmcache_mooncake.kv.device_copy import CopyHandle, DeviceCopier
from lmcache_mooncake.kv.layouts import PagedLayout

logger = logging.getLogger(__name__)


class StagingPool:
    """One growing host buffer (pinned when the KV is on CUDA), carved into per-layer
    staging tensors shaped like the paged layers with fewer blocks."""

    def __init__(self, pin: bool, what: str) -> None:
        self.pin = pin
        self.what = what
        self._buf: torch.Tensor | None = None

    def layers(self, like: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
        """Contiguous host tensors ``[num_blocks, *like[l].shape[1:]]`` of ``like[l]``'s dtype,
        one per layer, in this pool's buffer (valid until the next call)."""
        shapes = [(num_blocks, *t.shape[1:]) for t in like]
        sizes = [_nbytes(s, t.dtype) for s, t in zip(shapes, like, strict=True)]
        total = sum(-(-n // 64) * 64 for n in sizes)
        if self._buf is None or self._buf.numel() < total:
            grown = max(total, 2 * self._buf.numel()) if self._buf is not None else total
            logger.info("layer-wise %s staging: %.1f MiB of host memory%s", self.what, grown / 2**20,
                        " (pinned)" if self.pin else "")
            self._buf = torch.empty(grown, dtype=torch.uint8, pin_memory=self.pin)
        out, at = [], 0
        for shape, t, n in zip(shapes, like, sizes, strict=True):
            out.append(self._buf[at : at + n].view(t.dtype).view(shape))
            at += -(-n // 64) * 64
        return out


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


@dataclass
class BlockMap:
    """The paged blocks some slots fall in, numbered in staging order.

    ``blocks``: their indices in the paged tensors (sorted, distinct, CPU int64);
    :meth:`remap` turns paged slots into slots of the staging copy."""

    blocks: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, slots: Sequence[torch.Tensor], block_size: int) -> BlockMap:
        every = torch.cat([s.to(torch.int64) for s in slots]) if slots else torch.empty(0, dtype=torch.int64)
        return cls(torch.unique(every // block_size), block_size)

    def remap(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` (each in one of :attr:`blocks`) as slots of the staging copy."""
        blocks = slots // self.block_size
        at = torch.searchsorted(self.blocks, blocks)
        if len(blocks) and (at.max() >= len(self.blocks) or not torch.equal(self.blocks[at], blocks)):
            raise ValueError("a slot outside the staged blocks")
        return at * self.block_size + slots % self.block_size

    def positions(self, blocks: torch.Tensor) -> torch.Tensor:
        """Where each of ``blocks`` (a subset of :attr:`blocks`) sits in the staging copy."""
        return torch.searchsorted(self.blocks, blocks)


@dataclass
class StagedSave:
    """One planned save as the worker stores it: its staged tokens' slots, or ``None`` when
    it must be saved from paged KV (``kv_caches`` is then ``None`` too)."""

    kv_caches: list[torch.Tensor] | None
    slots: torch.Tensor | None


def _full_slots(n: int, lo: int, staged: torch.Tensor) -> torch.Tensor:
    """A slot per token of ``[0, n)``: ``staged`` for ``[lo, n)``, 0 before (never read)."""
    out = torch.zeros(n, dtype=torch.int64)
    out[lo:] = staged
    return out


@dataclass
class _Step:
    map: BlockMap
    staged: list[torch.Tensor]
    device_blocks: torch.Tensor | None  # map.blocks on the KV's device (the saver's); None for the loader
    handles: dict[int, CopyHandle] = field(default_factory=dict)


class LayerwiseSaver:
    """Copies each layer's to-be-saved blocks out as the layer finishes (see the module docstring)."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size  # the tensors' own (kernel) block size: slot // it is the block
        self.copier: DeviceCopier = device_copy.for_device(kv_caches[0].device)
        self.pool = StagingPool(self.copier.is_cuda, "save")
        self._step: _Step | None = None
        self._slots: list[torch.Tensor] = []
        self._skips: list[int] = []
        #: The step (its metadata object) :meth:`begin` staged; None after :meth:`finish`.
        self.step_of: object | None = None

    def begin(self, slot_lists: list[list[int]], skips: list[int], step: object = None) -> None:
        """Stage the blocks of tokens ``[skip, len(slots))`` of each planned save of ``step``."""
        self._step, self.step_of = None, step
        if not slot_lists:
            return
        self._slots = [torch.tensor(s, dtype=torch.int64) for s in slot_lists]
        self._skips = list(skips)
        bmap = BlockMap.of([s[k:] for s, k in zip(self._slots, self._skips, strict=True)], self.block_size)
        staged = self.pool.layers(self.kv_caches, len(bmap.blocks))
        self._step = _Step(bmap, staged, bmap.blocks.to(self.kv_caches[0].device))

    @property
    def active(self) -> bool:
        return self._step is not None

    def layer(self, index: int, kv_layer: torch.Tensor) -> None:
        """Layer ``index`` has written this step's KV: queue the copy of its staged blocks."""
        step = self._step
        if step is None or index in step.handles:
            return
        blocks, out = step.device_blocks, step.staged[index]
        step.handles[index] = self.copier.start_to_host(
            out, lambda dst: torch.index_select(kv_layer, 0, blocks, out=dst))

    def finish(self) -> list[StagedSave]:
        """Wait for the copies; one :class:`StagedSave` per save given to :meth:`begin`, in order."""
        step, self._step, self.step_of = self._step, None, None
        if step is None:
            return []
        for handle in step.handles.values():
            self.copier.synchronize(handle)
        if len(step.handles) != len(self.kv_caches):
            logger.warning("layer-wise save: vLLM's save_kv_layer came for %d of %d layers this step; "
                           "saving from paged KV instead", len(step.handles), len(self.kv_caches))
            return [StagedSave(None, None) for _ in self._slots]
        return [StagedSave(step.staged, _full_slots(len(s), k, step.map.remap(s[k:])))
                for s, k in zip(self._slots, self._skips, strict=True)]


@dataclass
class StagedLoad:
    """Where the worker writes one synchronous load: the staging copy and the load's slots in it."""

    kv_caches: list[torch.Tensor]
    slots: list[int]


@dataclass
class _Back:
    """What a load writes back into paged KV, per layer: whole blocks where every token is
    loaded, single tokens elsewhere. Never a whole partly loaded block: when vLLM waits for
    a layer, that layer's new tokens of the step are already in paged KV (its KV cache update
    runs before the attention op that calls ``wait_for_layer_load``), and in the block of
    the load's first token may sit tokens vLLM had before the load."""

    full_blocks: torch.Tensor  # paged indices of wholly loaded blocks (on the device)
    full_at: torch.Tensor  # ... their positions in staging (on the device)
    whole: bool  # every staged block is wholly loaded: the staging copy goes in as it is
    part_src: torch.Tensor  # staging slots of the other loaded tokens (on the device)
    part_dst: torch.Tensor  # ... their paged slots (on the device)

    @classmethod
    def of(cls, bmap: BlockMap, loaded: torch.Tensor, device: torch.device) -> _Back:
        blocks, counts = torch.unique(loaded // bmap.block_size, return_counts=True)
        full = blocks[counts == bmap.block_size]
        part = ~torch.isin(loaded // bmap.block_size, full)
        return cls(full.to(device), bmap.positions(full).to(device), len(full) == len(bmap.blocks),
                   bmap.remap(loaded[part]).to(device), loaded[part].to(device))


class LayerwiseLoader:
    """Reads a step's synchronous loads into staging, then moves them in layer by layer.

    ``layout``: the paged layout, for the tokens of partly loaded blocks (copied one by one)."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, layout: PagedLayout) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layout = layout
        self.copier: DeviceCopier = device_copy.for_device(kv_caches[0].device)
        self.pool = StagingPool(self.copier.is_cuda, "load")
        self._step: _Step | None = None
        self._plan: _Back | None = None

    @property
    def active(self) -> bool:
        return self._step is not None

    def begin(self, loads: list[tuple[list[int], int, int]]) -> list[StagedLoad]:
        """Stage the blocks of each load ``(slots, first, start)``: ``slots`` for tokens
        ``[0, end)``, the load reads chunks from ``first`` (a chunk start) and writes
        ``[start, end)``. Returns where each load writes, in order; call :meth:`start` once
        they are written."""
        self.finish_all()
        if not loads:
            return []
        slots = [torch.tensor(s, dtype=torch.int64) for s, _, _ in loads]
        bmap = BlockMap.of([s[first:] for s, (_, first, _) in zip(slots, loads, strict=True)], self.block_size)
        staged = self.pool.layers(self.kv_caches, len(bmap.blocks))
        device = self.kv_caches[0].device
        loaded = torch.cat([s[start:] for s, (_, _, start) in zip(slots, loads, strict=True)])
        self._plan = _Back.of(bmap, loaded, device)
        self._step = _Step(bmap, staged, None)  # the loader writes back through self._plan
        return [StagedLoad(staged, _full_slots(len(s), first, bmap.remap(s[first:])).tolist())
                for s, (_, first, _) in zip(slots, loads, strict=True)]

    def start(self) -> None:
        """The loads are in staging: queue every layer's copy to paged KV (on CPU: nothing yet,
        each layer is copied when vLLM waits for it)."""
        step = self._step
        if step is None or not self.copier.is_cuda:
            return
        for index in range(len(self.kv_caches)):
            self._start_layer(step, index)

    def _start_layer(self, step: _Step, index: int) -> None:
        if index in step.handles:
            return
        kv, plan, layout = self.kv_caches[index], self._plan, self.layout

        def write(t: torch.Tensor) -> None:  # t: the layer's staging copy, on the KV's device
            if plan.whole:
                kv.index_copy_(0, plan.full_blocks, t)
            elif len(plan.full_blocks):
                kv.index_copy_(0, plan.full_blocks, t.index_select(0, plan.full_at))
            if len(plan.part_src):
                tokens = torch.empty(2, len(plan.part_src), kv.shape[1] * (kv.shape[-1] // 2),
                                     dtype=kv.dtype, device=kv.device)
                layout.gather(t, plan.part_src, tokens)
                layout.scatter(kv, plan.part_dst, tokens)

        # The whole staging copy crosses (pinned: one asynchronous copy); then only the loaded
        # tokens go into paged KV.
        step.handles[index] = self.copier.start_to_device(step.staged[index], write)

    def wait_layer(self, index: int) -> None:
        """Before layer ``index``'s attention: its loaded blocks are in paged KV (for the caller's stream)."""
        step = self._step
        if step is None or not 0 <= index < len(self.kv_caches):
            return
        self._start_layer(step, index)
        self.copier.wait(step.handles[index])

    def finish(self) -> list[int]:
        """End of the step: the layers vLLM never waited for (their blocks were not loaded, so
        the worker reports the step's loads as failed), empty normally. Copies still on their
        way are left to :meth:`finish_all` (the next :meth:`begin`), so the step does not block."""
        step = self._step
        if step is None:
            return []
        missing = [i for i in range(len(self.kv_caches)) if i not in step.handles]
        if missing:
            logger.warning("layer-wise load: vLLM's wait_for_layer_load did not come for layers %s this step; "
                           "the loaded blocks will be recomputed", missing)
        return missing

    def finish_all(self) -> None:
        """Wait for every copy of the last step (its staging memory is reused next)."""
        step, self._step = self._step, None
        if step is not None:
            for handle in step.handles.values():
                self.copier.synchronize(handle)
