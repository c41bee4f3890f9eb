"""Fixed-size pages handed out to sequences: :class:`PageAllocator` turns "sequence ``s`` gets ``n``
more tokens" into slots, block tables and lengths, the index tensors the kernels consume."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from kvquant.errors import CacheCapacityError, CacheUsageError
from kvquant.kernels import (
    slot_mapping,
)

__all__ = [
    "MAX_PAGES",
    "MAX_PAGE_SIZE",
    "PageAllocator",
    "page_ids",
    "positive_int",
]


MAX_PAGES = 2**31 - 1
"""Most pages of a pool: block tables hold page ids as int32."""

MAX_PAGE_SIZE = 4096
"""Most token slots per page (16, 32 or 64 are typical; larger pages waste slots)."""


def positive_int(name: str, value: object, owner: str, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CacheUsageError(
            f"{owner}: {name} is {value!r}; expected a positive int. Fix: pass {name} >= 1."
        )
    if limit is not None and value > limit:
        raise CacheUsageError(
            f"{owner}: {name} is {value}; expected at most {limit}. Fix: pass {name} in 1..{limit}."
        )
    return value


def page_ids(
    owner: str, name: str, ids: object, num_pages: int, device: torch.device
) -> torch.Tensor:
    """Check page ids (an integer tensor, every value in ``0..num_pages-1``); int64 on ``device``.

    Reads the values (one sync on a GPU): a negative id would silently index from the end.
    """
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dtype
        in (
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    ):
        found = type(ids).__name__ if not isinstance(ids, torch.Tensor) else f"{ids.dtype} tensor"
        raise CacheUsageError(
            f"{owner}: {name} is a {found}; expected an integer tensor of page ids. Fix: pass "
            "page ids from the cache's block table."
        )
    out = ids.to(device=device, dtype=torch.long)
    if out.numel():
        lo, hi = (int(v) for v in torch.aminmax(out))
        if lo < 0 or hi >= num_pages:
            raise CacheUsageError(
                f"{owner}: {name} holds page ids {lo}..{hi}; expected 0..{num_pages - 1} (the "
                f"pool has {num_pages} pages). Nothing was changed. Fix: pass page ids from the "
                "cache's block table."
            )
    return out


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
        self.num_pages = positive_int("num_pages", num_pages, "PageAllocator", MAX_PAGES)
        self.page_size = positive_int("page_size", page_size, "PageAllocator", MAX_PAGE_SIZE)
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
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable):
            raise CacheUsageError(
                f"PageAllocator.{op}: seq_ids is a {type(seq_ids).__name__}; expected a sequence "
                "of sequence ids (one per row). Fix: pass e.g. [0, 1]."
            )
        ids = list(seq_ids)
        seen: set[Hashable] = set()
        for sid in ids:
            if not isinstance(sid, Hashable):
                raise CacheUsageError(
                    f"PageAllocator.{op}: sequence id {sid!r} is a {type(sid).__name__}, which "
                    "is not hashable; expected hashable ids (ints, strings, tuples)."
                )
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
        olds = self._take(ids, counts, "reserve")
        width = max(counts, default=0)
        if not ids or not width:
            return torch.full((len(ids), width), -1, dtype=torch.int64, device=self.device)
        base = self.block_tables(ids).to(device="cpu", dtype=torch.int64) * self.page_size
        pos = torch.tensor(olds, dtype=torch.int64)[:, None] + torch.arange(width)[None, :]
        valid = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        slots = slot_mapping(base, torch.where(valid, pos, torch.zeros_like(pos)), self.page_size)
        return torch.where(valid, slots, torch.full_like(slots, -1)).to(self.device)

    def reserve_pages(
        self, seq_ids: Sequence[Hashable], num_new_tokens: int | Sequence[int]
    ) -> list[list[int]]:
        """Reserve slots like :meth:`reserve`, without building the slot mapping.

        For callers that compute slots themselves (e.g. from a block table
        they keep on the device): only Python bookkeeping, no tensor.

        Args:
            seq_ids: ``B`` distinct sequence ids.
            num_new_tokens: one count for all sequences, or ``B`` counts.

        Returns:
            Per sequence, the page ids it took (in logical order, appended to
            its page list); empty where the last page had room.

        Raises:
            CacheCapacityError: too few free pages; nothing was changed.
            CacheUsageError: repeated ids or bad counts; nothing was changed.
        """
        ids = self._distinct(seq_ids, "reserve_pages")
        counts = self._counts(ids, num_new_tokens)
        before = [len(self._pages.get(sid, ())) for sid in ids]
        self._take(ids, counts, "reserve_pages")
        return [self._pages[sid][n:] for sid, n in zip(ids, before, strict=True)]

    def _take(self, ids: list[Hashable], counts: list[int], op: str) -> list[int]:
        """Take the pages ``counts`` more tokens need, all or nothing; return the old lengths."""
        page = self.page_size
        lens, pages = self._lens, self._pages
        olds = [lens.get(sid, 0) for sid in ids]
        needed = [
            max(0, -(-(old + n) // page) - len(pages.get(sid, ())))
            for sid, n, old in zip(ids, counts, olds, strict=True)
        ]
        total = sum(needed)
        free = self._free
        if total > len(free):
            raise CacheCapacityError(
                f"PageAllocator.{op}: {sum(counts)} new tokens for {len(ids)} sequences need "
                f"{total} new pages of {page} slots, but only {len(free)} of "
                f"{self.num_pages} pages are free; nothing was reserved. Fix: free finished "
                "sequences (PageAllocator.free), reserve for fewer sequences at once, or build "
                "the cache with more pages (num_pages)."
            )
        for sid, n, old, extra in zip(ids, counts, olds, needed, strict=True):
            plist = pages.get(sid)
            if plist is None:
                plist = pages[sid] = []
            for _ in range(extra):
                plist.append(free.pop())
            lens[sid] = old + n
        if total:
            self._version += 1
        return olds

    def _counts(self, ids: list[Hashable], num_new_tokens: int | Sequence[int]) -> list[int]:
        if isinstance(num_new_tokens, int) and not isinstance(num_new_tokens, bool):
            if num_new_tokens >= 0 or not ids:
                return [num_new_tokens] * len(ids)  # one valid count: no per-sequence checks
            counts = [num_new_tokens] * len(ids)
        else:
            bad = CacheUsageError(
                f"PageAllocator.reserve: num_new_tokens is {num_new_tokens!r} (a "
                f"{type(num_new_tokens).__name__}); expected an int >= 0 or one int per sequence. "
                "Fix: pass the number of new tokens (a Python int; int(t) for a tensor t)."
            )
            if isinstance(num_new_tokens, (str, bytes)) or not isinstance(num_new_tokens, Iterable):
                raise bad
            try:
                counts = list(num_new_tokens)
            except TypeError as exc:  # e.g. a 0-d tensor: iterable by type, not by value
                raise bad from exc
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

    def grow(self, num_pages: int) -> None:
        """Add pages: the pool holds ``num_pages`` from now on (the new ids are free).

        Page ids already handed out keep their meaning, so block tables and
        slot mappings built before stay valid; the page tensors of every layer
        must grow to ``num_pages`` too (:meth:`PagedLayerStorage.grow`).

        Raises:
            CacheUsageError: ``num_pages`` is not an int larger than :attr:`num_pages`.
        """
        n = positive_int("num_pages", num_pages, "PageAllocator.grow")
        if n <= self.num_pages:
            raise CacheUsageError(
                f"PageAllocator.grow: num_pages={n} but the pool already holds {self.num_pages} "
                "pages; expected more. Fix: pass a larger page count."
            )
        # Stack order: the lowest new id is handed out first, after the pages already free.
        self._free[:0] = range(n - 1, self.num_pages - 1, -1)
        self.num_pages = n

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq_id``; its pages past them become free.

        For rolling a sequence back (speculative decoding rejects draft tokens,
        a failed step is undone).

        Raises:
            CacheUsageError: ``seq_id`` is unknown, or ``num_tokens`` is not an
                int in ``0..seq_len(seq_id)``; nothing was changed.
        """
        self._known(seq_id, "truncate")
        have = self._lens[seq_id]
        if (
            isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not (0 <= num_tokens <= have)
        ):
            raise CacheUsageError(
                f"PageAllocator.truncate: sequence {seq_id!r} holds {have} tokens; num_tokens "
                f"is {num_tokens!r}, expected an int in 0..{have}. Fix: pass how many tokens to "
                "keep."
            )
        pages = self._pages.setdefault(seq_id, [])
        keep = -(-num_tokens // self.page_size)
        freed = pages[keep:]
        del pages[keep:]
        self._free.extend(reversed(freed))
        self._lens[seq_id] = num_tokens
        if freed:
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
