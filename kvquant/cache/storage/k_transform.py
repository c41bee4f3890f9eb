"""Storage of the ``k-transform`` scheme: static per-head scales of K stored offset and rotated,
and the full-precision side buffer of each sequence's first tokens (:class:`KTransformStorage`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvquant.cache.storage.base import DequantArgs, SchemeArgs, nbytes
from kvquant.cache.storage.recent import batch_rows
from kvquant.cache.storage.static import StaticStorage
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.schemes import ORTHONORMAL_TOL, FirstTokens, KTransformScales, Scheme
from kvquant.types import MAX_FIRST_TOKENS

__all__ = ["KTransformStorage"]


class KTransformStorage(StaticStorage):
    """FP8 pages of K offset and rotated (``fp8((k @ R - c) / k_scale)``), per-head static scales.

    Attributes:
        k_scale: fp32 ``[Hkv]`` static scale of the transformed K, on the device.
        v_scale: like ``k_scale`` for V (not transformed).
        k_offset: fp32 ``[Hkv, D]`` on the device.
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
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (KTransformScales,)

    k_offset: torch.Tensor
    k_rotation: torch.Tensor | None

    def _scale_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads,)

    def _configure_transform(self, args: SchemeArgs) -> None:
        """Check the K transform once and keep fp32 copies on the device."""
        self.k_rotation = None
        self.first_k: torch.Tensor | None = None
        self.first_v: torch.Tensor | None = None
        self.first_lens: torch.Tensor | None = None
        self.first_start: torch.Tensor | None = None
        name, hkv, d = self.name, self.num_kv_heads, self.head_dim
        first_tokens = args.first_tokens
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
            ("k_offset", args.k_offset, (hkv, d)),
            ("k_rotation", args.k_rotation, (d, d)),
        ):
            if t is None:
                if label == "k_offset":
                    raise ScaleFormatError(
                        f"{name}: granularity {self.granularity!r} needs k_offset, fp32 {want}; got "
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

    @property
    def scheme(self) -> Scheme:
        tensors = [self.k_scale, self.v_scale, self.k_offset, self.k_rotation]
        return Scheme.unflatten(self.granularity, [self.first_tokens], tensors)

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        k = DequantArgs(static=self.k_scale, k_offset=self.k_offset, k_rotation=self.k_rotation)
        return k, DequantArgs(static=self.v_scale)

    def _scale_bytes(self) -> dict[str, int]:
        transform = nbytes(
            self.k_offset, self.k_rotation, self.first_k, self.first_v, self.first_lens,
            self.first_start,
        )  # fmt: skip
        return super()._scale_bytes() | {"k_transform": transform}

    def _describe(self) -> str:
        rot = "rotated" if self.k_rotation is not None else "no rotation"
        return f", {rot}, first_tokens={self.first_tokens}"

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

    def first_tensors(
        self,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(first_k, first_v, first_lens, first_start)``: the side buffer (None before filled)."""
        return self.first_k, self.first_v, self.first_lens, self.first_start

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
        r0, r1, total = batch_rows(f"{self.name}.keep_first", bsz, rows, batch)
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
