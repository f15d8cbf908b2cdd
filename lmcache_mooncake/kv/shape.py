"""The geometry of a model's paged KV cache and the checks every layout applies to a layer's tensor.

A token's *slot* is ``block_id * block_size + offset_in_block``, as in vLLM's
``slot_mapping``.

vLLM may split each scheduler block of ``M`` tokens into ``M / N`` kernel
blocks of ``N`` tokens (``prepare_kernel_block_sizes`` in
``vllm/v1/worker/utils.py``); the tensor then has ``B * M / N`` blocks of
``N`` tokens, and block ``b`` is kernel blocks ``b * M / N`` onwards, so a
slot ``b * M + o`` is the same token either way and slots need no
translation. A layout's ``kv_shape`` therefore accepts a ``block_size`` that
is a multiple of the tensor's (:func:`check_block_size`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmcache_mooncake.kv.layouts import PagedLayout

__all__ = [
    "SUPPORTED_DTYPES",
    "KVShape",
    "check_block_size",
    "check_head_width",
    "check_layer_tensor",
    "infer_kv_shape",
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


def check_layer_tensor(layout: str, kv: torch.Tensor, rank: int, expected: str) -> None:
    """Raise ``ValueError`` naming ``layout`` unless ``kv`` is a non-empty ``rank``-D tensor of a
    supported dtype (``expected`` describes the shape, for the message)."""
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


def check_block_size(layout: str, found: int, block_size: int | None) -> None:
    """Raise ``ValueError`` unless a tensor's blocks of ``found`` tokens divide vLLM's
    ``block_size`` (None: not checked)."""
    if block_size is not None and (block_size <= 0 or block_size % found):
        raise ValueError(
            f"{layout}: the paged KV tensor holds blocks of {found} tokens, but block_size={block_size} "
            f"was expected (or a multiple of {found}, when vLLM splits blocks into kernel blocks)"
        )


def check_head_width(layout: str, kv: torch.Tensor) -> int:
    """``head_size`` of a ``[..., 2 * head_size]`` tensor (K and V of equal size)."""
    width = kv.shape[-1]
    if width % 2:
        raise ValueError(f"{layout}: last dim must be 2 * head_size (even), got shape {tuple(kv.shape)}")
    return width // 2


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
