"""The base of one layer's FP8 K/V pages: :class:`PagedLayerStorage` (pages, allocation, growth,
copies, dense reads, accounting, write and attend through the scheme); one subclass per scheme
keeps its scales (:mod:`.static`, :mod:`.group`, :mod:`.k_transform`). Design: docs/dev/cache.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvquant.cache.allocator import MAX_PAGE_SIZE, MAX_PAGES, page_ids, positive_int
from kvquant.cache.storage.recent import RecentRing, check_recent_tokens
from kvquant.errors import CacheCapacityError, CacheUsageError
from kvquant.kernels import PlanCache, page_storage
from kvquant.kernels.backend import BACKENDS
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.kernels.validate import FP8_DTYPES
from kvquant.schemes import FirstTokens, Mask, Pages, RecentTokens, Scheme, scheme_names

__all__ = ["DequantArgs", "PagedLayerStorage", "SchemeArgs", "granularities", "nbytes"]

Shape = tuple[int, int, int, int]

_CLASSES: dict[str, type[PagedLayerStorage]] = {}

_NO_FIRST: tuple[None, None, None, None] = (None, None, None, None)


def granularities() -> tuple[str, ...]:
    """The words a :class:`PagedLayerStorage` stores, in the schemes' order (``scheme_names``)."""
    return tuple(word for word in scheme_names() if word in _CLASSES)


@dataclass(frozen=True)
class SchemeArgs:
    """The scheme's constructor arguments, as given (each storage class checks its own)."""

    group_size: int | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_offset: torch.Tensor | None
    k_rotation: torch.Tensor | None
    first_tokens: int
    scale_names: tuple[str, str]


@dataclass(frozen=True)
class DequantArgs:
    """What :func:`~kvquant.kernels.fp8.dequantize_pages` takes beside the pages of K or V."""

    static: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a == b
    return (a.index if a.index is not None else torch.cuda.current_device()) == (
        b.index if b.index is not None else torch.cuda.current_device()
    )


class PagedLayerStorage:
    """One attention layer's FP8 K/V pages and their scales, and the kernel calls on them.

    This is the single implementation of paged FP8 storage: the transformers
    cache layer (:class:`kvquant.integrations.hf.KVQuantLayer`) builds one on
    its first update. The storage knows nothing of sequences: callers pass the
    slot mapping, block tables and sequence lengths that an allocator or a
    :class:`SequenceBook` produced. ``PagedLayerStorage(...)`` builds the class
    of ``granularity``'s scheme (static, ``fp32-group``, ``k-transform`` or
    4-bit storage), which holds that scheme's scales.

    Pages are zero-filled and group scales one-filled when allocated (slots not
    yet written dequantize to 0).

    Args:
        num_pages: pages in the pool.
        page_size: token slots per page.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        granularity: ``"per-tensor"``, ``"per-head"`` (static ``k_scale`` /
            ``v_scale``), ``"fp32-group"`` (dynamic: one fp32 scale per token,
            KV head and group of ``group_size`` elements, computed on write) or
            ``"k-transform"`` (per-head static scales plus ``k_offset``, an
            optional ``k_rotation`` and ``first_tokens``), or a 4-bit format:
            ``"nvfp4"`` (``k_scale`` / ``v_scale`` are the global scales),
            ``"mxfp4"`` (no scale) or ``"fp8-k-nvfp4-v"`` (FP8 K scale, V global scale), or
            one of them with K in the k-transform's frame (``"k-transform-nvfp4"``,
            ``"k-transform-mxfp4"``, ``"k-transform-k-nvfp4-v"``: ``k_offset``, ``k_rotation``
            and ``first_tokens`` as for the ``k-transform``).
        group_size: ``G`` for ``fp32-group``; must divide ``head_dim``; default
            ``min(64, head_dim)``, halved until it divides ``head_dim`` (80 -> 16). Must
            be None for static granularities.
        k_scale: fp32 ``[]`` (per-tensor) or ``[Hkv]`` (per-head) K scale;
            None for ``fp32-group``. Copied to fp32 on ``device`` once.
        v_scale: like ``k_scale`` for V.
        kv_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        device: where the pages and scales live.
        backend: kernel backend for :meth:`write` / :meth:`attend`
            (``"auto"``, ``"triton"``, ``"torch"``).
        name: the owner named in error messages (e.g. a module path).
        scale_names: how error messages call ``k_scale`` and ``v_scale``.
        k_offset: a K transform's (the ``k-transform`` formats): fp32 ``[Hkv, D]``
            per-channel K offset in the rotated frame (required). Copied to fp32 on
            ``device`` once.
        k_rotation: ``k-transform``, ``fp32-group``, ``nvfp4`` or ``mxfp4``: fp32 ``[D, D]``
            orthonormal rotation of K (e.g. :func:`kvquant.kernels.hadamard`; but for the
            ``k-transform``, a power-of-two ``D >= 16``), or None. Checked to be orthonormal
            within :data:`ORTHONORMAL_TOL` once.
        first_tokens: a K transform's: the first visible tokens of each
            sequence attended from a full-precision side buffer (0..1024).
        recent_tokens: each sequence's newest tokens attended at full precision from a ring
            beside the pages (0..1024; 0: none), any scheme: every token is still written
            to the pages, and :meth:`keep_recent` copies the newest into the ring.
        pages: pages allocated by the caller instead of by the storage (a
            transformers continuous-batching cache lays every layer's pages out
            inside one buffer): ``{"k_pages": ..., "v_pages": ...}`` plus
            ``"k_group_scales"`` / ``"v_group_scales"`` for ``fp32-group``, in
            the logical shapes below (any strides with no two elements sharing
            memory). The storage writes into them in place and never replaces
            them (:meth:`grow` refuses); None: the storage allocates its own.
        plans: the :class:`~kvquant.kernels.PlanCache` that :meth:`write` and :meth:`attend`
            find their kernel plans in (a model's cache shares one among its layers, so a
            step's layers of one geometry share one attention plan); None: the storage's own.

    Attributes:
        k_pages: FP8 ``[num_pages, page_size, Hkv, D]``.
        v_pages: FP8 ``[num_pages, page_size, Hkv, D]``, stored keys-fastest
            (:func:`kvquant.kernels.page_storage`).
        granularity: the scheme's word.
        first_tokens: first visible tokens per sequence kept at full precision (a
            side buffer that only the ``k-transform`` keeps; 0 for the others).
        external: whether the pages belong to the caller (``pages=``).
        recent: the ring of the newest tokens (:class:`~kvquant.cache.storage.recent.RecentRing`),
            or None (``recent_tokens=0``).

    The scheme's own attributes (``k_scale`` / ``v_scale``, ``group_size`` and the
    group scales, the K transform and its first-token side buffer) are on the
    subclass of each scheme.

    Raises:
        CacheUsageError: a bad size, granularity, group size, dtype or backend.
        ScaleFormatError: a missing or malformed static scale.

    Example:
        >>> import torch
        >>> from kvquant.cache import PageAllocator
        >>> alloc = PageAllocator(num_pages=4, page_size=16)
        >>> store = PagedLayerStorage(4, 16, num_kv_heads=2, head_dim=64,
        ...                           granularity="fp32-group", group_size=32, backend="torch")
        >>> type(store).__name__
        'GroupStorage'
        >>> slots = alloc.reserve([0], 5)
        >>> store.write(torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 64), slots)
        >>> bt, lens = alloc.block_tables([0]), alloc.seq_lens([0])
        >>> store.attend(torch.randn(1, 5, 4, 64), bt, lens).shape
        torch.Size([1, 5, 4, 64])
        >>> store.dense(bt, 5)[0].shape
        torch.Size([1, 5, 2, 64])
        >>> store.memory_bytes()["total"]  # 2 x (4*16*2*64 fp8 + 4*16*2*2 fp32)
        18432
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = ()
    """The schemes a subclass stores (their words name it in :meth:`class_for`)."""
    pool_names: ClassVar[tuple[str, ...]] = ("k_pages", "v_pages")
    """The page-shaped tensors the storage keeps (copied, grown and adopted together)."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    first_tokens: int = 0
    """First visible tokens per sequence kept at full precision (0 but for the k-transform)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for scheme in cls.__dict__.get("schemes", ()):
            _CLASSES[scheme.name] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> PagedLayerStorage:
        if cls is PagedLayerStorage and "granularity" in kwargs:
            cls = cls.class_for(kwargs["granularity"], kwargs.get("name", "PagedLayerStorage"))
        return super().__new__(cls)

    @staticmethod
    def class_for(granularity: str, owner: str = "PagedLayerStorage") -> type[PagedLayerStorage]:
        """The storage class of ``granularity`` (the one place a word picks a class).

        Raises:
            CacheUsageError: a word no storage class stores.
        """
        cls = _CLASSES.get(granularity) if isinstance(granularity, str) else None
        if cls is None:
            raise CacheUsageError(
                f"{owner}: granularity={granularity!r}; expected one of {granularities()}. "
                "Fix: pass the granularity kvquant.registry resolved for the model."
            )
        return cls

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        granularity: str,
        group_size: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        kv_dtype: torch.dtype = torch.float8_e4m3fn,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        name: str = "PagedLayerStorage",
        scale_names: tuple[str, str] = ("k_scale", "v_scale"),
        k_offset: torch.Tensor | None = None,
        k_rotation: torch.Tensor | None = None,
        first_tokens: int = 0,
        pages: dict[str, torch.Tensor] | None = None,
        plans: PlanCache | None = None,
        recent_tokens: int = 0,
    ) -> None:
        self.name = name
        self.plans = plans if plans is not None else PlanCache()
        self.num_pages = positive_int("num_pages", num_pages, name, MAX_PAGES)
        self.page_size = positive_int("page_size", page_size, name, MAX_PAGE_SIZE)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads, name)
        self.head_dim = positive_int("head_dim", head_dim, name)
        if self.class_for(granularity, name) is not type(self):
            words = tuple(s.name for s in type(self).schemes)
            raise CacheUsageError(
                f"{name}: granularity={granularity!r}; {type(self).__name__} stores {words}. "
                "Fix: build PagedLayerStorage(..., granularity=...), which picks the class."
            )
        if kv_dtype not in FP8_DTYPES:
            raise CacheUsageError(
                f"{name}: kv_dtype={kv_dtype}; expected torch.float8_e4m3fn or "
                "torch.float8_e5m2. Fix: pass one of those."
            )
        if backend not in BACKENDS:
            raise CacheUsageError(
                f"{name}: backend={backend!r}; expected one of {BACKENDS}. Fix: pass 'auto'."
            )
        self.granularity = granularity
        self.kv_dtype = kv_dtype
        self.backend = backend
        self.device = torch.device(device)
        n_recent = check_recent_tokens(recent_tokens, name)
        self.recent = (
            RecentRing(n_recent, self.num_kv_heads, self.head_dim, self.device, name)
            if n_recent
            else None
        )
        self._configure(
            SchemeArgs(
                group_size, k_scale, v_scale, k_offset, k_rotation, first_tokens, scale_names
            )
        )
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.external = pages is not None
        if pages is None:
            self._allocate(shape)
        else:
            self._adopt(pages, shape)

    # ------------------------------------------------------ the scheme's hooks
    def _configure(self, args: SchemeArgs) -> None:
        """Check the scheme's arguments once and keep its tensors (each subclass)."""
        raise NotImplementedError

    def _refuse_transform(self, args: SchemeArgs) -> None:
        """Refuse the K transform's arguments (every scheme but the ``k-transform``)."""
        if args.k_offset is not None or args.k_rotation is not None or args.first_tokens:
            raise CacheUsageError(
                f"{self.name}: k_offset / k_rotation / first_tokens were given with granularity="
                f"{self.granularity!r}. Fix: pass granularity='k-transform' (the format they "
                "belong to), or drop them."
            )

    def _pool_shapes(self, shape: Shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Logical shape and dtype of each tensor in :attr:`pool_names`."""
        return {"k_pages": (shape, self.kv_dtype), "v_pages": (shape, self.kv_dtype)}

    def _new_pools(self, shape: Shape) -> dict[str, torch.Tensor]:
        """Fresh tensors for :attr:`pool_names` (pages zero-filled); raises RuntimeError on OOM."""
        k_pages, v_pages = page_storage(*shape, dtype=self.kv_dtype, device=self.device)
        return {"k_pages": k_pages, "v_pages": v_pages}

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        """The scales (group scales of pages ``ids``) and transform of K and of V."""
        raise NotImplementedError

    def _scale_bytes(self) -> dict[str, int]:
        """Bytes of the scheme's tensors by :meth:`memory_bytes` key (each subclass)."""
        return {}

    def _describe(self) -> str:
        """The scheme's part of ``repr`` after the granularity (``", G=32"``)."""
        return ""

    @property
    def scheme(self) -> Scheme:
        """The layer's scale scheme (its tensors on the storage's device, checked at construction)."""
        raise NotImplementedError

    @property
    def pages(self) -> Pages:
        """The pages (and group scales) as the kernels take them."""
        return Pages(self.k_pages, self.v_pages)

    # --------------------------------------------------------- allocation
    def _allocate(self, shape: Shape) -> None:
        """Allocate the pools; an allocation that fails raises, holding nothing."""
        specs = self._pool_shapes(shape)
        nbytes = sum(math.prod(s) * d.itemsize for s, d in specs.values())
        try:
            pools = self._new_pools(shape)
        except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
            raise CacheCapacityError(
                f"{self.name}: allocating {shape[0]} pages of {shape[1]} slots ({nbytes} bytes "
                f"for K and V) on {self.device} failed ({type(err).__name__}). Fix: a smaller "
                "num_pages / max_cache_tokens, or a larger page budget on the device."
            ) from err
        for key, t in pools.items():
            setattr(self, key, t)

    def _adopt(self, pages: dict[str, torch.Tensor], shape: Shape) -> None:
        """Take the caller's page views (``pages=``), checked against the storage's geometry."""
        want = self._pool_shapes(shape)
        if set(pages) != set(want):
            raise CacheUsageError(
                f"{self.name}: pages= names {sorted(pages)}; expected {sorted(want)} for "
                f"granularity {self.granularity!r}. Fix: pass one view per tensor the storage keeps."
            )
        for key, (wshape, wdtype) in want.items():
            t = pages[key]
            if (
                not isinstance(t, torch.Tensor)
                or tuple(t.shape) != wshape
                or t.dtype != wdtype
                or not _same_device(t.device, self.device)
            ):
                found = (
                    f"{tuple(t.shape)} {t.dtype} on {t.device}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise CacheUsageError(
                    f"{self.name}: pages[{key!r}] is {found}; expected {wshape} {wdtype} on "
                    f"{self.device}. Fix: lay the pages out with the storage's geometry."
                )
            setattr(self, key, t)

    def __repr__(self) -> str:
        return (
            f"PagedLayerStorage({self.num_pages}x{self.page_size} slots, Hkv={self.num_kv_heads}, "
            f"D={self.head_dim}, {self.granularity}{self._describe()}, {self.kv_dtype}, "
            f"{self.device})"
        )

    # ------------------------------------------------------------- kernels
    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        step_pos: torch.Tensor | None = None,
    ) -> None:
        """Quantize new K/V into the pages (:func:`kvquant.kernels.write_kv`).

        All inputs are validated before anything is written (the structure once per plan,
        :attr:`plans`).

        Args:
            key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            slot_mapping: int64 ``[B, L]`` (e.g. from :meth:`PageAllocator.reserve`);
                negative slots are skipped.
            step_pos: a decode step's position (int64 ``[1]`` on the device, ``L == 1``): the
                same write also keeps the token in the ring of the newest tokens, if this
                storage keeps one (the FP8 kernel in the same launch; no sync). Other writes
                keep their newest tokens with :meth:`keep_recent`.

        Raises:
            CacheUsageError: ``step_pos`` before the ring of this batch was filled.
        """
        recent = None
        if step_pos is not None and self.recent is not None:
            recent = self.recent.step_buffer(key, value)
        self.plans.write_kv(
            key, value, self.pages, slot_mapping, self.scheme, backend=self.backend,
            recent=recent, recent_start=None if recent is None else step_pos,
        )  # fmt: skip

    def attend(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        sm_scale: float | None = None,
        rows: tuple[int, int] | None = None,
        out: torch.Tensor | None = None,
        first: FirstTokens | None = None,
        recent: RecentTokens | None = None,
        **mask: Any,
    ) -> torch.Tensor:
        """Attention of ``query`` over the pages (:func:`kvquant.kernels.paged_attention`).

        Args:
            query: ``[B, Lq, Hq, D]`` fp16/bf16/fp32, any strides.
            block_tables: int32 ``[B, max_pages]``.
            seq_lens: int32 ``[B]`` tokens stored per sequence, the ``Lq`` new ones included.
            sm_scale: softmax scale; default ``head_dim ** -0.5``.
            rows: ``(r0, r1)``: the call's ``B`` rows are rows ``r0 .. r1 - 1`` of the
                side buffer of first tokens (a row group of a larger batch); None: all.
            out: optional ``[B, Lq, Hq, D]`` output.
            first: first tokens of the call's rows (a caller's own side buffer), or None:
                with a K transform, the storage's side buffer once :meth:`keep_first` filled it
                (for the rows whose ``first_start`` is the call's ``kv_start``).
            recent: the newest tokens of the call's rows (a caller's own ring), or None:
                the storage's ring where it keeps one.
            **mask: the :class:`~kvquant.schemes.Mask` fields (``q_lens``, ``kv_start``,
                ``causal``, ``softcap``, ``window``, ``sinks``).

        Returns:
            ``[B, Lq, Hq, D]`` in the query dtype.
        """
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        if first is None:
            first = self.first_buffer(mask.get("kv_start"), rows)
        if recent is None and self.recent is not None:
            recent = self.recent.buffer(rows)
        return self.plans.paged_attention(
            query, self.pages, block_tables, seq_lens, self.scheme, sm_scale=scale,
            mask=Mask(**mask), first=first, out=out, backend=self.backend, recent=recent,
        )  # fmt: skip

    # ------------------------------------ the newest tokens (recent_tokens > 0)
    def key_rotation(self) -> torch.Tensor | None:
        """fp32 ``[D, D]`` the rotation K is stored under (the pages' frame), or None."""
        rotation = getattr(self, "k_rotation", None)
        return rotation if isinstance(rotation, torch.Tensor) else None

    def keep_recent(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        rows: tuple[int, int] | None = None,
        batch: int | None = None,
    ) -> None:
        """Copy the newest of new tokens into the ring (none kept: nothing to do); a decode
        step's write keeps its token itself (:meth:`write`'s ``step_pos``).

        Args:
            key: ``[B, L, Hkv, D]`` the keys of positions ``start .. start + L - 1``.
            value: ``[B, L, Hkv, D]``.
            start: the position of the first of them.
            rows: ``(r0, r1)``: the rows given are rows ``r0 .. r1 - 1`` of a batch of
                ``batch`` rows (a row group); None: the batch.
            batch: the batch's rows when ``rows`` is given.
        """
        if self.recent is not None:
            self.recent.keep(key, value, start, self.key_rotation(), rows, batch)

    def recent_kv(self) -> torch.Tensor | None:
        """The ring ``[B, 2, R, Hkv, D]`` (None: none kept, or not filled yet)."""
        return None if self.recent is None else self.recent.kv

    def overlay_recent(
        self, keys: torch.Tensor, values: torch.Tensor, rows: tuple[int, int] | None = None
    ) -> None:
        """Dense keys and values ``[B, T, Hkv, D]`` of positions ``0 .. T - 1`` (as
        :meth:`dense` reads them): the newest replaced by the ring's, as the attention reads
        them (in place; nothing without a ring). ``rows``: the ring's rows of a row group."""
        if self.recent is not None:
            self.recent.overlay(keys, values, rows, self.key_rotation())

    def reorder_recent(self, rows: torch.Tensor) -> None:
        """Beam search: row ``b`` of the ring takes row ``rows[b]``."""
        if self.recent is not None:
            self.recent.reorder(rows)

    def truncate_recent(self, tokens: int, stored: int, block_tables: torch.Tensor) -> None:
        """Forget positions ``>= tokens`` of the ``stored`` ones (crop, rollback): the ring
        then holds the newest before ``tokens``, read back from the pages where it had
        overwritten them (rounded, as the attention would read them from the pages)."""
        if self.recent is None:
            return

        def read(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            # only the pages that hold positions lo .. hi - 1
            ps = self.page_size
            p0, p1 = lo // ps, -(-hi // ps)
            table = block_tables[:, p0:p1]
            ids = page_ids(
                f"{self.name}.truncate_recent", "block_tables", table.reshape(-1),
                self.num_pages, self.device,
            )  # fmt: skip
            shape = (table.shape[0], (p1 - p0) * ps, self.num_kv_heads, self.head_dim)
            k, v = (x.reshape(shape)[:, lo - p0 * ps : hi - p0 * ps] for x in self._dequantize(ids))
            return k, v

        self.recent.truncate(tokens, stored, read, self.key_rotation())

    # --------------------------------- first tokens (kept by the k-transform only)
    def first_buffer(
        self, kv_start: torch.Tensor | None = None, rows: tuple[int, int] | None = None
    ) -> FirstTokens | None:
        """The first-token side buffer as the kernels take it; None: this scheme keeps none."""
        return None

    def first_tensors(
        self,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(first_k, first_v, first_lens, first_start)`` of the side buffer; all None here."""
        return _NO_FIRST

    def keep_first(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        kv_start: torch.Tensor | None,
        rows: tuple[int, int] | None = None,
        batch: int | None = None,
    ) -> None:
        """Keep new tokens in the first-token side buffer: nothing to keep for this scheme."""

    def first_window_end(self) -> int:
        """One past the last position a first-token window covers: 0, this scheme keeps none."""
        return 0

    def reorder_first(self, rows: torch.Tensor) -> None:
        """Beam search on the side buffer: nothing to reorder for this scheme."""

    def truncate_first(self, tokens: int) -> None:
        """Forget side-buffer tokens at positions ``>= tokens``: none for this scheme."""

    def reset_first(self) -> None:
        """Drop the side buffer: none for this scheme."""

    # ------------------------------------------------------ copies and views
    def dense(
        self, block_tables: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize the first ``seq_len`` tokens of every sequence (only the pages they use).

        With a K transform the keys are in the model's frame (``(code * s + c) @ R^T``),
        read from the pages (the first tokens' slots are written too).

        Args:
            block_tables: int32 ``[B, max_pages]``.
            seq_len: tokens per sequence (the same for every row).
            dtype: dtype of the result.

        Returns:
            ``(keys, values)``, each ``[B, seq_len, Hkv, D]`` in ``dtype`` (new tensors).

        Raises:
            CacheUsageError: a block table that is not a 2-D tensor, too narrow for
                ``seq_len``, or listing a page id outside the pool; a bad ``seq_len``.
        """
        if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
            found = (
                f"shape {tuple(block_tables.shape)}"
                if isinstance(block_tables, torch.Tensor)
                else f"a {type(block_tables).__name__}"
            )
            raise CacheUsageError(
                f"{self.name}.dense: block_tables is {found}; expected an int32 [batch, "
                "max_pages] tensor. Fix: pass the block table of the cache's allocator."
            )
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise CacheUsageError(
                f"{self.name}.dense: seq_len is {seq_len!r}; expected an int >= 0 (tokens per "
                "sequence)."
            )
        bsz = block_tables.shape[0]
        used = -(-seq_len // self.page_size)
        if used > block_tables.shape[1]:
            raise CacheUsageError(
                f"{self.name}: seq_len={seq_len} needs {used} pages per sequence but the block "
                f"table has {block_tables.shape[1]} columns. Fix: pass the block table of the "
                "sequences that hold these tokens."
            )
        ids = page_ids(
            f"{self.name}.dense", "block_tables", block_tables[:, :used].reshape(-1),
            self.num_pages, self.device,
        )  # fmt: skip
        out = []
        for full in self._dequantize(ids):
            flat = full.reshape(bsz, used * self.page_size, self.num_kv_heads, self.head_dim)
            out.append(flat[:, :seq_len].to(dtype))
        return out[0], out[1]

    def _dequantize(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of pages ``ids`` ``[N, page_size, Hkv, D]`` (model frame)."""
        k, v = (
            dequantize_pages(
                pages[ids], a.static, a.groups, k_offset=a.k_offset, k_rotation=a.k_rotation
            )
            for pages, a in zip((self.k_pages, self.v_pages), self._dequant_args(ids), strict=True)
        )
        return k, v

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Page ``dst[i]`` takes the contents of page ``src[i]`` (pages and group scales).

        Every source page is read before any page is written, so ``src`` and
        ``dst`` may overlap (beam-search reordering).

        Args:
            src: int ``[N]`` page ids to read.
            dst: int ``[N]`` page ids to overwrite.

        Raises:
            CacheUsageError: not integer tensors, different shapes, or a page id
                outside ``0..num_pages-1`` (nothing is copied).
        """
        op = f"{self.name}.copy_pages"
        s = page_ids(op, "src", src, self.num_pages, self.device)
        d = page_ids(op, "dst", dst, self.num_pages, self.device)
        if s.shape != d.shape or s.dim() != 1:
            raise CacheUsageError(
                f"{op}: src {tuple(s.shape)} and dst {tuple(d.shape)}; "
                "expected two 1-D tensors of the same length. Fix: pass flat page-id tensors."
            )
        for key in self.pool_names:
            t = getattr(self, key)
            t[d] = t[s]

    def grow(self, num_pages: int) -> None:
        """Enlarge the pools to ``num_pages`` pages, keeping every page's contents.

        New pages are zero-filled (group scales one-filled), as at allocation.
        The tensors are replaced: kernels captured in a CUDA graph on the old
        ones must be captured again. Old and new pools of this layer coexist
        only for the copy.

        Raises:
            CacheUsageError: ``num_pages`` is not larger than :attr:`num_pages`.
        """
        n = positive_int("num_pages", num_pages, self.name)
        if self.external:
            raise CacheUsageError(
                f"{self.name}.grow: the storage's pages belong to the caller (pages=), which sized "
                "them; it cannot enlarge them. Fix: build a larger pool where the pages come from."
            )
        if n <= self.num_pages:
            raise CacheUsageError(
                f"{self.name}.grow: num_pages={n} but the storage already holds "
                f"{self.num_pages} pages; expected more. Fix: pass a larger page count."
            )
        old = self.num_pages
        try:
            pools = self._new_pools((n, self.page_size, self.num_kv_heads, self.head_dim))
        except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
            raise CacheCapacityError(
                f"{self.name}: growing the pages from {old} to {n} on {self.device} failed "
                f"({type(err).__name__}); the storage still holds every page it held. Fix: "
                "generate fewer tokens or sequences at once, or free memory on the device."
            ) from err
        for key, t in pools.items():
            t[:old].copy_(getattr(self, key))
            setattr(self, key, t)
        self.num_pages = n

    # ----------------------------------------------------------- accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this layer holds on its device, K and V together.

        This is the number to compare with a dense cache (e.g. transformers'
        bf16 ``DynamicCache``): the whole pool, written or not.

        Returns:
            ``pages`` (FP8 or packed 4-bit K and V pages), ``group_scales`` (the scales
            stored per token beside the pages: fp32 groups of ``fp32-group``, a 4-bit
            format's block scales), ``recent`` (the ring of the newest tokens at full
            precision, ``recent_tokens``), ``static_scales`` (fp32 ``k_scale`` / ``v_scale``, a
            4-bit format's global scales),
            ``k_transform`` (``k-transform``: offset, rotation and the first-token side
            buffer; ``fp32-group``, ``nvfp4``, ``mxfp4``: their K rotation) and ``total``
            (their sum).
        """
        parts = {"pages": nbytes(self.k_pages, self.v_pages), "group_scales": 0}
        parts["recent"] = 0 if self.recent is None else nbytes(self.recent.kv)
        parts |= {"static_scales": 0, "k_transform": 0} | self._scale_bytes()
        return parts | {"total": sum(parts.values())}


def nbytes(*ts: torch.Tensor | None) -> int:
    """Bytes the tensors hold (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None)
