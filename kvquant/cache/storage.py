"""One layer's FP8 K/V pages: :class:`PagedLayerStorage` with its scales (static per-tensor or
per-head, dynamic ``fp32-group``, the ``k-transform``) and the kernel calls on them."""

from __future__ import annotations

from typing import Any

import torch

from kvquant.cache.allocator import MAX_PAGE_SIZE, MAX_PAGES, page_ids, positive_int
from kvquant.errors import CacheCapacityError, CacheUsageError, ScaleFormatError
from kvquant.kernels import (
    group_scale_storage,
    page_storage,
    paged_attention,
    write_kv,
)
from kvquant.kernels.backend import BACKENDS
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.kernels.validate import FP8_DTYPES, SCALE_MAX, SCALE_MIN
from kvquant.schemes import FirstTokens, Mask, Pages, Scheme
from kvquant.types import MAX_FIRST_TOKENS

__all__ = [
    "GRANULARITIES",
    "ORTHONORMAL_TOL",
    "PagedLayerStorage",
]


GRANULARITIES: tuple[str, ...] = ("per-tensor", "per-head", "fp32-group", "k-transform")
"""Scale granularities a :class:`PagedLayerStorage` stores."""

ORTHONORMAL_TOL = 1e-4
"""Largest ``|R R^T - I|`` element accepted for a K rotation (checked once, at construction)."""


def _static_scale(
    owner: str, label: str, scale: object, granularity: str, num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """Check one static scale and return an fp32 copy of it on ``device``."""
    fix = "Fix: pass the scales kvquant.registry resolved for the model."
    want = () if granularity == "per-tensor" else (num_kv_heads,)
    if scale is None:
        raise ScaleFormatError(
            f"{owner}: {label} is None; granularity {granularity!r} needs a static scale of "
            f"shape {want}. {fix}"
        )
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ScaleFormatError(
            f"{owner}: {label} is not a floating-point tensor; expected fp32 shape {want}. {fix}"
        )
    if tuple(scale.shape) != want:
        raise ScaleFormatError(
            f"{owner}: {label} has shape {tuple(scale.shape)}; expected {want} for "
            f"granularity {granularity!r} with {num_kv_heads} KV heads. {fix}"
        )
    # Values are checked on the host copy (a scale on the GPU is read once, here), so that
    # building a layer's storage inside a forward does not wait for the GPU.
    host = scale.detach()
    host = (host if host.device.type == "cpu" else host.cpu()).to(torch.float32)
    in_range = torch.isfinite(host) & (host >= SCALE_MIN) & (host <= SCALE_MAX)
    if not bool(in_range.all()):
        raise ScaleFormatError(
            f"{owner}: {label} holds a zero, negative, non-finite, subnormal or huge value; "
            f"expected finite dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}]. "
            f"{fix}"
        )
    if device.type == "cpu":
        return host.clone()
    return host.to(device=device, non_blocking=True)  # no stream sync from pinned memory


class PagedLayerStorage:
    """One attention layer's FP8 K/V pages and their scales, and the kernel calls on them.

    This is the single implementation of paged FP8 storage: the transformers
    cache layer (:class:`kvquant.integrations.hf.KVQuantLayer`) builds one on
    its first update. The storage knows nothing of sequences: callers pass the
    slot mapping, block tables and sequence lengths that an allocator or a
    :class:`SequenceBook` produced.

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
            optional ``k_rotation`` and ``first_tokens``).
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
        k_offset: ``k-transform`` only: fp32 ``[Hkv, D]`` per-channel K offset
            in the rotated frame (required). Copied to fp32 on ``device`` once.
        k_rotation: ``k-transform`` only: fp32 ``[D, D]`` orthonormal rotation
            (e.g. :func:`kvquant.kernels.hadamard`), or None. Checked to be
            orthonormal within :data:`ORTHONORMAL_TOL` once.
        first_tokens: ``k-transform`` only: the first visible tokens of each
            sequence attended from a full-precision side buffer (0..1024).
        pages: pages allocated by the caller instead of by the storage (a
            transformers continuous-batching cache lays every layer's pages out
            inside one buffer): ``{"k_pages": ..., "v_pages": ...}`` plus
            ``"k_group_scales"`` / ``"v_group_scales"`` for ``fp32-group``, in
            the logical shapes below (any strides with no two elements sharing
            memory). The storage writes into them in place and never replaces
            them (:meth:`grow` refuses); None: the storage allocates its own.

    Attributes:
        k_pages: FP8 ``[num_pages, page_size, Hkv, D]``.
        v_pages: FP8 ``[num_pages, page_size, Hkv, D]``, stored keys-fastest
            (:func:`kvquant.kernels.page_storage`).
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` for
            ``fp32-group`` (stored head-major: :func:`kvquant.kernels.group_scale_storage`),
            else None.
        v_group_scales: like ``k_group_scales``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` for static granularities, else None.
        v_scale: like ``k_scale``.
        group_size: ``G`` for ``fp32-group``, else None.
        k_offset: fp32 ``[Hkv, D]`` on the device (``k-transform``), else None.
        k_rotation: fp32 ``[D, D]`` on the device, or None.
        first_tokens: first visible tokens per sequence kept at full precision.
        first_k: ``[B, first_tokens, Hkv, D]`` side buffer of rotated keys
            (``k @ R``, no offset) in the keys' dtype, allocated by the first
            :meth:`keep_first`; None before.
        first_v: like ``first_k`` for the values (as given).
        first_lens: int32 ``[B]``: how many of each row's first tokens the side
            buffer holds (the kernels' ``first_lens``).
        first_start: int32 ``[B]``: the position of each row's first visible
            token (its ``kv_start``) when the buffer was filled.

    Raises:
        CacheUsageError: a bad size, granularity, group size, dtype or backend.
        ScaleFormatError: a missing or malformed static scale.

    Example:
        >>> import torch
        >>> from kvquant.cache import PageAllocator
        >>> alloc = PageAllocator(num_pages=4, page_size=16)
        >>> store = PagedLayerStorage(4, 16, num_kv_heads=2, head_dim=64,
        ...                           granularity="fp32-group", group_size=32, backend="torch")
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
    ) -> None:
        self.name = name
        self.num_pages = positive_int("num_pages", num_pages, name, MAX_PAGES)
        self.page_size = positive_int("page_size", page_size, name, MAX_PAGE_SIZE)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads, name)
        self.head_dim = positive_int("head_dim", head_dim, name)
        if granularity not in GRANULARITIES:
            raise CacheUsageError(
                f"{name}: granularity={granularity!r}; expected one of {GRANULARITIES}. "
                "Fix: pass the granularity kvquant.registry resolved for the model."
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
        self.group_size: int | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.k_group_scales: torch.Tensor | None = None
        self.v_group_scales: torch.Tensor | None = None
        self.k_offset: torch.Tensor | None = None
        self.k_rotation: torch.Tensor | None = None
        self.first_tokens = 0
        self.first_k: torch.Tensor | None = None
        self.first_v: torch.Tensor | None = None
        self.first_lens: torch.Tensor | None = None
        self.first_start: torch.Tensor | None = None
        self._check_transform(granularity, k_offset, k_rotation, first_tokens)
        shape = (self.num_pages, self.page_size, num_kv_heads, head_dim)
        if granularity == "fp32-group":
            if k_scale is not None or v_scale is not None:
                raise CacheUsageError(
                    f"{name}: {scale_names[0]}/{scale_names[1]} were given with "
                    "granularity='fp32-group', whose scales are computed on write. Fix: drop "
                    "them, or pass granularity='per-tensor' / 'per-head'."
                )
            g = min(64, head_dim) if group_size is None else group_size
            while group_size is None and head_dim % g:
                g //= 2
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or head_dim % g:
                divisors = [d for d in (8, 16, 32, 64, 128) if head_dim % d == 0] or [head_dim]
                raise CacheUsageError(
                    f"{name}: group_size={g!r} does not divide head_dim {head_dim}. "
                    f"Fix: pass a group_size that divides the head dim (e.g. one of {divisors})."
                )
            self.group_size = g
        else:
            if group_size is not None:
                raise CacheUsageError(
                    f"{name}: group_size={group_size} was given with granularity="
                    f"{granularity!r}. Fix: drop group_size, or pass granularity='fp32-group'."
                )
            self.k_scale = _static_scale(
                name, scale_names[0], k_scale, granularity, num_kv_heads, self.device
            )
            self.v_scale = _static_scale(
                name, scale_names[1], v_scale, granularity, num_kv_heads, self.device
            )
        self.external = pages is not None
        if pages is None:
            self._allocate(shape, kv_dtype)
        else:
            self._adopt(pages, shape, kv_dtype)

    def _check_transform(
        self,
        granularity: str,
        k_offset: torch.Tensor | None,
        k_rotation: torch.Tensor | None,
        first_tokens: int,
    ) -> None:
        """Check the K transform once and keep fp32 copies on the device."""
        name, hkv, d = self.name, self.num_kv_heads, self.head_dim
        if granularity != "k-transform":
            if k_offset is not None or k_rotation is not None or first_tokens:
                raise CacheUsageError(
                    f"{name}: k_offset / k_rotation / first_tokens were given with granularity="
                    f"{granularity!r}. Fix: pass granularity='k-transform' (the format they "
                    "belong to), or drop them."
                )
            return
        if isinstance(first_tokens, bool) or not isinstance(first_tokens, int):
            raise CacheUsageError(
                f"{name}: first_tokens is {first_tokens!r}; expected an int from 0 to "
                f"{MAX_FIRST_TOKENS}."
            )
        if not 0 <= first_tokens <= MAX_FIRST_TOKENS:
            raise CacheUsageError(
                f"{name}: first_tokens is {first_tokens}; expected 0..{MAX_FIRST_TOKENS}. Fix: "
                "pass the first_tokens of the checkpoint's K transform (1 is usual)."
            )
        fix = "Fix: pass the K transform kvquant.registry resolved for the model."
        for label, t, want in (
            ("k_offset", k_offset, (hkv, d)),
            ("k_rotation", k_rotation, (d, d)),
        ):
            if t is None:
                if label == "k_offset":
                    raise ScaleFormatError(
                        f"{name}: granularity 'k-transform' needs k_offset, fp32 {want}; got "
                        f"None. {fix}"
                    )
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ScaleFormatError(
                    f"{name}: {label} is not a floating-point tensor; expected fp32 {want}. {fix}"
                )
            if tuple(t.shape) != want:
                raise ScaleFormatError(
                    f"{name}: {label} has shape {tuple(t.shape)}; expected {want} ({hkv} KV "
                    f"heads, head_dim {d}). {fix}"
                )
            host = t.detach().to(device="cpu", dtype=torch.float32)
            if not bool(torch.isfinite(host).all()):
                raise ScaleFormatError(f"{name}: {label} holds a non-finite value. {fix}")
            if label == "k_rotation":
                err = float((host @ host.T - torch.eye(d)).abs().max())
                if err > ORTHONORMAL_TOL:
                    raise ScaleFormatError(
                        f"{name}: k_rotation is not orthonormal (max |R R^T - I| = {err:.3g}, "
                        f"expected <= {ORTHONORMAL_TOL:g}); the query would not be rotated "
                        "back exactly. Fix: pass kvquant.kernels.hadamard(head_dim), or None."
                    )
            if self.device.type == "cpu":
                copy = host.clone()
            else:  # no stream sync from pinned memory (kvquant.patch pins what it passes)
                copy = host.to(device=self.device, non_blocking=True)
            setattr(self, label, copy.contiguous())
        self.first_tokens = first_tokens

    def _allocate(self, shape: tuple[int, int, int, int], kv_dtype: torch.dtype) -> None:
        """Allocate the pages (and group scales); an allocation that fails raises, holding nothing."""
        n_groups = 0 if self.group_size is None else shape[3] // self.group_size
        nbytes = 2 * (shape[0] * shape[1] * shape[2]) * (shape[3] + 4 * n_groups)
        try:
            if n_groups:
                gshape = (*shape[:3], n_groups)
                self.k_group_scales = group_scale_storage(*gshape, device=self.device)
                self.v_group_scales = group_scale_storage(*gshape, device=self.device)
            self.k_pages, self.v_pages = page_storage(*shape, dtype=kv_dtype, device=self.device)
        except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
            self.k_group_scales = self.v_group_scales = None
            raise CacheCapacityError(
                f"{self.name}: allocating {shape[0]} pages of {shape[1]} slots ({nbytes} bytes "
                f"for K and V) on {self.device} failed ({type(err).__name__}). Fix: a smaller "
                "num_pages / max_cache_tokens, or a larger page budget on the device."
            ) from err

    def _adopt(
        self,
        pages: dict[str, torch.Tensor],
        shape: tuple[int, int, int, int],
        kv_dtype: torch.dtype,
    ) -> None:
        """Take the caller's page views (``pages=``), checked against the storage's geometry."""
        n_groups = 0 if self.group_size is None else shape[3] // self.group_size
        want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "k_pages": (shape, kv_dtype),
            "v_pages": (shape, kv_dtype),
        }
        if n_groups:
            gshape = (*shape[:3], n_groups)
            want.update(
                k_group_scales=(gshape, torch.float32), v_group_scales=(gshape, torch.float32)
            )
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
                or t.device != self.device
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
        g = f", G={self.group_size}" if self.group_size is not None else ""
        if self.granularity == "k-transform":
            rot = "rotated" if self.k_rotation is not None else "no rotation"
            g = f", {rot}, first_tokens={self.first_tokens}"
        return (
            f"PagedLayerStorage({self.num_pages}x{self.page_size} slots, Hkv={self.num_kv_heads}, "
            f"D={self.head_dim}, {self.granularity}{g}, {self.kv_dtype}, {self.device})"
        )

    @property
    def scheme(self) -> Scheme:
        """The layer's scale scheme (its tensors on the storage's device, checked at construction)."""
        tensors = [self.k_scale, self.v_scale]
        if self.group_size is not None:
            return Scheme.unflatten(self.granularity, [self.head_dim, self.group_size], [])
        if self.k_offset is not None:
            tensors += [self.k_offset, self.k_rotation]
            return Scheme.unflatten(self.granularity, [self.first_tokens], tensors)
        return Scheme.unflatten(self.granularity, [], tensors)

    @property
    def pages(self) -> Pages:
        """The pages (and group scales) as the kernels take them."""
        return Pages(self.k_pages, self.v_pages, self.k_group_scales, self.v_group_scales)

    # ------------------------------------------------------------- kernels
    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize new K/V into the pages (:func:`kvquant.kernels.write_kv`).

        All inputs are validated before anything is written.

        Args:
            key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
            slot_mapping: int64 ``[B, L]`` (e.g. from :meth:`PageAllocator.reserve`);
                negative slots are skipped.
        """
        write_kv(key, value, self.pages, slot_mapping, self.scheme, backend=self.backend)

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
            **mask: the :class:`~kvquant.schemes.Mask` fields (``q_lens``, ``kv_start``,
                ``causal``, ``softcap``, ``window``, ``sinks``).

        Returns:
            ``[B, Lq, Hq, D]`` in the query dtype.
        """
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        if first is None:
            first = self.first_buffer(mask.get("kv_start"), rows)
        return paged_attention(
            query, self.pages, block_tables, seq_lens, self.scheme, sm_scale=scale,
            mask=Mask(**mask), first=first, out=out, backend=self.backend,
        )  # fmt: skip

    # ------------------------------------------------------ first tokens
    def first_buffer(
        self, kv_start: torch.Tensor | None = None, rows: tuple[int, int] | None = None
    ) -> FirstTokens | None:
        """The side buffer as the kernels take it (:class:`~kvquant.schemes.FirstTokens`), or None.

        Args:
            kv_start: int ``[B]`` the attention call's first visible key per row
                (None: 0). A row whose buffer was filled for another start gets
                ``first_lens`` 0 (its keys are read from the pages), on the
                device, without a sync: the side buffer is never read for
                positions it does not hold.
            rows: ``(r0, r1)``: the call's rows are rows ``r0 .. r1 - 1`` of the side
                buffer (a row group); None: all rows.
        """
        fk, fv, fl, fs = self.first_k, self.first_v, self.first_lens, self.first_start
        if fk is None or fv is None or fl is None or fs is None:
            return None
        if rows is not None:
            r0, r1 = rows
            fk, fv, fl, fs = fk[r0:r1], fv[r0:r1], fl[r0:r1], fs[r0:r1]
        starts = torch.zeros_like(fs) if kv_start is None else kv_start.to(fs.device, fs.dtype)
        lens = torch.where(starts == fs, fl, torch.zeros_like(fl))
        return FirstTokens(fk, fv, lens)

    def keep_first(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        kv_start: torch.Tensor | None,
        rows: tuple[int, int] | None = None,
        batch: int | None = None,
    ) -> None:
        """Copy new tokens that fall in a row's first-token window into the side buffer.

        The window of row ``b`` is positions ``kv_start[b]`` ..
        ``kv_start[b] + first_tokens - 1`` (its first visible tokens; left
        padding comes before ``kv_start[b]``). Keys are stored rotated
        (``key @ k_rotation``, no offset), values as given, in the dtype of the
        first keys kept. A row whose ``kv_start`` changed after positions of its
        new window were already passed (a chunk that was all padding for it)
        keeps no first tokens: its keys are read from the pages, which the
        kernels handle exactly like any other key. The buffers are updated in
        place (a CUDA graph captured on them stays valid).

        Args:
            key: ``[B, L, Hkv, D]`` the keys of positions ``start .. start + L - 1``.
            value: ``[B, L, Hkv, D]``.
            start: the position of the first of them (tokens stored before).
            kv_start: int ``[B]`` first visible position per row, or None (0).
            rows: ``(r0, r1)``: the ``B`` rows given are rows ``r0 .. r1 - 1`` of a
                batch of ``batch`` rows (a row group); the buffers are the batch's,
                and only these rows change. None: the call's rows are the batch.
            batch: the batch's rows when ``rows`` is given.

        Raises:
            CacheUsageError: shapes that do not match the storage, or ``rows`` that
                do not match the call's rows and ``batch``.
        """
        nf = self.first_tokens
        if nf == 0 or key.shape[1] == 0:
            return
        bsz, n = int(key.shape[0]), int(key.shape[1])
        want = (bsz, n, self.num_kv_heads, self.head_dim)
        if tuple(key.shape) != want or tuple(value.shape) != want:
            raise CacheUsageError(
                f"{self.name}.keep_first: key {tuple(key.shape)} and value "
                f"{tuple(value.shape)}; expected {want}."
            )
        total = bsz if rows is None or batch is None else int(batch)
        r0, r1 = (0, bsz) if rows is None else rows
        if r1 - r0 != bsz or not 0 <= r0 < r1 <= total:
            raise CacheUsageError(
                f"{self.name}.keep_first: rows {rows} of a batch of {total} for keys of "
                f"{bsz} rows; expected a range of {bsz} rows inside the batch."
            )
        dev = self.device
        fk, fv, fl, fs = self.first_k, self.first_v, self.first_lens, self.first_start
        if fk is None or fv is None or fl is None or fs is None or fk.shape[0] != total:
            shape = (total, nf, self.num_kv_heads, self.head_dim)
            fk = torch.zeros(shape, dtype=key.dtype, device=dev)
            fv = torch.zeros(shape, dtype=value.dtype, device=dev)
            fl = torch.zeros(total, dtype=torch.int32, device=dev)
            fs = torch.full((total,), -1, dtype=torch.int32, device=dev)
            self.first_k, self.first_v, self.first_lens, self.first_start = fk, fv, fl, fs
        if (r0, r1) != (0, total):  # views: the writes below land in the batch's buffers
            fk, fv, fl, fs = fk[r0:r1], fv[r0:r1], fl[r0:r1], fs[r0:r1]
        ks = (
            torch.zeros(bsz, dtype=torch.int32, device=dev)
            if kv_start is None
            else kv_start.to(device=dev, dtype=torch.int32)
        )
        # rows whose window moved: restart it here, or give it up if it began before `start`
        moved = ks != fs
        fs.copy_(torch.where(moved, torch.where(ks >= start, ks, torch.full_like(ks, -1)), fs))
        fl.masked_fill_(moved, 0)
        enabled = fs >= 0
        end = int(torch.where(enabled, fs, torch.full_like(fs, -nf)).max()) + nf - start
        m = min(max(end, 0), n)
        if m > 0:
            pos = torch.arange(start, start + m, device=dev, dtype=torch.int32)
            idx = pos[None, :] - fs[:, None]  # [B, m]
            valid = (idx >= 0) & (idx < nf) & enabled[:, None]
            hit, cols = valid.nonzero(as_tuple=True)
            k = key[:, :m].to(dev)
            if self.k_rotation is not None:
                k = k.float() @ self.k_rotation
            slot = idx[hit, cols].long()
            fk[hit, slot] = k[hit, cols].to(fk.dtype)
            fv[hit, slot] = value[:, :m].to(dev)[hit, cols].to(fv.dtype)
        held = (start + n - fs).clamp(0, nf)
        fl.copy_(torch.where(enabled, held, torch.zeros_like(held)))

    def first_window_end(self) -> int:
        """One past the last position any row's first-token window covers (0: none yet).

        Reads ``first_start`` (one sync on a GPU); callers keep the result.
        """
        if self.first_start is None:
            return 0
        return int(self.first_start.max()) + self.first_tokens

    def reorder_first(self, rows: torch.Tensor) -> None:
        """Beam search: row ``b`` of the side buffer takes row ``rows[b]`` (in place)."""
        for t in (self.first_k, self.first_v, self.first_lens, self.first_start):
            if t is not None:
                t.copy_(t.index_select(0, rows.to(device=t.device, dtype=torch.long)))

    def truncate_first(self, tokens: int) -> None:
        """Forget the side-buffer tokens at positions ``>= tokens`` (crop, rollback)."""
        if self.first_lens is None or self.first_start is None:
            return
        keep = (tokens - self.first_start).clamp(min=0)
        self.first_lens.copy_(torch.minimum(self.first_lens, keep.int()))

    def reset_first(self) -> None:
        """Drop the side buffer (a new batch fills a new one)."""
        self.first_k = self.first_v = self.first_lens = self.first_start = None

    def _transform(self) -> dict[str, torch.Tensor]:
        if self.k_offset is None:
            return {}
        out = {"k_offset": self.k_offset}
        if self.k_rotation is not None:
            out["k_rotation"] = self.k_rotation
        return out

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
        for pages, static, groups, transform in (
            (self.k_pages, self.k_scale, self.k_group_scales, self._transform()),
            (self.v_pages, self.v_scale, self.v_group_scales, {}),
        ):
            full = dequantize_pages(
                pages[ids], static, None if groups is None else groups[ids], **transform
            )
            flat = full.reshape(bsz, used * self.page_size, self.num_kv_heads, self.head_dim)
            out.append(flat[:, :seq_len].to(dtype))
        return out[0], out[1]

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
        for t in (self.k_pages, self.v_pages, self.k_group_scales, self.v_group_scales):
            if t is not None:
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
        shape = (n, self.page_size, self.num_kv_heads, self.head_dim)
        kg, vg = self.k_group_scales, self.v_group_scales
        groups: tuple[torch.Tensor, torch.Tensor] | None = None
        try:
            k_pages, v_pages = page_storage(*shape, dtype=self.kv_dtype, device=self.device)
            if kg is not None and vg is not None:
                gshape = (*shape[:3], kg.shape[-1])
                groups = (
                    group_scale_storage(*gshape, device=self.device),
                    group_scale_storage(*gshape, device=self.device),
                )
        except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
            raise CacheCapacityError(
                f"{self.name}: growing the pages from {old} to {n} on {self.device} failed "
                f"({type(err).__name__}); the storage still holds every page it held. Fix: "
                "generate fewer tokens or sequences at once, or free memory on the device."
            ) from err
        k_pages[:old].copy_(self.k_pages)
        v_pages[:old].copy_(self.v_pages)
        self.k_pages, self.v_pages = k_pages, v_pages
        if groups is not None and kg is not None and vg is not None:
            groups[0][:old].copy_(kg)
            groups[1][:old].copy_(vg)
            self.k_group_scales, self.v_group_scales = groups
        self.num_pages = n

    # ----------------------------------------------------------- accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this layer holds on its device, K and V together.

        This is the number to compare with a dense cache (e.g. transformers'
        bf16 ``DynamicCache``): the whole pool, written or not.

        Returns:
            ``pages`` (FP8 K and V pages), ``group_scales`` (fp32, ``fp32-group``
            only), ``static_scales`` (fp32 ``k_scale`` / ``v_scale``),
            ``k_transform`` (``k-transform`` only: offset, rotation and the
            first-token side buffer) and ``total`` (their sum).
        """

        def nbytes(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        pages = nbytes(self.k_pages, self.v_pages)
        groups = nbytes(self.k_group_scales, self.v_group_scales)
        static = nbytes(self.k_scale, self.v_scale)
        transform = nbytes(
            self.k_offset, self.k_rotation, self.first_k, self.first_v, self.first_lens,
            self.first_start,
        )  # fmt: skip
        return {
            "pages": pages,
            "group_scales": groups,
            "static_scales": static,
            "k_transform": transform,
            "total": pages + groups + static + transform,
        }
