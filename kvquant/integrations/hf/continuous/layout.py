"""How one block of kvquant's continuous-batching cache is laid out: every layer's FP8 K and V
pages and, per format, group scales or full-precision first tokens, at aligned offsets.

See :mod:`kvquant.integrations.hf.continuous` and the developer docs (``docs/dev/continuous-batching.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import (
    UnsupportedModelError,
)
from kvquant.schemes import Fp4Scales

__all__ = [
    "ALIGN",
    "BATCH_KWARG",
    "FULL_ATTENTION",
    "PAGED_NAME",
    "BlockLayout",
    "layout_for",
]


BATCH_KWARG = "_kvq_batch_step"
"""Keyword the batching cache's ``update`` (5.24) adds to the attention call: the layer's step."""

PAGED_NAME = "paged|kvquant"
"""kvquant's attention name while transformers 5.17 runs continuous batching."""

ALIGN = 128
"""Bytes each part of a block starts on (fp32 and bf16 views need aligned offsets)."""

FULL_ATTENTION = "full_attention"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------- layout


@dataclass(frozen=True)
class BlockLayout:
    """Where each layer's pages live inside one block of the batching cache.

    A block holds ``page_size`` tokens of every layer. For each layer it holds, in
    order, each part starting on a multiple of 128 bytes: the FP8 K page
    ``[page_size, Hkv, D]`` (head dim fastest), the FP8 V page (keys fastest,
    ``[Hkv, D, page_size]`` in memory), for ``fp32-group`` the fp32 K and V group
    scales (head-major ``[Hkv, page_size, D // G]``), and for ``k-transform`` the
    first tokens' keys and values ``[first_tokens, Hkv, D]`` in the model's dtype
    (meaningful in a request's first block only). These are the layouts of
    :func:`kvquant.kernels.page_storage` and :func:`kvquant.kernels.group_scale_storage`,
    with the block size as the page stride.

    Attributes:
        num_layers: layers in a block.
        page_size: tokens per block.
        num_kv_heads: ``Hkv`` (every layer).
        head_dim: ``D`` (every layer).
        n_groups: ``D // G`` for ``fp32-group``, else 0.
        first_tokens: ``k-transform``'s first tokens kept at full precision, else 0.
        side_dtype: the dtype of those first tokens (the model's).
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    n_groups: int = 0
    first_tokens: int = 0
    side_dtype: torch.dtype = torch.bfloat16

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each part inside one layer's share of a block, and its ``end``."""
        codes = self.page_size * self.num_kv_heads * self.head_dim
        scales = 4 * self.page_size * self.num_kv_heads * self.n_groups
        side = self.first_tokens * self.num_kv_heads * self.head_dim * self.side_dtype.itemsize
        out: dict[str, int] = {}
        pos = 0
        for name, size in (
            ("k_pages", codes),
            ("v_pages", codes),
            ("k_group_scales", scales),
            ("v_group_scales", scales),
            ("first_k", side),
            ("first_v", side),
        ):
            if size:
                out[name] = pos
                pos = _align(pos + size)
        out["end"] = pos
        return out

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one layer's share of a block (all its parts)."""
        return self.offsets["end"]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (every layer)."""
        return self.num_layers * self.bytes_per_page

    def dense_block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes transformers' own cache spends on a block of the same tokens in ``dtype``."""
        return (
            2
            * self.num_layers
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * dtype.itemsize
        )

    def views(self, buffer: torch.Tensor, layer: int, num_blocks: int) -> dict[str, torch.Tensor]:
        """The parts of ``layer`` in every block of ``buffer`` (a flat uint8 tensor), as strided views.

        Returns:
            ``k_pages`` / ``v_pages`` FP8 ``[num_blocks, page_size, Hkv, D]``, and where
            the layout has them ``k_group_scales`` / ``v_group_scales`` fp32
            ``[num_blocks, page_size, Hkv, D // G]`` and ``first_k`` / ``first_v``
            ``[num_blocks, first_tokens, Hkv, D]`` in ``side_dtype``.
        """
        ps, hkv, d, ng, nf = (
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
            self.n_groups,
            self.first_tokens,
        )
        block = self.bytes_per_block
        base = layer * self.bytes_per_page
        off = self.offsets
        codes = buffer.view(torch.float8_e4m3fn)
        out = {
            "k_pages": codes.as_strided(
                (num_blocks, ps, hkv, d), (block, hkv * d, d, 1), base + off["k_pages"]
            ),
            "v_pages": codes.as_strided(
                (num_blocks, ps, hkv, d), (block, 1, d * ps, ps), base + off["v_pages"]
            ),
        }
        if ng:
            f32 = buffer.view(torch.float32)
            for name in ("k_group_scales", "v_group_scales"):
                out[name] = f32.as_strided(
                    (num_blocks, ps, hkv, ng),
                    (block // 4, ng, ps * ng, 1),
                    (base + off[name]) // 4,
                )
        if nf:
            side = buffer.view(self.side_dtype)
            isz = self.side_dtype.itemsize
            for name in ("first_k", "first_v"):
                out[name] = side.as_strided(
                    (num_blocks, nf, hkv, d),
                    (block // isz, hkv * d, d, 1),
                    (base + off[name]) // isz,
                )
        return out


def layout_for(specs: list[Any], page_size: int, dtype: torch.dtype) -> BlockLayout:
    """The :class:`BlockLayout` of a patched model's layer specs (checked to be uniform).

    Raises:
        UnsupportedModelError: layers of different KV heads, head dims or granularities,
            or layers that share K/V.
    """
    first = specs[0]
    keys = {(s.num_kv_heads, s.head_dim, s.scheme, s.group_size, s.first_tokens) for s in specs}
    if len(keys) != 1 or any(s.kv_reused for s in specs):
        raise UnsupportedModelError(
            f"{first.name}: kvquant's continuous-batching cache needs every layer to have the same "
            "KV heads, head dim and scale format, and no layer attending over another's K/V; "
            f"this model's layers differ ({len(keys)} kinds). Fix: run generate() per request "
            "(the FP8 cache serves it), or handle.remove() for transformers' own batching."
        )
    if issubclass(first.scheme, Fp4Scales):
        raise UnsupportedModelError(
            f"{first.name}: kvquant's continuous-batching cache lays out FP8 pages; the model "
            f"is patched with the 4-bit format {first.granularity!r}. Fix: run generate() per "
            "request (the 4-bit cache serves it), or patch with kv_format='fp8' for batching."
        )
    return BlockLayout(
        num_layers=len(specs),
        page_size=page_size,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        n_groups=first.scheme.group_scales(first.head_dim, first.group_size),
        first_tokens=first.first_tokens,
        side_dtype=dtype
        if dtype in (torch.float32, torch.float16, torch.bfloat16)
        else torch.float32,
    )
