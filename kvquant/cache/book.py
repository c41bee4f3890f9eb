"""A batch's bookkeeping over one allocator: :class:`SequenceBook` (reservation, device block
tables, slots, lengths, rollback, beams) and :class:`StaticStep`, the static decode step's tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvquant.cache.allocator import MAX_PAGE_SIZE, PageAllocator, positive_int
from kvquant.errors import CacheUsageError
from kvquant.kernels import (
    slot_mapping,
)

__all__ = [
    "SequenceBook",
    "StaticStep",
]


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
        start_source: the tensor ``kv_start`` was copied from (the next step that hands
            the same tensor skips the copy).
    """

    pos: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    kv_start: torch.Tensor
    version: int = field(default=-1)
    start_source: torch.Tensor | None = field(default=None)

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
        ([[0, 1], [2, 3]], 8)
    """

    def __init__(self, num_layers: int, page_size: int) -> None:
        self.page_size = positive_int("page_size", page_size, "SequenceBook", MAX_PAGE_SIZE)
        self.allocator: PageAllocator | None = None
        self.batch_size = 0
        self.layer_lens = [0] * positive_int("num_layers", num_layers, "SequenceBook")
        self.static: StaticStep | None = None
        self.version = 0
        self._rows: tuple[int, ...] = ()
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._bases: dict[torch.device, torch.Tensor] = {}
        self._slot_memo: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self._lens_memo: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self.window: tuple[int, int] | None = None

    @property
    def last_slots(self) -> torch.Tensor | None:
        """The slot mapping :meth:`slots` built last, which a step's layers share (None: none
        since the last change of the table)."""
        return None if self._slot_memo is None else self._slot_memo[1]

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
        """Token slots reserved per row (0 before the first reservation): whole pages."""
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

        Rows reserve whole pages (a page is a row's own once taken): the next
        tokens up to the page's end need no reservation, so most decode steps
        skip the allocator's per-row bookkeeping.

        Raises:
            CacheCapacityError: too few free pages (nothing changes).
        """
        have = self.reserved
        if tokens <= have:
            return
        ps = self.page_size
        old_pages, new_pages = -(-have // ps), -(-tokens // ps)
        taken = self.require_allocator().reserve_pages(self._rows, new_pages * ps - have)
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
        if kv_start is not step.start_source:
            step.kv_start.copy_(kv_start)
            step.start_source = kv_start

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
