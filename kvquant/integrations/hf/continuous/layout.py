"""How one block of kvquant's continuous-batching cache is laid out: every layer's K and V pages
(FP8, or packed 4-bit codes with their block scales) and, per format, group scales,
full-precision first tokens or the ring of the newest tokens, at aligned offsets.

See :mod:`kvquant.integrations.hf.continuous` and the developer docs (``docs/dev/continuous-batching.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import (
    OptionError,
    UnsupportedModelError,
)
from kvquant.schemes import Fp4Format, Fp4Scales

__all__ = [
    "ALIGN",
    "BATCH_KWARG",
    "DECODE_PATH_BLOCKS",
    "FULL_ATTENTION",
    "PAGED_NAME",
    "BlockLayout",
    "check_recent_fits",
    "layout_for",
]


BATCH_KWARG = "_kvq_batch_step"
"""Keyword the batching cache's ``update`` (5.24) adds to the attention call: the layer's step."""

DECODE_PATH_BLOCKS = 32
"""Blocks per request of transformers' decode-path block table (5.24 and later; its own
default): a step whose requests all have one query token and fewer tokens than this many
blocks hold is planned on the device from that table
(:func:`~kvquant.integrations.hf.continuous.plan.decode_plan`). A
``ContinuousBatchingConfig(max_blocks_per_request=...)`` replaces it (0: no decode path)."""

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
    order, each part starting on a multiple of 128 bytes: the K page, the V page,
    for a 4-bit side its block scales (K's, then V's), for ``fp32-group`` the fp32 K
    and V group scales (head-major ``[Hkv, page_size, D // G]``), and for
    ``k-transform`` the first tokens' keys and values ``[first_tokens, Hkv, D]`` in
    the model's dtype (meaningful in a request's first block only), and with
    ``recent_tokens = R`` the block's ring: keys (in the pages' frame, before any offset)
    and values ``[R, Hkv, D]`` in the model's dtype, position ``p`` of the block in slot
    ``p % R``, so that it holds the block's newest ``R`` tokens (``R`` divides the page
    size; a request's newest ``R`` lie in its last one or two blocks). An FP8 K page is
    ``[page_size, Hkv, D]`` (head dim fastest), an FP8 V page keys-fastest
    (``[Hkv, D, page_size]`` in memory); a 4-bit page is the packed e2m1 codes
    ``uint8 [page_size, Hkv, D // 2]`` and its block scales ``[page_size, Hkv,
    D // block]`` in the format's one-byte scale dtype, both token-major with the
    last dimension contiguous. These are the layouts of
    :func:`kvquant.kernels.page_storage`, :func:`kvquant.kernels.group_scale_storage` and
    :func:`kvquant.kernels.fp4.fp4_page_storage`, with the block size as the page
    stride (a multiple of 128 bytes, so the 4-bit rows the kernels read as int32 words
    stay 4-byte aligned). A 4-bit format's fp32 global scales (NVFP4) are no part of
    the block: each layer's storage keeps its own, from the patch's scales.

    Attributes:
        num_layers: layers in a block.
        page_size: tokens per block.
        num_kv_heads: ``Hkv`` (every layer).
        head_dim: ``D`` (every layer).
        n_groups: ``D // G`` for ``fp32-group``, else 0.
        first_tokens: ``k-transform``'s first tokens kept at full precision, else 0.
        recent_tokens: ``R``, the ring's tokens per block (the patch's ``recent_tokens``), or 0.
        side_dtype: the dtype of those first tokens and of the ring (the model's).
        k_fp4: K's 4-bit format (:data:`~kvquant.schemes.NVFP4`,
            :data:`~kvquant.schemes.MXFP4`), None for FP8 K.
        v_fp4: like ``k_fp4`` for V.
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    n_groups: int = 0
    first_tokens: int = 0
    recent_tokens: int = 0
    side_dtype: torch.dtype = torch.bfloat16
    k_fp4: Fp4Format | None = None
    v_fp4: Fp4Format | None = None

    @property
    def pages_name(self) -> str:
        """What the pages hold, for messages: ``FP8``, ``NVFP4``, ``MXFP4``, ``FP8 K + NVFP4 V``."""
        k, v = (("FP8" if f is None else f.name.upper()) for f in (self.k_fp4, self.v_fp4))
        return k if k == v else f"{k} K + {v} V"

    def _page_bytes(self, fmt: Fp4Format | None) -> tuple[int, int]:
        """``(codes, block scales)`` bytes of one side's page (no block scales for FP8)."""
        slots = self.page_size * self.num_kv_heads
        if fmt is None:
            return slots * self.head_dim, 0
        nb = self.head_dim // fmt.block_size
        return slots * (self.head_dim // 2), slots * nb * fmt.scale_dtype.itemsize

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each part inside one layer's share of a block, and its ``end``."""
        k_codes, k_blocks = self._page_bytes(self.k_fp4)
        v_codes, v_blocks = self._page_bytes(self.v_fp4)
        scales = 4 * self.page_size * self.num_kv_heads * self.n_groups
        row = self.num_kv_heads * self.head_dim * self.side_dtype.itemsize
        side, ring = self.first_tokens * row, self.recent_tokens * row
        out: dict[str, int] = {}
        pos = 0
        for name, size in (
            ("k_pages", k_codes),
            ("v_pages", v_codes),
            ("k_block_scales", k_blocks),
            ("v_block_scales", v_blocks),
            ("k_group_scales", scales),
            ("v_group_scales", scales),
            ("first_k", side),
            ("first_v", side),
            ("recent_k", ring),
            ("recent_v", ring),
        ):
            if size:
                out[name] = pos
                pos = _align(pos + size)
        out["end"] = pos
        return out

    @property
    def ring_note(self) -> str:
        """For messages: ``", each with a ring of its R newest tokens (x % of its bytes)"``, or
        ``""`` without a ring."""
        if not self.recent_tokens:
            return ""
        off = self.offsets
        share = (off["recent_v"] - off["recent_k"]) * 2 / self.bytes_per_page
        return f", each with a ring of its {self.recent_tokens} newest tokens ({share:.0%} of its bytes)"

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
            ``k_pages`` / ``v_pages``: FP8 ``[num_blocks, page_size, Hkv, D]``, or for a
            4-bit side uint8 ``[num_blocks, page_size, Hkv, D // 2]`` with its
            ``k_block_scales`` / ``v_block_scales`` ``[num_blocks, page_size, Hkv,
            D // block]`` in the format's scale dtype; where the layout has them
            ``k_group_scales`` / ``v_group_scales`` fp32
            ``[num_blocks, page_size, Hkv, D // G]`` and ``first_k`` / ``first_v``
            ``[num_blocks, first_tokens, Hkv, D]`` in ``side_dtype``, and ``recent_k`` /
            ``recent_v`` ``[num_blocks, recent_tokens, Hkv, D]`` likewise.
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
        out: dict[str, torch.Tensor] = {}
        for kv, fmt in (("k", self.k_fp4), ("v", self.v_fp4)):
            name = f"{kv}_pages"
            if fmt is None:  # FP8: K head dim fastest, V keys fastest (page_storage)
                strides = (block, hkv * d, d, 1) if kv == "k" else (block, 1, d * ps, ps)
                out[name] = codes.as_strided((num_blocks, ps, hkv, d), strides, base + off[name])
                continue
            # 4-bit: token-major rows of packed codes and of block scales (fp4_page_storage)
            half, nb = d // 2, d // fmt.block_size
            out[name] = buffer.view(torch.uint8).as_strided(
                (num_blocks, ps, hkv, half), (block, hkv * half, half, 1), base + off[name]
            )
            isz = fmt.scale_dtype.itemsize
            out[f"{kv}_block_scales"] = buffer.view(fmt.scale_dtype).as_strided(
                (num_blocks, ps, hkv, nb),
                (block // isz, hkv * nb, nb, 1),
                (base + off[f"{kv}_block_scales"]) // isz,
            )
        if ng:
            f32 = buffer.view(torch.float32)
            for name in ("k_group_scales", "v_group_scales"):
                out[name] = f32.as_strided(
                    (num_blocks, ps, hkv, ng),
                    (block // 4, ng, ps * ng, 1),
                    (base + off[name]) // 4,
                )
        side = buffer.view(self.side_dtype)
        isz = self.side_dtype.itemsize
        for names, n in (
            (("first_k", "first_v"), nf),
            (("recent_k", "recent_v"), self.recent_tokens),
        ):
            for name in names if n else ():
                out[name] = side.as_strided(
                    (num_blocks, n, hkv, d),
                    (block // isz, hkv * d, d, 1),
                    (base + off[name]) // isz,
                )
        return out


def check_recent_fits(specs: list[Any], page_size: int, owner: str, auto: bool = False) -> int:
    """The ring's tokens per block (the patch's ``recent_tokens``; 0: none), checked to divide
    ``page_size``: each block keeps the ring of its own newest tokens. With ``auto`` (the
    patch's ``recent_tokens="auto"``, the default) none: a ring in every block would cost
    blocks (an eighth of a 256-token FP8 block in bf16), where ``generate``'s cache keeps one
    ring per sequence.

    Raises:
        OptionError: a ring longer than a block, or one that does not divide it.
    """
    if auto:
        return 0
    recent = max(int(s.recent_tokens) for s in specs)
    if recent and (recent > page_size or page_size % recent):
        fits = max(r for r in range(1, min(recent, page_size) + 1) if page_size % r == 0)
        raise OptionError(
            f"{owner}: kvquant.patch(..., recent_tokens={recent}) with continuous-batching "
            f"blocks of {page_size} tokens; each block keeps a ring of its newest tokens, so "
            f"the ring must divide the block size. Fix: a page size that is a multiple of "
            f"{recent}, or recent_tokens={fits}."
        )
    return recent


def layout_for(
    specs: list[Any], page_size: int, dtype: torch.dtype, auto_recent: bool = False
) -> BlockLayout:
    """The :class:`BlockLayout` of a patched model's layer specs (checked to be uniform).

    FP8 formats lay out FP8 pages (and their group scales or first tokens); the 4-bit
    formats (``nvfp4``, ``mxfp4``, ``fp8-k-nvfp4-v``) their packed codes and block scales.

    ``auto_recent``: the patch's ``recent_tokens`` is ``"auto"``: blocks without a ring
    (:func:`check_recent_fits`).

    Raises:
        OptionError: a ring of newest tokens that does not divide ``page_size``.
        UnsupportedModelError: layers of different KV heads, head dims or formats (a
            per-layer map mixing formats among them), or layers that share K/V.
    """
    first = specs[0]
    keys = {
        (s.num_kv_heads, s.head_dim, s.scheme, s.group_size, s.first_tokens, s.recent_tokens)
        for s in specs
    }
    if len(keys) != 1 or any(s.kv_reused for s in specs):
        kinds = sorted({f"{s.granularity} Hkv={s.num_kv_heads} D={s.head_dim}" for s in specs})
        reused = [s.name for s in specs if s.kv_reused]
        found = (
            [f"its layers differ ({len(keys)} kinds: {'; '.join(kinds)})"] if len(keys) > 1 else []
        )
        found += [f"later layers attend over the K/V of {', '.join(reused)}"] if reused else []
        raise UnsupportedModelError(
            f"{first.name}: kvquant's continuous-batching cache lays every layer out alike in "
            f"one block; in this model {' and '.join(found)}. Expected every layer with the "
            "same KV heads, head dim and KV format (group size, first and recent tokens "
            "included), "
            "none attending over another's K/V. Fix: run generate() per request (kvquant's "
            "cache serves it), patch every layer with one kv_format, or handle.remove() for "
            "transformers' own batching."
        )
    k_fp4: Fp4Format | None = None
    v_fp4: Fp4Format | None = None
    if issubclass(first.scheme, Fp4Scales):  # global scales stay with each layer's storage
        k_fp4, v_fp4 = first.scheme.k_format, first.scheme.v_format
    return BlockLayout(
        num_layers=len(specs),
        page_size=page_size,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        n_groups=first.scheme.group_scales(first.head_dim, first.group_size),
        first_tokens=first.first_tokens,
        recent_tokens=check_recent_fits(specs, page_size, first.name, auto_recent),
        side_dtype=dtype
        if dtype in (torch.float32, torch.float16, torch.bfloat16)
        else torch.float32,
        k_fp4=k_fp4,
        v_fp4=v_fp4,
    )
