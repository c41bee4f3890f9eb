"""The value bundles the kernels take beside a scheme: :class:`Mask` (which keys each query
sees), :class:`Pages` (the page tensors and block or group scales) and :class:`FirstTokens`
(the k-transform's full-precision side buffer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CAUSAL", "FirstTokens", "Mask", "Pages"]


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees, and how its scores are shaped (checked per attention call).

    Key ``j`` of sequence ``b`` is visible to the query at position ``p`` when
    ``kv_start[b] <= j < seq_lens[b]``, ``j <= p`` (if ``causal``) and ``j > p - window`` (if
    ``window > 0``).

    Attributes:
        causal: mask keys after each query's position.
        window: if > 0, each query sees only the last ``window`` positions.
        softcap: if > 0 (finite), scores become ``softcap * tanh(scores / softcap)``.
        kv_start: int32 ``[B]`` first visible key (left padding), or None (0).
        q_lens: int32 ``[B]`` valid query tokens per sequence, or None (all ``Lq``).
        sinks: fp32 ``[Hq]`` learned attention-sink logits (gpt-oss), contiguous and finite, or
            None: each head's softmax denominator gets ``exp(sinks[h])``.
    """

    causal: bool = True
    window: int = 0
    softcap: float = 0.0
    kv_start: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


CAUSAL = Mask()
"""The default mask: causal, no window, no softcap, no padding, every query valid, no sinks."""


@dataclass(frozen=True)
class Pages:
    """One layer's pages, and their group or block scales for a dynamic scheme (checked per call).

    Attributes:
        k: FP8 ``[num_pages, page_size, Hkv, D]`` keys, any strides (fastest from
            :func:`kvquant.kernels.page_storage`); for a 4-bit K (:class:`Fp4Scales`) packed
            e2m1 codes ``uint8 [num_pages, page_size, Hkv, D // 2]``, last dimension
            contiguous (:func:`kvquant.kernels.fp4.fp4_page_storage`).
        v: like ``k`` (same dtype for FP8 K and V).
        k_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` group scales of K
            (:class:`GroupScales`; from :func:`kvquant.kernels.group_scale_storage`), the
            block scales of a 4-bit K (``[num_pages, page_size, Hkv, D // block]`` in the
            format's ``scale_dtype``, last dimension contiguous), or None.
        v_scales: like ``k_scales`` for V.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass(frozen=True)
class FirstTokens:
    """The k-transform's full-precision side buffer of each sequence's first tokens.

    Attributes:
        k: ``[B, NF, Hkv, D]`` fp32/fp16/bf16 keys in the rotated frame (``k @ R``, no offset).
        v: ``[B, NF, Hkv, D]`` their values, as the model produced them.
        lens: int32 ``[B]``, ``0..NF``: keys ``kv_start[b] .. kv_start[b] + lens[b] - 1`` are
            read from here instead of their slots (which are never read).
    """

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor


@dataclass(frozen=True)
class RecentTokens:
    """A full-precision ring of each sequence's newest tokens, kept beside the pages.

    Position ``p`` of sequence ``b`` sits at ``k[b, p % R]`` / ``v[b, p % R]``; the newest
    ``min(R, seq_len - kv_start)`` keys of each sequence are read from here instead of their
    slots (which still hold them, rounded).

    Attributes:
        kv: ``[B, 2, R, Hkv, D]`` fp32/fp16/bf16, contiguous: each sequence's keys
            (``kv[:, 0]``, in the pages' frame before any offset: ``k @ R`` for a K rotation)
            then its values (``kv[:, 1]``, as the model produced them), one allocation (a slice
            of rows is one too).
    """

    kv: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        """``[B, R, Hkv, D]`` keys (a view of ``kv``)."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        """``[B, R, Hkv, D]`` values (a view of ``kv``)."""
        return self.kv[:, 1]
