"""Paged FP8 KV storage: a page allocator and per-layer page tensors.

:class:`PageAllocator` hands out fixed-size pages to sequences and turns
"sequence ``s`` gets ``n`` more tokens" into a slot mapping (where each new
token is stored), block tables and sequence lengths: the index tensors the
kernels in :mod:`kvquant.kernels` consume. :class:`PagedKVCache` owns one
allocator (shared by all layers: a token occupies the same slot in every
layer) and, per layer, the FP8 K/V pages, the fp32 group scales (for the
dynamic ``fp32-group`` format) or the static K/V scales.

Layout (see :mod:`kvquant.kernels`): pages ``[num_pages, page_size, Hkv, D]``,
slot ``= page * page_size + offset``, block tables int32 ``[B, max_pages]``,
sequence lengths int32 ``[B]``.

This module imports torch and :mod:`kvquant.kernels` only (no transformers).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from kvquant.errors import CacheCapacityError, CacheUsageError, ScaleFormatError
from kvquant.kernels import paged_attention, write_kv
from kvquant.kernels.backend import BACKENDS
from kvquant.kernels.validate import FP8_DTYPES

__all__ = ["GRANULARITIES", "PageAllocator", "PagedKVCache"]

GRANULARITIES: tuple[str, ...] = ("per-tensor", "per-head", "fp32-group")
"""Scale granularities a :class:`PagedKVCache` stores."""


def _positive_int(name: str, value: object, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CacheUsageError(
            f"{owner}: {name} is {value!r}; expected a positive int. Fix: pass {name} >= 1."
        )
    return value


class PageAllocator:
    """Assigns pages of ``page_size`` token slots to sequences.

    Each sequence (any hashable id) owns an ordered list of pages; its token at
    position ``p`` lives in slot ``pages[p // page_size] * page_size +
    p % page_size``. Pages come from one free list shared by all sequences.

    Args:
        num_pages: pages in the cache.
        page_size: token slots per page (16 by default; 32 and 64 cut index
            traffic, larger pages waste up to ``page_size - 1`` slots per
            sequence).
        device: device of the index tensors returned (slot mappings, block
            tables, sequence lengths).

    Example:
        >>> alloc = PageAllocator(num_pages=8, page_size=16)
        >>> alloc.reserve([0, 1], [3, 1]).tolist()
        [[0, 1, 2], [16, -1, -1]]
        >>> alloc.block_tables([0, 1]).tolist(), alloc.seq_lens([0, 1]).tolist()
        ([[0], [1]], [3, 1])
    """

    def __init__(
        self, num_pages: int, page_size: int = 16, device: torch.device | str = "cpu"
    ) -> None:
        self.num_pages = _positive_int("num_pages", num_pages, "PageAllocator")
        self.page_size = _positive_int("page_size", page_size, "PageAllocator")
        self.device = torch.device(device)
        self._free: list[int] = []
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._version = 0
        self._table_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self.reset()

    # ----------------------------------------------------------------- state
    @property
    def num_free_pages(self) -> int:
        """Pages not owned by any sequence."""
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by some sequence."""
        return self.num_pages - len(self._free)

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        """Ids of the sequences that hold pages or tokens, in creation order."""
        return tuple(self._lens)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._lens

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens reserved so far for ``seq_id``."""
        return self._lens[self._known(seq_id, "seq_len")]

    def pages(self, seq_id: Hashable) -> tuple[int, ...]:
        """Physical page ids of ``seq_id``, in logical order."""
        return tuple(self._pages[self._known(seq_id, "pages")])

    def _known(self, seq_id: Hashable, op: str) -> Hashable:
        if seq_id not in self._lens:
            raise CacheUsageError(
                f"PageAllocator.{op}: sequence {seq_id!r} is unknown (known: "
                f"{len(self._lens)} sequences). Fix: reserve tokens for it first "
                "(PageAllocator.reserve), or check that it was not freed."
            )
        return seq_id

    def _distinct(self, seq_ids: Sequence[Hashable], op: str) -> list[Hashable]:
        ids = list(seq_ids)
        seen: set[Hashable] = set()
        for sid in ids:
            if sid in seen:
                raise CacheUsageError(
                    f"PageAllocator.{op}: sequence {sid!r} appears twice in seq_ids; expected "
                    "distinct ids (one row per sequence). Fix: pass each sequence once."
                )
            seen.add(sid)
        return ids

    # ------------------------------------------------------------- mutation
    def reserve(
        self, seq_ids: Sequence[Hashable], num_new_tokens: int | Sequence[int]
    ) -> torch.Tensor:
        """Reserve slots for new tokens, all or nothing.

        Unknown ids start new sequences. Pages are taken only when a
        sequence's last page is full.

        Args:
            seq_ids: ``B`` distinct sequence ids.
            num_new_tokens: one count for all sequences, or ``B`` counts.

        Returns:
            int64 ``[B, L]`` slot mapping on :attr:`device`, ``L`` the largest
            count; row ``b`` holds the slots of the new tokens of
            ``seq_ids[b]`` in order, padded with -1 (skip).

        Raises:
            CacheCapacityError: too few free pages; nothing was changed.
            CacheUsageError: repeated ids or bad counts; nothing was changed.
        """
        ids = self._distinct(seq_ids, "reserve")
        counts = self._counts(ids, num_new_tokens)
        page = self.page_size
        needed = []
        for sid, n in zip(ids, counts, strict=True):
            old = self._lens.get(sid, 0)
            have = len(self._pages.get(sid, ()))
            needed.append(max(0, -(-(old + n) // page) - have))
        total = sum(needed)
        if total > len(self._free):
            raise CacheCapacityError(
                f"PageAllocator.reserve: {sum(counts)} new tokens for {len(ids)} sequences need "
                f"{total} new pages of {page} slots, but only {len(self._free)} of "
                f"{self.num_pages} pages are free; nothing was reserved. Fix: free finished "
                "sequences (PageAllocator.free), reserve for fewer sequences at once, or build "
                "the cache with more pages (num_pages)."
            )
        width = max(counts, default=0)
        out = torch.full((len(ids), width), -1, dtype=torch.int64)
        for row, (sid, n, extra) in enumerate(zip(ids, counts, needed, strict=True)):
            plist = self._pages.setdefault(sid, [])
            for _ in range(extra):
                plist.append(self._free.pop())
            old = self._lens.get(sid, 0)
            self._lens[sid] = old + n
            if n:
                pos = torch.arange(old, old + n, dtype=torch.int64)
                table = torch.tensor(plist, dtype=torch.int64)
                out[row, :n] = table[pos // page] * page + pos % page
        if total:
            self._version += 1
        return out.to(self.device)

    def _counts(self, ids: list[Hashable], num_new_tokens: int | Sequence[int]) -> list[int]:
        if isinstance(num_new_tokens, int) and not isinstance(num_new_tokens, bool):
            counts = [num_new_tokens] * len(ids)
        else:
            counts = list(num_new_tokens)  # type: ignore[arg-type]
            if len(counts) != len(ids):
                raise CacheUsageError(
                    f"PageAllocator.reserve: {len(counts)} token counts for {len(ids)} "
                    "sequences; expected one count per sequence (or a single int). "
                    "Fix: pass num_new_tokens with one entry per seq_id."
                )
        for sid, n in zip(ids, counts, strict=True):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise CacheUsageError(
                    f"PageAllocator.reserve: sequence {sid!r} asks for {n!r} new tokens; "
                    "expected an int >= 0. Fix: pass the number of new tokens."
                )
        return counts

    def free(self, seq_id: Hashable) -> None:
        """Return the pages of ``seq_id`` to the free list and forget it.

        Raises:
            CacheUsageError: ``seq_id`` is unknown.
        """
        self._known(seq_id, "free")
        pages = self._pages.pop(seq_id, [])
        del self._lens[seq_id]
        self._free.extend(reversed(pages))
        if pages:
            self._version += 1

    def reset(self) -> None:
        """Forget every sequence; all pages become free."""
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._pages.clear()
        self._lens.clear()
        self._version += 1
        self._table_cache = None

    # -------------------------------------------------------- index tensors
    def block_tables(self, seq_ids: Sequence[Hashable], width: int | None = None) -> torch.Tensor:
        """Block tables of ``seq_ids`` as an int32 ``[B, max_pages]`` tensor on :attr:`device`.

        Rows are padded with page 0 (never read: the kernels stop at each
        sequence's length). The tensor is cached and reused while no page
        changes hands and the same ids are asked for (decode steps inside a
        page rebuild nothing); treat it as read-only.

        Args:
            seq_ids: ``B`` distinct known sequence ids.
            width: columns (for fixed shapes, e.g. CUDA graphs); default the
                most pages any of the sequences holds (at least 1).

        Raises:
            CacheUsageError: an unknown or repeated id, or ``width`` too small.
        """
        ids = self._distinct(seq_ids, "block_tables")
        for sid in ids:
            self._known(sid, "block_tables")
        key = (self._version, tuple(ids), width)
        if self._table_cache is not None and self._table_cache[0] == key:
            return self._table_cache[1]
        need = max((len(self._pages.get(s, ())) for s in ids), default=0)
        cols = max(need, 1) if width is None else width
        if cols < need:
            raise CacheUsageError(
                f"PageAllocator.block_tables: width={width} but a sequence holds {need} pages. "
                "Fix: pass width >= the longest sequence's page count, or width=None."
            )
        rows = [self._pages.get(s, []) + [0] * (cols - len(self._pages.get(s, []))) for s in ids]
        table = torch.tensor(rows, dtype=torch.int32).reshape(len(ids), cols).to(self.device)
        self._table_cache = (key, table)
        return table

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Tokens stored per sequence: int32 ``[B]`` on :attr:`device`.

        Raises:
            CacheUsageError: an unknown id.
        """
        lens = [self._lens[self._known(s, "seq_lens")] for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)


class PagedKVCache:
    """FP8 paged K/V storage for ``num_layers`` attention layers.

    All layers share one :class:`PageAllocator` (``self.allocator``): reserve
    slots once per step, then :meth:`write` and :meth:`attend` each layer with
    the same slot mapping, block tables and sequence lengths.

    Args:
        num_layers: attention layers.
        num_pages: pages per layer.
        page_size: token slots per page (16, 32 or 64 are typical).
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        granularity: ``"per-tensor"``, ``"per-head"`` (static scales given in
            ``k_scales``/``v_scales``) or ``"fp32-group"`` (dynamic: one fp32
            scale per token, KV head and group of ``group_size`` elements,
            computed on write).
        group_size: ``G`` for ``fp32-group``; must divide ``head_dim``;
            default ``min(64, head_dim)``.
        kv_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        device: where pages and index tensors live.
        k_scales: per layer, the fp32 K scale, ``[]`` for per-tensor or
            ``[Hkv]`` for per-head (from :mod:`kvquant.registry`); None for
            ``fp32-group``. Copied to fp32 on ``device`` once.
        v_scales: like ``k_scales`` for V.
        backend: kernel backend for :meth:`write` / :meth:`attend`
            (``"auto"``, ``"triton"``, ``"torch"``).

    Attributes:
        allocator: the shared :class:`PageAllocator`.
        k_pages: per layer ``[num_pages, page_size, Hkv, D]`` FP8.
        v_pages: per layer ``[num_pages, page_size, Hkv, D]`` FP8.
        k_group_scales: per layer fp32 ``[num_pages, page_size, Hkv, D // G]``
            (``fp32-group`` only, else empty).
        v_group_scales: like ``k_group_scales``.
        k_scales: per layer fp32 ``[]`` or ``[Hkv]`` (static granularities, else empty).
        v_scales: like ``k_scales``.

    Example:
        >>> import torch
        >>> cache = PagedKVCache(2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=64,
        ...                      granularity="fp32-group", group_size=32, backend="torch")
        >>> slots = cache.allocator.reserve([0], 5)
        >>> k = v = torch.randn(1, 5, 2, 64)
        >>> for layer in range(2):
        ...     cache.write(layer, k, v, slots)
        >>> q = torch.randn(1, 5, 4, 64)
        >>> out = cache.attend(0, q, cache.allocator.block_tables([0]), cache.allocator.seq_lens([0]))
        >>> out.shape
        torch.Size([1, 5, 4, 64])
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        granularity: str,
        group_size: int | None = None,
        kv_dtype: torch.dtype = torch.float8_e4m3fn,
        device: torch.device | str = "cpu",
        k_scales: Sequence[torch.Tensor] | None = None,
        v_scales: Sequence[torch.Tensor] | None = None,
        backend: str = "auto",
    ) -> None:
        owner = "PagedKVCache"
        self.num_layers = _positive_int("num_layers", num_layers, owner)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads, owner)
        self.head_dim = _positive_int("head_dim", head_dim, owner)
        self.allocator = PageAllocator(num_pages, page_size, device)
        self.device = self.allocator.device
        if granularity not in GRANULARITIES:
            raise CacheUsageError(
                f"{owner}: granularity={granularity!r}; expected one of {GRANULARITIES}. "
                "Fix: pass the granularity kvquant.registry resolved for the model."
            )
        if kv_dtype not in FP8_DTYPES:
            raise CacheUsageError(
                f"{owner}: kv_dtype={kv_dtype}; expected torch.float8_e4m3fn or "
                "torch.float8_e5m2. Fix: pass one of those."
            )
        if backend not in BACKENDS:
            raise CacheUsageError(
                f"{owner}: backend={backend!r}; expected one of {BACKENDS}. Fix: pass 'auto'."
            )
        self.granularity = granularity
        self.kv_dtype = kv_dtype
        self.backend = backend
        shape = (self.allocator.num_pages, self.allocator.page_size, num_kv_heads, head_dim)
        self.k_pages = [
            torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_pages = [
            torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(num_layers)
        ]
        self.k_group_scales: list[torch.Tensor] = []
        self.v_group_scales: list[torch.Tensor] = []
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        self.group_size: int | None = None
        if granularity == "fp32-group":
            if k_scales is not None or v_scales is not None:
                raise CacheUsageError(
                    f"{owner}: k_scales/v_scales were given with granularity='fp32-group', "
                    "whose scales are computed on write. Fix: drop them, or pass "
                    "granularity='per-tensor' / 'per-head'."
                )
            g = min(64, head_dim) if group_size is None else group_size
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or head_dim % g:
                raise CacheUsageError(
                    f"{owner}: group_size={g!r} does not divide head_dim {head_dim}. "
                    "Fix: pass a group_size that divides the head dim (e.g. 32 or 64)."
                )
            self.group_size = g
            gshape = (*shape[:3], head_dim // g)
            self.k_group_scales = [
                torch.ones(gshape, dtype=torch.float32, device=self.device)
                for _ in range(num_layers)
            ]
            self.v_group_scales = [
                torch.ones(gshape, dtype=torch.float32, device=self.device)
                for _ in range(num_layers)
            ]
        else:
            if group_size is not None:
                raise CacheUsageError(
                    f"{owner}: group_size={group_size} was given with granularity="
                    f"{granularity!r}. Fix: drop group_size, or pass granularity='fp32-group'."
                )
            self.k_scales = self._static_scales("k_scales", k_scales)
            self.v_scales = self._static_scales("v_scales", v_scales)

    def _static_scales(
        self, name: str, scales: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        fix = "Fix: pass the per-layer scales kvquant.registry resolved for the model."
        if scales is None or len(scales) != self.num_layers:
            found = "None" if scales is None else f"{len(scales)} tensors"
            raise ScaleFormatError(
                f"PagedKVCache: {name} is {found}; granularity {self.granularity!r} needs one "
                f"scale per layer ({self.num_layers}). {fix}"
            )
        want = () if self.granularity == "per-tensor" else (self.num_kv_heads,)
        out = []
        for i, s in enumerate(scales):
            if not isinstance(s, torch.Tensor) or not s.is_floating_point():
                raise ScaleFormatError(
                    f"PagedKVCache: {name}[{i}] is not a floating-point tensor; expected fp32 "
                    f"shape {want}. {fix}"
                )
            if tuple(s.shape) != want:
                raise ScaleFormatError(
                    f"PagedKVCache: {name}[{i}] has shape {tuple(s.shape)}; expected {want} for "
                    f"granularity {self.granularity!r} with {self.num_kv_heads} KV heads. {fix}"
                )
            s32 = s.detach().to(device=self.device, dtype=torch.float32).clone()
            if not bool(torch.isfinite(s32).all()) or not bool((s32 > 0).all()):
                raise ScaleFormatError(
                    f"PagedKVCache: {name}[{i}] holds a zero, negative or non-finite value; "
                    f"expected positive finite dequantization multipliers. {fix}"
                )
            out.append(s32)
        return out

    # ------------------------------------------------------------ accessors
    @property
    def num_pages(self) -> int:
        """Pages per layer."""
        return self.allocator.num_pages

    @property
    def page_size(self) -> int:
        """Token slots per page."""
        return self.allocator.page_size

    def _layer(self, layer: int) -> int:
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise CacheUsageError(
                f"PagedKVCache: layer {layer!r} is out of range; the cache has "
                f"{self.num_layers} layers (0..{self.num_layers - 1}). Fix: pass the layer index."
            )
        return layer

    def scale_kwargs(self, layer: int) -> dict[str, torch.Tensor]:
        """The scale arguments of the kernels for ``layer`` (static or group scales)."""
        i = self._layer(layer)
        if self.group_size is not None:
            return {
                "k_group_scales": self.k_group_scales[i],
                "v_group_scales": self.v_group_scales[i],
            }
        return {"k_scale": self.k_scales[i], "v_scale": self.v_scales[i]}

    # ------------------------------------------------------------- kernels
    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Quantize new K/V of ``layer`` into its pages (:func:`kvquant.kernels.write_kv`).

        Args:
            layer: layer index.
            key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            slot_mapping: int64 ``[B, L]`` from :meth:`PageAllocator.reserve`.
        """
        i = self._layer(layer)
        write_kv(
            key,
            value,
            self.k_pages[i],
            self.v_pages[i],
            slot_mapping,
            backend=self.backend,
            **self.scale_kwargs(i),
        )

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        sm_scale: float | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``layer``'s pages (:func:`kvquant.kernels.paged_attention`).

        Args:
            layer: layer index.
            query: ``[B, Lq, Hq, D]`` fp16/bf16/fp32, any strides.
            block_tables: int32 ``[B, max_pages]`` from :meth:`PageAllocator.block_tables`.
            seq_lens: int32 ``[B]`` from :meth:`PageAllocator.seq_lens`.
            sm_scale: softmax scale; default ``head_dim ** -0.5``.
            **options: ``q_lens``, ``kv_start``, ``causal``, ``softcap``,
                ``window``, ``out`` (see :func:`~kvquant.kernels.paged_attention`).

        Returns:
            ``[B, Lq, Hq, D]`` in the query dtype.
        """
        i = self._layer(layer)
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        kwargs: dict[str, Any] = {"backend": self.backend, **self.scale_kwargs(i), **options}
        return paged_attention(
            query,
            self.k_pages[i],
            self.v_pages[i],
            block_tables,
            seq_lens,
            sm_scale=scale,
            **kwargs,
        )

    def reset(self) -> None:
        """Forget every sequence (pages keep stale bytes, unreachable until rewritten)."""
        self.allocator.reset()

    # ----------------------------------------------------------- accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held, over all layers: ``pages``, ``group_scales``, ``static_scales``, ``total``."""

        def nbytes(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        pages = nbytes(self.k_pages) + nbytes(self.v_pages)
        groups = nbytes(self.k_group_scales) + nbytes(self.v_group_scales)
        static = nbytes(self.k_scales) + nbytes(self.v_scales)
        return {
            "pages": pages,
            "group_scales": groups,
            "static_scales": static,
            "total": pages + groups + static,
        }

    @property
    def nbytes(self) -> int:
        """Total bytes of pages and scales over all layers."""
        return self.memory_bytes()["total"]

    def bytes_per_token(self) -> float:
        """Bytes per token slot over all layers (K + V payload and group scales)."""
        m = self.memory_bytes()
        return (m["pages"] + m["group_scales"]) / (self.num_pages * self.page_size)
