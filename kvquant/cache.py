"""Paged FP8 KV storage: a page allocator, the batch bookkeeping, per-layer page tensors.

:class:`PageAllocator` hands out fixed-size pages to sequences and turns new
tokens into slots, block tables and lengths for :mod:`kvquant.kernels`.
:class:`SequenceBook` owns a batch's bookkeeping on top of it (reservation,
block tables, slots, lengths, :class:`StaticStep`, rollback, beams).
:class:`PagedLayerStorage` is one layer's FP8 K/V pages and scales, and the
kernel calls on them. Several layers share one allocator or book.

Layout: pages ``[num_pages, page_size, Hkv, D]``, slot ``= page * page_size +
offset``, block tables int32 ``[B, max_pages]``, sequence lengths int32 ``[B]``.

Imports torch and :mod:`kvquant.kernels` only (no transformers).
Design: docs/dev/cache.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvquant.errors import CacheCapacityError, CacheUsageError, ScaleFormatError
from kvquant.kernels import (
    group_scale_storage,
    page_storage,
    paged_attention,
    slot_mapping,
    write_kv,
)
from kvquant.kernels.backend import BACKENDS
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.kernels.validate import FP8_DTYPES, SCALE_MAX, SCALE_MIN
from kvquant.types import MAX_FIRST_TOKENS

__all__ = [
    "GRANULARITIES",
    "MAX_FIRST_TOKENS",
    "ORTHONORMAL_TOL",
    "PageAllocator",
    "PagedLayerStorage",
    "SequenceBook",
    "StaticStep",
    "device_free_bytes",
    "release_cached_blocks",
    "release_library_workspaces",
    "total_memory_bytes",
]

GRANULARITIES: tuple[str, ...] = ("per-tensor", "per-head", "fp32-group", "k-transform")
"""Scale granularities a :class:`PagedLayerStorage` stores."""

ORTHONORMAL_TOL = 1e-4
"""Largest ``|R R^T - I|`` element accepted for a K rotation (checked once, at construction)."""

MAX_PAGES = 2**31 - 1
"""Most pages of a pool: block tables hold page ids as int32."""

MAX_PAGE_SIZE = 4096
"""Most token slots per page (16, 32 or 64 are typical; larger pages waste slots)."""


def _positive_int(name: str, value: object, owner: str, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CacheUsageError(
            f"{owner}: {name} is {value!r}; expected a positive int. Fix: pass {name} >= 1."
        )
    if limit is not None and value > limit:
        raise CacheUsageError(
            f"{owner}: {name} is {value}; expected at most {limit}. Fix: pass {name} in 1..{limit}."
        )
    return value


def _page_ids(
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
        self.num_pages = _positive_int("num_pages", num_pages, "PageAllocator", MAX_PAGES)
        self.page_size = _positive_int("page_size", page_size, "PageAllocator", MAX_PAGE_SIZE)
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
        n = _positive_int("num_pages", num_pages, "PageAllocator.grow")
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


_EMPTY_BOOK = (
    "SequenceBook: the batch holds nothing yet (no pages: open() was not called; a kvquant cache "
    "opens its book on its first update). Fix: run a forward pass with the cache first, or call "
    "SequenceBook.open(num_pages, batch_size, device)."
)


@dataclass
class StaticStep:
    """Device tensors of a one-token decode step whose addresses never change.

    A CUDA graph of the decode step (:mod:`kvquant.integrations.hf.graphs`)
    replays kernels with the pointers it captured, so everything a step
    varies lives in these tensors and is refreshed in place before each
    replay (:meth:`SequenceBook.load_static`); everything derived from them is
    computed on the device inside the graph (:meth:`derive`). While a step
    runs, the book's ``static`` is this object: the cache layers write to
    ``slots`` and the attention reads ``block_table``, ``lens`` and
    ``kv_start`` (the book hands them out instead of its own tensors).

    Attributes:
        pos: int64 ``[1]``, position of the new token (tokens stored before the step).
        lens: int32 ``[B]``, ``pos + 1``.
        slots: int64 ``[B, 1]``, slot of the new token of each sequence.
        block_table: int32 ``[B, pages_per_sequence]``, the whole capacity of
            each sequence; columns past the book's table are not used yet.
        kv_start: int32 ``[B]``, first visible key (left padding).
        version: the :attr:`SequenceBook.version` of the table copied in (-1: none yet).
    """

    pos: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    kv_start: torch.Tensor
    version: int = field(default=-1)

    @classmethod
    def allocate(cls, batch: int, pages_per_sequence: int, device: torch.device) -> StaticStep:
        """Zeroed static tensors for ``batch`` sequences of ``pages_per_sequence`` pages."""
        return cls(
            pos=torch.zeros(1, dtype=torch.int64, device=device),
            lens=torch.zeros(batch, dtype=torch.int32, device=device),
            slots=torch.zeros(batch, 1, dtype=torch.int64, device=device),
            block_table=torch.zeros(batch, pages_per_sequence, dtype=torch.int32, device=device),
            kv_start=torch.zeros(batch, dtype=torch.int32, device=device),
        )

    def derive(self, page_size: int) -> None:
        """On the device: ``lens`` and ``slots`` of the token at ``pos`` (captured with the step)."""
        self.lens.copy_((self.pos + 1).expand_as(self.lens))
        base = self.block_table.to(torch.int64) * page_size
        self.slots.copy_(slot_mapping(base, self.pos.expand(self.slots.shape[0], 1), page_size))


class SequenceBook:
    """The batch bookkeeping of a paged cache: one owner for reservation, tables, slots and lengths.

    A batch of ``B`` rows (sequence ids ``0 .. B-1`` of one :class:`PageAllocator`)
    that grow in lockstep, as a transformers cache does (every position, left
    padding included, is stored for every row), stored by ``num_layers`` layers
    that share the pages' addresses (a token occupies the same slot in every
    layer) and update one after another inside a forward. The book holds:

    - the pages of each row and the free list (its :attr:`allocator`, created by
      :meth:`open`), and the tokens reserved per row (:attr:`reserved`, the
      allocator's length of every row);
    - each layer's stored length (:attr:`layer_lens`): the first layer to reach a
      position reserves its pages for all (:meth:`reserve_through`), later
      layers reuse them;
    - one block table per device (int32 ``[B, max_pages]``), appended to in
      place of a rebuild when the rows take pages in lockstep, and its
      ``* page_size`` base for slots; :attr:`version` counts their changes;
    - the slot mapping of a step (:meth:`slots`, memoised: every layer of a
      step gets the same tensor, from :func:`kvquant.kernels.slot_mapping`)
      and the lengths tensor (:meth:`lens`);
    - the static-step variant (:class:`StaticStep`): :meth:`static_step`
      allocates one for the whole capacity, :meth:`load_static` refreshes it
      before a step, and while :attr:`static` is set, :meth:`block_table`,
      :meth:`lens` and :meth:`slots` hand out its tensors;
    - rollback and crop (:meth:`truncate`), beam reordering (:meth:`beam_moves`)
      and :meth:`reset`;
    - a row window (:meth:`row_window`): a forward that runs the batch's rows a
      group at a time sees only the window's rows in the block table, slots
      and lengths, and every group starts from the same layer lengths.

    Who asks it, in the transformers integration: ``KVQuantCache.slots_for``
    (each layer's ``update``: reserve, then the step's slots), kvquant's
    attention function (``block_table``, ``lens``), the CUDA-graph runner
    (``static_step``, ``load_static``, ``advance_all``), and
    ``KVQuantCache.truncate`` / ``crop`` / ``reset`` / ``reorder_cache`` (the
    failed-forward rollback of :func:`kvquant.patch` goes through
    ``truncate``). Nothing else keeps a copy of a length or a table.

    The storage (:class:`PagedLayerStorage`, one per layer) knows nothing of
    sequences: it takes the slots, tables and lengths the book produces. The
    book knows nothing of transformers: pool sizing and growth policy belong
    to the cache that owns the storages (it grows them, then :attr:`allocator`).

    Args:
        num_layers: layers that store into the pages.
        page_size: token slots per page.

    Example:
        >>> book = SequenceBook(num_layers=2, page_size=4)
        >>> _ = book.open(num_pages=8, batch_size=2, device="cpu")
        >>> book.reserve_through(5)
        >>> book.slots(0, 5, torch.device("cpu")).tolist()
        [[0, 1, 2, 3, 4], [8, 9, 10, 11, 12]]
        >>> book.block_table(torch.device("cpu")).tolist(), book.reserved
        ([[0, 1], [2, 3]], 5)
    """

    def __init__(self, num_layers: int, page_size: int) -> None:
        self.page_size = _positive_int("page_size", page_size, "SequenceBook", MAX_PAGE_SIZE)
        self.allocator: PageAllocator | None = None
        self.batch_size = 0
        self.layer_lens = [0] * _positive_int("num_layers", num_layers, "SequenceBook")
        self.static: StaticStep | None = None
        self.version = 0
        self._rows: tuple[int, ...] = ()
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._bases: dict[torch.device, torch.Tensor] = {}
        self._slot_memo: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self._lens_memo: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self.window: tuple[int, int] | None = None

    def open(self, num_pages: int, batch_size: int, device: torch.device | str) -> PageAllocator:
        """The allocator of ``batch_size`` rows; created with ``num_pages`` on first use."""
        if self.allocator is None:
            self.allocator = PageAllocator(num_pages, self.page_size, device=device)
            self.batch_size = batch_size
            self._rows = tuple(range(batch_size))
        return self.allocator

    def require_allocator(self) -> PageAllocator:
        """The :attr:`allocator`; :class:`CacheUsageError` before :meth:`open`."""
        if self.allocator is None:
            raise CacheUsageError(_EMPTY_BOOK)
        return self.allocator

    # ------------------------------------------------------------- reservation
    @property
    def reserved(self) -> int:
        """Token slots reserved per row (0 before the first reservation)."""
        return 0 if self.allocator is None else self.allocator._lens.get(0, 0)

    def pages_needed(self, tokens: int) -> int:
        """Free pages :meth:`reserve_through` of ``tokens`` takes (0 if the rows hold them)."""
        ps = self.page_size
        return max(0, -(-tokens // ps) - -(-self.reserved // ps)) * self.batch_size

    def pages_per_sequence(self) -> int:
        """The most pages one row can hold (the pool split evenly over the batch)."""
        if self.allocator is None or self.batch_size < 1:
            raise CacheUsageError(_EMPTY_BOOK)
        return self.allocator.num_pages // self.batch_size

    def reserve_through(self, tokens: int) -> None:
        """Reserve pages so that every row holds ``tokens`` slots (no-op if it does).

        Raises:
            CacheCapacityError: too few free pages (nothing changes).
        """
        have = self.reserved
        if tokens <= have:
            return
        ps = self.page_size
        old_pages, new_pages = -(-have // ps), -(-tokens // ps)
        taken = self.require_allocator().reserve_pages(self._rows, tokens - have)
        if new_pages == old_pages:
            return  # no page changed hands: the tables stay valid
        self.version += 1
        self._bases.clear()
        if old_pages == 0 or any(len(t) != new_pages - old_pages for t in taken):
            self._tables.clear()  # rebuilt from the allocator on next use
            return
        # The rows grow in lockstep: append the new page columns on each device.
        cols = torch.tensor(taken, dtype=torch.int32)
        for dev, bt in list(self._tables.items()):
            self._tables[dev] = torch.cat([bt, cols.to(dev)], dim=1)

    # ------------------------------------------------------------- row window
    @property
    def rows_in_view(self) -> int:
        """Rows the tables, slots and lengths have: the open :meth:`row_window`'s, else the batch's."""
        if self.window is None:
            return self.batch_size
        return self.window[1] - self.window[0]

    @contextlib.contextmanager
    def row_window(self, r0: int, r1: int, layer_lens: Sequence[int]) -> Iterator[None]:
        """While the block runs, the book serves rows ``r0 .. r1 - 1`` of the batch only.

        For a forward that runs a batch's rows a group at a time (kvquant's row
        groups): :meth:`block_table`, :meth:`slots` and :meth:`lens` hand out
        the window's rows (views of the batch's tables), so the layers write to
        those rows' pages and attend over them. Every group stores the same
        positions, so the window starts from ``layer_lens`` (the lengths before
        the first group): after the last group the lengths are the advanced
        ones, as if the whole batch had run at once. Reservation, growth,
        :meth:`truncate` and :meth:`reset` still act on every row: reserve the
        whole batch's positions before the first group.

        Raises:
            CacheUsageError: the book is not open, a window or a static step is
                already open, the rows are not a range inside the batch, or
                ``layer_lens`` does not give one length per layer.
        """
        bsz = self.batch_size
        if self.allocator is None or bsz < 1:
            raise CacheUsageError(_EMPTY_BOOK)
        if self.window is not None or self.static is not None:
            raise CacheUsageError(
                f"SequenceBook.row_window({r0}, {r1}): a row window or a static step is already "
                "open. Fix: run one row group at a time, outside decode steps."
            )
        if not 0 <= r0 < r1 <= bsz:
            raise CacheUsageError(
                f"SequenceBook.row_window({r0}, {r1}): expected 0 <= r0 < r1 <= {bsz} (the batch "
                f"holds {bsz} rows)."
            )
        if len(layer_lens) != len(self.layer_lens):
            raise CacheUsageError(
                f"SequenceBook.row_window: {len(layer_lens)} layer lengths for "
                f"{len(self.layer_lens)} layers."
            )
        self.layer_lens = [int(n) for n in layer_lens]
        self.window = (r0, r1)
        self._slot_memo = self._lens_memo = None
        try:
            yield
        finally:
            self.window = None
            self._slot_memo = self._lens_memo = None

    def _view(self, table: torch.Tensor) -> torch.Tensor:
        """The window's rows of a ``[B, ...]`` tensor (all of them outside a window)."""
        if self.window is None:
            return table
        return table[self.window[0] : self.window[1]]

    def advance(self, layer_idx: int, tokens: int) -> None:
        """Layer ``layer_idx`` stored ``tokens`` more positions (reserved before)."""
        self.layer_lens[layer_idx] += tokens

    def advance_all(self, tokens: int) -> None:
        """Every layer stored ``tokens`` more positions (a static step of the whole model)."""
        self.layer_lens = [n + tokens for n in self.layer_lens]

    # ------------------------------------------------------------- tensors
    def _table(self, device: torch.device) -> torch.Tensor:
        bt = self._tables.get(device)
        if bt is None:
            host = self.require_allocator().block_tables(self._rows)
            bt = self._tables[device] = host.to(device=device, dtype=torch.int32)
        return bt

    def block_table(self, device: torch.device) -> torch.Tensor:
        """The int32 ``[B, max_pages]`` block table on ``device`` (read-only; a static step's own).

        Inside a :meth:`row_window`: the window's rows.
        """
        if self.static is not None:
            return self.static.block_table
        return self._view(self._table(device))

    def slots(self, start: int, new_tokens: int, device: torch.device) -> torch.Tensor:
        """int64 ``[B, new_tokens]`` slots of positions ``start ..`` (reserved before), memoised.

        The layers of a step share one tensor; a one-token step costs one
        slice and one add on the device. During a static step: its ``slots``;
        inside a :meth:`row_window`: the window's rows.
        """
        if self.static is not None:
            return self.static.slots
        key = self.slot_key(start, new_tokens, device)
        memo = self._slot_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        base = self._bases.get(device)
        if base is None:
            base = self._bases[device] = self._table(device).to(torch.int64) * self.page_size
        base = self._view(base)
        if new_tokens == 1:
            slots = slot_mapping(base, start, self.page_size)
        else:
            pos = torch.arange(start, start + new_tokens, device=device, dtype=torch.int64)
            slots = slot_mapping(base, pos.expand(base.shape[0], -1), self.page_size)
        self._slot_memo = (key, slots)
        return slots

    def slot_key(self, start: int, new_tokens: int, device: torch.device) -> tuple[Any, ...]:
        """The memo key of :meth:`slots` (the row window included)."""
        return (start, new_tokens, device, self.window)

    def lens(self, length: int, device: torch.device) -> torch.Tensor:
        """int32 ``[B]`` filled with ``length`` on ``device`` (memoised; a static step's ``lens``).

        Inside a :meth:`row_window`: one length per row of the window.
        """
        if self.static is not None:
            return self.static.lens
        key = (length, device, self.rows_in_view)
        memo = self._lens_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        lens = torch.full((self.rows_in_view,), length, dtype=torch.int32, device=device)
        self._lens_memo = (key, lens)
        return lens

    def static_step(self, device: torch.device) -> StaticStep:
        """A new :class:`StaticStep` spanning the whole capacity of every row.

        Its block table has at least two columns: a compiled step marks the
        width dynamic, and torch.compile specialises a dimension of size 1.
        """
        return StaticStep.allocate(self.batch_size, max(2, self.pages_per_sequence()), device)

    def load_static(self, step: StaticStep, pos: int, kv_start: torch.Tensor) -> None:
        """Before a static step at ``pos``: its table (copied when :attr:`version` changed), start."""
        if step.version != self.version:
            bt = self._table(step.block_table.device)
            step.block_table[:, : bt.shape[1]].copy_(bt)
            step.version = self.version
        step.pos.fill_(pos)
        step.kv_start.copy_(kv_start)

    # ------------------------------------------------------------- whole batch
    def beam_moves(
        self, beam_idx: torch.Tensor, tokens: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Beam search: flat ``(src, dst)`` page ids that give row ``b`` row ``beam_idx[b]``'s first ``tokens``."""
        dst = self._table(device)[:, : -(-tokens // self.page_size)].long()
        src = dst.index_select(0, beam_idx.to(dst.device).long())
        return src.reshape(-1), dst.reshape(-1)

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` positions of every row in every layer; free the pages past them."""
        self.layer_lens = [min(n, tokens) for n in self.layer_lens]
        alloc = self.allocator
        if alloc is not None and tokens < self.reserved:
            for row in self._rows:
                alloc.truncate(row, tokens)
            self._changed()
        self._slot_memo = self._lens_memo = None

    def reset(self) -> None:
        """Forget every stored token; all pages become free (the pool keeps its size)."""
        if self.allocator is not None:
            self.allocator.reset()
        self.layer_lens = [0] * len(self.layer_lens)
        self._changed()
        self._slot_memo = self._lens_memo = None

    def _changed(self) -> None:
        self.version += 1
        self._tables.clear()
        self._bases.clear()


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
        self.num_pages = _positive_int("num_pages", num_pages, name, MAX_PAGES)
        self.page_size = _positive_int("page_size", page_size, name, MAX_PAGE_SIZE)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads, name)
        self.head_dim = _positive_int("head_dim", head_dim, name)
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

    def scale_kwargs(self) -> dict[str, torch.Tensor]:
        """The scale keyword arguments of the kernels: static ``k_scale`` / ``v_scale`` or group scales."""
        if self.k_group_scales is not None and self.v_group_scales is not None:
            return {"k_group_scales": self.k_group_scales, "v_group_scales": self.v_group_scales}
        if self.k_scale is None or self.v_scale is None:  # pragma: no cover - set in __init__
            raise CacheUsageError(f"{self.name}: the storage has no scales")
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

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
        write_kv(
            key,
            value,
            self.k_pages,
            self.v_pages,
            slot_mapping,
            backend=self.backend,
            **self.scale_kwargs(),
            **self._transform_kwargs(),
        )

    def _transform_kwargs(self) -> dict[str, torch.Tensor]:
        if self.k_offset is None:
            return {}
        out = {"k_offset": self.k_offset}
        if self.k_rotation is not None:
            out["k_rotation"] = self.k_rotation
        return out

    def attend(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        sm_scale: float | None = None,
        rows: tuple[int, int] | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """Attention of ``query`` over the pages (:func:`kvquant.kernels.paged_attention`).

        Args:
            query: ``[B, Lq, Hq, D]`` fp16/bf16/fp32, any strides.
            block_tables: int32 ``[B, max_pages]``.
            seq_lens: int32 ``[B]`` tokens stored per sequence, the ``Lq`` new ones included.
            sm_scale: softmax scale; default ``head_dim ** -0.5``.
            rows: ``(r0, r1)``: the call's ``B`` rows are rows ``r0 .. r1 - 1`` of the
                side buffer of first tokens (a row group of a larger batch); None: all.
            **options: ``q_lens``, ``kv_start``, ``causal``, ``softcap``,
                ``window``, ``out`` (see :func:`~kvquant.kernels.paged_attention`).
                With a K transform the offset and rotation are added, and the
                side buffer of first tokens once :meth:`keep_first` filled it
                (for the rows whose ``first_start`` is the call's ``kv_start``).

        Returns:
            ``[B, Lq, Hq, D]`` in the query dtype.
        """
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            **self.scale_kwargs(),
            **self._transform_kwargs(),
            **self.first_kwargs(options.get("kv_start"), rows),
            **options,
        }
        return paged_attention(
            query, self.k_pages, self.v_pages, block_tables, seq_lens, sm_scale=scale, **kwargs
        )

    # ------------------------------------------------------ first tokens
    def first_kwargs(
        self, kv_start: torch.Tensor | None = None, rows: tuple[int, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """``first_k`` / ``first_v`` / ``first_lens`` for the kernels, once the side buffer exists.

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
            return {}
        if rows is not None:
            r0, r1 = rows
            fk, fv, fl, fs = fk[r0:r1], fv[r0:r1], fl[r0:r1], fs[r0:r1]
        starts = torch.zeros_like(fs) if kv_start is None else kv_start.to(fs.device, fs.dtype)
        lens = torch.where(starts == fs, fl, torch.zeros_like(fl))
        return {"first_k": fk, "first_v": fv, "first_lens": lens}

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
        ids = _page_ids(
            f"{self.name}.dense", "block_tables", block_tables[:, :used].reshape(-1),
            self.num_pages, self.device,
        )  # fmt: skip
        out = []
        for pages, static, groups, transform in (
            (self.k_pages, self.k_scale, self.k_group_scales, self._transform_kwargs()),
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
        s = _page_ids(op, "src", src, self.num_pages, self.device)
        d = _page_ids(op, "dst", dst, self.num_pages, self.device)
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
        n = _positive_int("num_pages", num_pages, self.name)
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


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes PyTorch can still allocate on a CUDA ``device``; None elsewhere.

    The driver's free memory plus what PyTorch's caching allocator holds but
    does not use, capped by ``torch.cuda.set_per_process_memory_fraction``.
    A sizing hint (fragmentation can make less usable): a cache that relies
    on it still handles an out-of-memory error.
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    avail = free + torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        fraction = float(get_fraction(device))
        if fraction < 1.0:
            avail = min(avail, int(fraction * total) - allocated)
    return max(0, avail)


def release_cached_blocks(device: torch.device | None) -> None:
    """Return the caching allocator's unused blocks to a CUDA ``device`` (no-op elsewhere).

    For a pool that grew: torch keeps the old page tensors' blocks cached, the
    next forward's activations split them, and one long-lived tensor placed in
    such a block keeps all of it from being released, so a later, larger pool
    fails for want of contiguous memory while enough is free. Released at once,
    the old blocks cannot be split.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def total_memory_bytes(storages: Iterable[PagedLayerStorage]) -> dict[str, int]:
    """:meth:`PagedLayerStorage.memory_bytes` summed over ``storages`` (same keys)."""
    total = dict.fromkeys(("pages", "group_scales", "static_scales", "k_transform", "total"), 0)
    for storage in storages:
        for key, value in storage.memory_bytes().items():
            total[key] += value
    return total


def release_library_workspaces() -> None:
    """Free the per-stream workspaces cuBLAS keeps (the warm-up stream's too), after a sync.

    For ``remove()`` of a patch that captured decode graphs: the warm-up stream's
    workspaces would otherwise stay allocated for the life of the process. cuBLAS
    allocates them again at its next call on a stream. No-op where torch has no
    such function or CUDA was never initialised.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    clear()
