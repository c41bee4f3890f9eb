"""The newest tokens of each sequence at full precision beside the pages (:class:`RecentRing`).

Every token is still written to the pages; the ring keeps a copy of each sequence's newest
``R`` keys and values as the model produced them, position ``p`` in slot ``p % R`` of one
``[B, 2, R, Hkv, D]`` tensor (:class:`~kvquant.schemes.RecentTokens`), and the attention
reads those keys from the ring instead of their rounded slots. The ring is allocated once per
batch and written in place, so a CUDA graph captured on it stays valid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvquant.errors import CacheUsageError
from kvquant.kernels.write.naive import ring_copy
from kvquant.schemes import RecentTokens

__all__ = [
    "AUTO_RECENT_TOKENS",
    "MAX_RECENT_TOKENS",
    "RecentRing",
    "batch_rows",
    "check_recent_tokens",
    "recent_tokens_of",
]

MAX_RECENT_TOKENS = 1024
"""The largest ring (tokens per sequence) a storage keeps."""

AUTO_RECENT_TOKENS = 16
"""The ring's length that ``recent_tokens="auto"`` (the default) gives: most of the accuracy
a longer ring buys, for 16 tokens per sequence and layer in the model's dtype."""


def recent_tokens_of(value: int | str) -> int:
    """The ring's length an option value asks for: ``"auto"`` gives
    :data:`AUTO_RECENT_TOKENS`, an int itself (the option is checked before)."""
    return AUTO_RECENT_TOKENS if isinstance(value, str) and value == "auto" else int(value)


def check_recent_tokens(value: object, owner: str) -> int:
    """``value`` as the ring's length (0: none).

    Raises:
        CacheUsageError: not an int from 0 to :data:`MAX_RECENT_TOKENS`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheUsageError(
            f"{owner}: recent_tokens is {value!r}; expected an int from 0 to "
            f"{MAX_RECENT_TOKENS}. Fix: pass e.g. recent_tokens=16, or 0 for none."
        )
    if not 0 <= value <= MAX_RECENT_TOKENS:
        raise CacheUsageError(
            f"{owner}: recent_tokens is {value}; expected 0..{MAX_RECENT_TOKENS}. Fix: pass "
            "e.g. recent_tokens=16, or 0 for none."
        )
    return value


def batch_rows(
    owner: str, bsz: int, rows: tuple[int, int] | None, batch: int | None
) -> tuple[int, int, int]:
    """``(r0, r1, total)``: a side buffer's rows for a call of ``bsz`` rows that are rows
    ``rows`` of a batch of ``batch`` (a row group), or the whole batch (``rows`` None).

    Raises:
        CacheUsageError: ``rows`` is not a range of ``bsz`` rows inside the batch.
    """
    total = bsz if rows is None or batch is None else int(batch)
    r0, r1 = (0, bsz) if rows is None else rows
    if r1 - r0 != bsz or not 0 <= r0 < r1 <= total:
        raise CacheUsageError(
            f"{owner}: rows {rows} of a batch of {total} for keys of {bsz} rows; expected a "
            f"range of {bsz} rows inside the batch."
        )
    return r0, r1, total


class RecentRing:
    """The ring of one layer's newest ``length`` tokens per sequence.

    Attributes:
        length: ``R``, tokens per sequence.
        kv: ``[B, 2, R, Hkv, D]`` in the keys' dtype, allocated by the first :meth:`keep`
            (None before): keys in the pages' frame before any offset (``k @ rotation``),
            values as given.
    """

    def __init__(
        self, length: int, num_kv_heads: int, head_dim: int, device: torch.device, name: str
    ) -> None:
        self.length = length
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.name = name
        self.kv: torch.Tensor | None = None

    def buffer(self, rows: tuple[int, int] | None = None) -> RecentTokens | None:
        """The ring of all rows, or of rows ``r0 .. r1 - 1`` (a row group); None before filled."""
        if self.kv is None:
            return None
        return RecentTokens(self.kv if rows is None else self.kv[rows[0] : rows[1]])

    def _rows(
        self, bsz: int, dtype: torch.dtype, rows: tuple[int, int] | None, batch: int | None
    ) -> torch.Tensor:
        """The ring's rows for a call of ``bsz`` rows (allocating the batch's ring first)."""
        r0, r1, total = batch_rows(f"{self.name}: recent tokens", bsz, rows, batch)
        kv = self.kv
        if kv is None or kv.shape[0] != total or kv.dtype != dtype:
            shape = (total, 2, self.length, self.num_kv_heads, self.head_dim)
            kv = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv = kv
        return kv if (r0, r1) == (0, total) else kv[r0:r1]

    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        bsz, n = int(key.shape[0]), int(key.shape[1])
        want = (bsz, n, self.num_kv_heads, self.head_dim)
        if tuple(key.shape) != want or tuple(value.shape) != want:
            raise CacheUsageError(
                f"{self.name}: recent tokens: key {tuple(key.shape)} and value "
                f"{tuple(value.shape)}; expected {want}."
            )

    def keep(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        rotation: torch.Tensor | None,
        rows: tuple[int, int] | None = None,
        batch: int | None = None,
    ) -> None:
        """Copy the newest of positions ``start .. start + L - 1`` into the ring.

        Args:
            key: ``[B, L, Hkv, D]``.
            value: ``[B, L, Hkv, D]``.
            start: the position of the first of them.
            rotation: fp32 ``[D, D]`` the pages' K rotation, or None.
            rows: ``(r0, r1)``: the ``B`` rows given are rows ``r0 .. r1 - 1`` of a batch
                of ``batch`` rows (a row group); None: the call's rows are the batch.
            batch: the batch's rows when ``rows`` is given.

        Raises:
            CacheUsageError: shapes that do not match, or rows outside the batch.
        """
        self._check(key, value)
        n = int(key.shape[1])
        ring = self._rows(int(key.shape[0]), key.dtype, rows, batch)
        m = min(n, self.length)
        if m == 0:
            return
        pos = torch.arange(start + n - m, start + n, device=self.device)
        ring_copy(ring, key[:, n - m :], value[:, n - m :], pos % self.length, rotation)

    def step_buffer(self, key: torch.Tensor, value: torch.Tensor) -> RecentTokens:
        """The ring a decode step's write (``[B, 1, Hkv, D]``, :func:`kvquant.kernels.write_kv`'s
        ``recent``) copies its tokens into; the ring of the batch must exist.

        Raises:
            CacheUsageError: shapes that do not match, or no ring of this batch yet.
        """
        self._check(key, value)
        if self.kv is None or self.kv.shape[0] != key.shape[0]:
            raise CacheUsageError(
                f"{self.name}: a decode step's recent tokens before the ring of its batch was "
                "filled. Fix: run the prompt through the cache first (generate does)."
            )
        return RecentTokens(self.kv)

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: row ``b`` takes row ``rows[b]`` (in place)."""
        if self.kv is not None:
            self.kv.copy_(self.kv.index_select(0, rows.to(device=self.device, dtype=torch.long)))

    def overlay(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: tuple[int, int] | None,
        rotation: torch.Tensor | None,
    ) -> None:
        """Dense ``[B, T, Hkv, D]`` keys (the model's frame) and values of positions
        ``0 .. T - 1``: the newest ``min(R, T)`` replaced by the ring's, in place."""
        buf = self.buffer(rows)
        n = keys.shape[1]
        m = min(self.length, n)
        if buf is None or m == 0:
            return
        slots = torch.arange(n - m, n, device=self.device) % self.length
        k = buf.k[:, slots].float()
        if rotation is not None:
            k = k @ rotation.T
        keys[:, n - m :] = k.to(device=keys.device, dtype=keys.dtype)
        values[:, n - m :] = buf.v[:, slots].to(device=values.device, dtype=values.dtype)

    def truncate(
        self,
        tokens: int,
        stored: int,
        read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
        rotation: torch.Tensor | None,
    ) -> None:
        """Forget positions ``>= tokens`` of ``stored`` (crop, rollback).

        The ring must then hold positions ``tokens - R .. tokens - 1``; those older than
        the ring held (``< stored - R``) were overwritten, and are read back from the pages
        by ``read(lo, hi)`` (``[B, hi - lo, Hkv, D]`` keys and values of positions
        ``lo .. hi - 1``, rounded as the pages hold them).
        """
        if self.kv is None or tokens >= stored:
            return
        lo, hi = max(tokens - self.length, 0), min(tokens, max(stored - self.length, 0))
        if hi > lo:
            k, v = read(lo, hi)
            pos = torch.arange(lo, hi, device=self.device)
            ring_copy(self.kv, k, v, pos % self.length, rotation)
