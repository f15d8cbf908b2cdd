"""Host <-> device copies of KV, done the way vLLM's own CPU offloading does them.

On a GPU, KV moves between vLLM's paged tensors (device memory) and chunk
buffers in host memory (LMCache's CPU tier, which LMCache allocates pinned on
CUDA machines). :class:`DeviceCopier` does each such copy as

- a gather (or, for loads, a scatter) *on the device*, into (from) a device
  scratch buffer shaped like the chunk, with the layout code of
  :mod:`lmcache_mooncake.kv.layouts`, so only contiguous bytes cross PCIe;
- one ``copy_(..., non_blocking=True)`` between that scratch and the host
  buffer: a DMA straight from/to the host buffer when it is pinned (page
  locked), else through a pinned staging buffer of this copier (allocated once,
  on first use, and reused; it grows only if a bigger buffer comes);
- on one CUDA stream per direction (device -> host, host -> device), never
  the compute stream, ordered after what the caller's current stream has
  queued so far (``stream.wait_stream``: a save reads KV the model has just
  written, a load overwrites blocks earlier kernels may still use);
- finished with a CUDA event recorded on that stream: nobody synchronizes
  the whole device.

On CPU tensors (vLLM's CPU build) nothing of that applies: the same calls run
the gather or scatter straight between paged KV and the host buffer, on the
calling thread, done when they return (today's direct copies; no staging, no
streams). ``force_staging=True`` runs the staging path on the CPU as well
(a scratch buffer, then a copy), so that tests exercise its slicing there.

Contract
--------
Who calls: the worker side of the connector, on vLLM's worker process:
:class:`lmcache_mooncake.engine.PagedKVCopier` for whole chunks (LMCache's
``store`` / ``retrieve``, main thread or the loader thread), and the
layer-wise pipeline per layer (:meth:`DeviceCopier.start_layer_to_host`,
:meth:`DeviceCopier.start_layer_to_device`). One copier per device and
process: take it with :func:`for_device`. Any thread may call; on CUDA each
direction has a lock held while one copy is *enqueued* (its scratch and
staging are per direction), not while it runs; on CPU nothing is shared.

What is ready when a ``start_*`` call returns: on CPU, everything (the
returned handle is done). On CUDA with a pinned host buffer, only the order:
the copy is queued on the direction's stream; wait with :meth:`wait`
(to-device: the caller's current stream waits for it, the host does not
block; to-host: the host blocks until the bytes are in the host buffer) or
:meth:`synchronize` (the host blocks, either direction). The host buffer must
stay alive and unchanged (to-device) or unread (to-host) until then; the
handle keeps a reference to it. With an unpinned host buffer the call stages
it through pinned memory and returns only when the copy is complete (the
handle is done).

Slots: a device tensor of slots (moved once with :meth:`DeviceCopier.to_device_slots`)
saves a small host-to-device copy per layer and call; such slots are not range
checked again (see :func:`lmcache_mooncake.kv.layouts.PagedKV.check_slots`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lmcache_mooncake.kv.paged_copy import PagedKV

logger = logging.getLogger(__name__)

TO_HOST, TO_DEVICE = "to_host", "to_device"

#: Fills (device -> host) or consumes (host -> device) the device-side tensor of one copy.
DeviceStep = Callable[[torch.Tensor], None]


@dataclass
class CopyHandle:
    """One copy queued by a ``start_*`` call.

    ``event`` is None where the copy was complete when the call returned (CPU,
    unpinned host buffers). ``keep`` holds what must outlive the copy (the
    host buffer) until it is done.
    """

    direction: str
    event: Any = None
    keep: list[Any] = field(default_factory=list)

    def done(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        return self.event is None or bool(self.event.query())


class _Lane:
    """One direction's stream, lock, device scratch and pinned staging (CUDA only for the
    stream and pinning; on CPU with ``force_staging`` the buffers are plain memory)."""

    def __init__(self, device: torch.device, direction: str) -> None:
        self.device = device
        self.direction = direction
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._scratch: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None

    @contextlib.contextmanager
    def enqueue(self) -> Iterator[None]:
        """Hold the lane and make its stream current, after the caller's stream so far."""
        with self.lock:
            if self.stream is None:
                yield
                return
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                yield

    def record(self) -> Any:
        """An event on this lane's stream at what was enqueued so far (None on CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous device tensor of ``like``'s shape and dtype, reused by every copy of this
        lane (safe: one stream, so a copy's use of it ends before the next one's begins)."""
        nbytes = like.numel() * like.element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            # Allocated while the lane's stream is current, so the caching allocator ties it to it.
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[:nbytes].view(like.dtype).view(like.shape)

    def staging(self, like: torch.Tensor) -> torch.Tensor:
        """This lane's pinned host buffer viewed as ``like`` (grown once if too small). Only
        used inside a copy that completes before the lane is released."""
        nbytes = like.numel() * like.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            pin = self.device.type == "cuda"
            if self._staging is not None:
                logger.info("pinned staging (%s) grows from %d to %d bytes", self.direction,
                            self._staging.numel(), nbytes)
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._staging[:nbytes].view(like.dtype).view(like.shape)


class DeviceCopier:
    """Moves KV between paged tensors on ``device`` and host buffers; see the module docstring.

    ``force_staging``: on CPU, copy through a scratch buffer as on CUDA (tests only; on
    CUDA the scratch is always used).
    """

    def __init__(self, device: torch.device | str, *, force_staging: bool = False) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"DeviceCopier supports cpu and cuda devices, not {self.device}")
        self.staged = self.device.type == "cuda" or force_staging
        self._lanes = {TO_HOST: _Lane(self.device, TO_HOST), TO_DEVICE: _Lane(self.device, TO_DEVICE)}

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __repr__(self) -> str:
        return f"DeviceCopier({str(self.device)!r}, staged={self.staged})"

    # -- whole buffers ----------------------------------------------------------

    def start_to_host(self, host: torch.Tensor, fill: DeviceStep) -> CopyHandle:
        """Queue ``fill(t)`` (which writes every element of ``t``, a tensor of ``host``'s shape
        and dtype on the device) and the copy of ``t`` into ``host``.

        ``host``: the destination, in host memory (or already on the device: then ``fill``
        writes it directly, on the lane's stream). Returns the handle to wait on.
        """
        if not self.staged:  # CPU: straight into the host buffer, done on return
            fill(host)
            return CopyHandle(TO_HOST)
        lane = self._lanes[TO_HOST]
        with lane.enqueue():
            if host.device.type != "cpu":  # already in device memory (e.g. LMCache's MLA broadcast)
                fill(host)
                return CopyHandle(TO_HOST, lane.record(), [host])
            scratch = lane.scratch(host)
            fill(scratch)
            if not self.is_cuda or _pinned(host):
                _copy(host, scratch)
                return CopyHandle(TO_HOST, lane.record(), [host])
            stage = lane.staging(host)
            _copy(stage, scratch)
            lane.record().synchronize()
            _copy(host, stage)
            return CopyHandle(TO_HOST)

    def start_to_device(self, host: torch.Tensor, drain: DeviceStep) -> CopyHandle:
        """Queue the copy of ``host`` onto the device and ``drain(t)`` (which reads ``t``, that
        copy: a contiguous tensor of ``host``'s shape and dtype, to be used only inside
        ``drain``).

        ``host``: the source, in host memory (or already on the device: then ``drain``
        reads it directly). Returns the handle to wait on.
        """
        if not self.staged:  # CPU: straight from the host buffer, done on return
            drain(host)
            return CopyHandle(TO_DEVICE)
        lane = self._lanes[TO_DEVICE]
        with lane.enqueue():
            if host.device.type != "cpu":  # already in device memory (e.g. LMCache's MLA broadcast)
                drain(host)
                return CopyHandle(TO_DEVICE, lane.record(), [host])
            scratch = lane.scratch(host)
            if not self.is_cuda or _pinned(host):
                _copy(scratch, host)
                drain(scratch)
                return CopyHandle(TO_DEVICE, lane.record(), [host])
            stage = lane.staging(host)
            _copy(stage, host)
            _copy(scratch, stage)
            drain(scratch)
            lane.record().synchronize()  # the staging buffer is free again once this returns
            return CopyHandle(TO_DEVICE)

    # -- paged KV: whole chunks and single layers ----------------------------------------

    def start_chunk_to_host(self, paged: PagedKV, slots: torch.Tensor, host: torch.Tensor) -> CopyHandle:
        """Queue the copy of every layer's K and V at ``slots`` into ``host`` ``[2, L, T, H * D]``
        (LMCache's ``KV_2LTD`` chunk buffer, as :meth:`PagedKV.gather` fills it)."""
        return self._start_kv(paged, slots, host, None, TO_HOST)

    def start_chunk_to_device(self, paged: PagedKV, slots: torch.Tensor, host: torch.Tensor) -> CopyHandle:
        """Queue the write of ``host`` ``[2, L, T, H * D]`` (a chunk buffer or a token range of
        one) into every layer at ``slots``; the inverse of :meth:`start_chunk_to_host`."""
        return self._start_kv(paged, slots, host, None, TO_DEVICE)

    def start_layer_to_host(self, paged: PagedKV, layer: int, slots: torch.Tensor,
                            host: torch.Tensor) -> CopyHandle:
        """Queue the copy of layer ``layer``'s K and V at ``slots`` into ``host`` ``[2, T, H * D]``
        (``host[0, i]`` / ``host[1, i]``: K / V of ``slots[i]``, as
        :meth:`~lmcache_mooncake.kv.layouts.PagedLayout.gather`). For the layer-wise save:
        call it once the layer's attention has written its KV (on the caller's current
        stream), then :meth:`wait` before the host buffer is read."""
        return self._start_kv(paged, slots, host, layer, TO_HOST)

    def start_layer_to_device(self, paged: PagedKV, layer: int, slots: torch.Tensor,
                              host: torch.Tensor) -> CopyHandle:
        """Queue the write of ``host`` ``[2, T, H * D]`` into layer ``layer`` at ``slots`` (the
        inverse of :meth:`start_layer_to_host`). For the layer-wise load: start layer
        ``l + 1`` while layer ``l`` computes; :meth:`wait` on its handle right before the
        layer's attention reads its KV."""
        return self._start_kv(paged, slots, host, layer, TO_DEVICE)

    def _start_kv(self, paged: PagedKV, slots: torch.Tensor, host: torch.Tensor, layer: int | None,
                  direction: str) -> CopyHandle:
        """The device side of a paged-KV copy: :func:`gather_tokens` / :func:`scatter_tokens` when
        staged (GPU), the layout's own copies on CPU tensors (block runs, element plans)."""
        into = direction == TO_DEVICE
        if self.staged:
            step = functools.partial(scatter_tokens if into else gather_tokens, paged, slots, layer=layer)
        elif layer is None:
            step = functools.partial(paged.scatter if into else paged.gather, slots)
        else:
            layout = paged.layout
            step = functools.partial(layout.scatter if into else layout.gather, paged.kv_caches[layer], slots)
        return self.start_to_device(host, step) if into else self.start_to_host(host, step)

    # -- waiting ------------------------------------------------------------------

    def wait(self, handle: CopyHandle) -> None:
        """Make what the caller does next see the copy: for a to-device copy, the caller's
        current stream waits for it (the host does not block); for a to-host copy, the host
        blocks until the bytes are in the host buffer. No-op for a done handle."""
        if handle.event is None:
            return
        if handle.direction == TO_DEVICE:
            torch.cuda.current_stream(self.device).wait_event(handle.event)
        else:
            self.synchronize(handle)

    def synchronize(self, handle: CopyHandle) -> None:
        """Block the host until the copy has completed (then its host buffer is free)."""
        if handle.event is not None:
            handle.event.synchronize()
            handle.event = None
        handle.keep.clear()

    def to_device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as an int64 tensor on this copier's device (copied once; see the module
        docstring). Check them first (``PagedKV.check_slots`` on the host tensor)."""
        return slots.to(device=self.device, dtype=torch.int64)


# -- gathers and scatters on the device ------------------------------------------------


def gather_tokens(paged: PagedKV, slots: torch.Tensor, out: torch.Tensor, layer: int | None = None) -> None:
    """Copy K and V of the tokens at ``slots`` into ``out``: ``[2, L, T, H * D]`` from every
    layer (``layer`` None, as :meth:`PagedKV.gather`), or ``[2, T, H * D]`` from one layer (as
    :meth:`~lmcache_mooncake.kv.layouts.PagedLayout.gather`); the same bytes as those.

    The staged (GPU) path's gather: one indexing kernel per K/V for all layers where they
    are one allocation (:attr:`PagedKV.all_layers`), else one per layer, instead of the
    element plans and block runs that suit the CPU. ``slots``: distinct slots, already
    checked (:meth:`PagedKV.check_slots`): a device tensor is not range checked again, and
    an index out of range would fault the device. Falls back to the layout's copies for a
    tiled layout or a strided ``out``."""
    _move_tokens(paged, slots, out, layer, into_paged=False)


def scatter_tokens(paged: PagedKV, slots: torch.Tensor, src: torch.Tensor, layer: int | None = None) -> None:
    """Write ``src`` into paged KV at ``slots``: the inverse of :func:`gather_tokens` (same
    arguments; nothing else in paged KV changes)."""
    _move_tokens(paged, slots, src, layer, into_paged=True)


def _move_tokens(paged: PagedKV, slots: torch.Tensor, buf: torch.Tensor, layer: int | None,
                 into_paged: bool) -> None:
    pairs = _token_pairs(paged, slots, buf, layer)
    if pairs is None:  # the layout's own copies
        if layer is None:
            (paged.scatter if into_paged else paged.gather)(slots, buf)
        else:
            layout = paged.layout
            (layout.scatter if into_paged else layout.gather)(paged.kv_caches[layer], slots, buf)
        return
    index = _block_offsets(paged, slots)
    for side, part in pairs:
        if into_paged:
            side[index] = part
        else:
            part.copy_(side[index])


def _token_pairs(paged: PagedKV, slots: torch.Tensor, buf: torch.Tensor,
                 layer: int | None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(paged side, buffer side)`` pairs: K or V as ``[..., B, N, H, D]`` views of paged KV and
    the matching ``[..., T, H, D]`` views of ``buf``; None where the layout's own copy must run
    (tiled views, a strided buffer). Raises ``ValueError`` on a malformed buffer or slots."""
    shape = paged.shape
    tokens, heads, dim = slots.numel(), shape.num_kv_heads, shape.head_size
    want = (2, tokens, heads * dim) if layer is not None else (2, shape.num_layers, tokens, heads * dim)
    if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != paged.device:
        raise ValueError(f"slots must be a 1-D int64 tensor on {paged.device} (PagedKV.check_slots), "
                         f"got {slots.dtype} {tuple(slots.shape)} on {slots.device}")
    if tuple(buf.shape) != want or buf.dtype != shape.dtype or buf.device != paged.device:
        raise ValueError(f"chunk buffer must be {shape.dtype} {want} on {paged.device}, "
                         f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    views = paged.views
    if any(side.dim() != 4 for side in views[0]) or not buf.is_contiguous():
        return None
    if layer is not None:
        k, v = views[layer]
        return [(k, buf[0].view(tokens, heads, dim)), (v, buf[1].view(tokens, heads, dim))]
    stacked = paged.all_layers
    if stacked is not None:
        rows = buf.view(2, shape.num_layers, tokens, heads, dim)
        return [(stacked[0], rows[0]), (stacked[1], rows[1])]
    return [(side, buf[i, n].view(tokens, heads, dim)) for n, pair in enumerate(views) for i, side in enumerate(pair)]


def _block_offsets(paged: PagedKV, slots: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, slice, slice]:
    """The index of ``slots`` into ``[..., B, N, H, D]`` views: ``[..., block, offset, :, :]``."""
    blocks = torch.div(slots, paged.shape.block_size, rounding_mode="floor")
    offsets = slots - blocks * paged.shape.block_size
    return (Ellipsis, blocks, offsets, slice(None), slice(None))


#: Most contiguous pieces one copy is split into (beyond, torch's own copy_ handles the strides).
MAX_PIECES = 1024


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)``, one contiguous piece at a time where one side
    is strided (a token range or one layer of a chunk buffer): torch would otherwise copy a
    strided host side through a pageable temporary, which makes the copy synchronous.
    ``dst`` and ``src`` have one shape and dtype; one of them is contiguous."""
    for d, s in _pieces(dst, src):
        d.copy_(s, non_blocking=True)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of views covering ``dst`` and ``src`` with both sides contiguous, split along the
    leading dims; ``[(dst, src)]`` where that is already so or would take over
    :data:`MAX_PIECES` pieces."""
    pairs = [(dst, src)]
    while not all(d.is_contiguous() and s.is_contiguous() for d, s in pairs):
        if pairs[0][0].dim() <= 1 or len(pairs) * pairs[0][0].shape[0] > MAX_PIECES:
            return [(dst, src)]
        pairs = [(d[i], s[i]) for d, s in pairs for i in range(d.shape[0])]
    return pairs


def _pinned(t: torch.Tensor) -> bool:
    """Whether a host tensor is page locked (CUDA pinned or registered memory)."""
    return t.device.type == "cpu" and t.is_pinned()


_COPIERS: dict[torch.device, DeviceCopier] = {}
_COPIERS_LOCK = threading.Lock()


def for_device(device: torch.device | str) -> DeviceCopier:
    """This process's :class:`DeviceCopier` for ``device`` (made on first use, then shared, so
    its staging buffers are allocated once per worker)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _COPIERS_LOCK:
        copier = _COPIERS.get(dev)
        if copier is None:
            copier = _COPIERS[dev] = DeviceCopier(dev)
        return copier
