"""How a :class:`~kvquant.integrations.hf.cache_layer.KVQuantCache` sizes its page pools: the
first pool, growth in proportion to what is stored (bounded by bf16's bytes and the device's
free memory), the headroom before a decode graph is captured, and the release of old pools.
Why these rules: ``docs/dev/memory.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvquant.cache import (
    PageAllocator,
    SequenceBook,
    device_free_bytes,
    release_cached_blocks,
)
from kvquant.errors import CacheCapacityError, CacheUsageError

if TYPE_CHECKING:
    from kvquant.integrations.hf.cache_layer import KVQuantLayer

__all__ = [
    "GROWTH_HEADROOM",
    "GROWTH_MEMORY_SHARE",
    "RELEASE_AFTER_GROWTH_BYTES",
    "START_HEADROOM",
    "PoolSizing",
]

GROWTH_HEADROOM = 0.5
"""A cache without a size bound that must grow enlarges its pools to its need plus up to this
fraction of it (fewer copies, and fewer captures of a decode graph). Less where the byte bound
asks for it (:meth:`KVQuantCache.headroom_fraction`) or the device's free memory allows less."""

START_HEADROOM = 16
"""A new pool holds ``n + n // START_HEADROOM`` slots per sequence for a first update of ``n``
tokens: a short decode after a long prompt needs no growth (a copy of the pools at the moment
memory is tightest)."""

GROWTH_MEMORY_SHARE = 0.9
"""A growth takes at most this share of the memory the device can still hand out; a need that
does not fit is still tried without headroom (and fails with CacheCapacityError)."""

RELEASE_AFTER_GROWTH_BYTES = 256 * 2**20
"""A growth that frees at least this many bytes of old pools returns them to the device at once
(:func:`kvquant.cache.release_cached_blocks`) instead of leaving them in torch's cache, where
activations would split them (chunked prefill then ran out of memory with gigabytes free)."""


_CPU = torch.device("cpu")


class PoolSizing:
    """The pool-sizing part of :class:`~kvquant.integrations.hf.cache_layer.KVQuantCache` (a
    mixin: it reads the cache's book, layers and bounds, declared below)."""

    book: SequenceBook
    layers: list[Any]
    page_size: int
    num_pages_requested: int | None
    max_cache_tokens: int | None
    growable: bool
    model_name: str
    capacity_version: int
    decode_graph: Any
    length_hint: int | None

    # ------------------------------------------------------------------ the book's state

    @property
    def allocator(self) -> PageAllocator | None:
        """The shared :class:`~kvquant.cache.PageAllocator` (None before the first update)."""
        return self.book.allocator

    @property
    def batch_size_(self) -> int:
        """Sequences the cache holds (0 before the first update)."""
        return self.book.batch_size

    @property
    def reserved(self) -> int:
        """Token slots reserved per sequence (the first layer to reach a position reserves it)."""
        return self.book.reserved

    # ------------------------------------------------------------------ pool sizing

    def headroom_fraction(self) -> float:
        """The growth headroom, a fraction of the need: :data:`GROWTH_HEADROOM`, or less.

        After any growth the pools hold no more bytes than transformers' bf16
        ``DynamicCache`` of the same tokens, plus one page per sequence (the
        last page, partly filled): a layer's slot takes ``r`` of bf16's bytes
        per token (its :meth:`~kvquant.schemes.Scheme.slot_bytes`: ``1 / 2`` for
        FP8 pages with static scales, ``(1 + 4 / G) / 2`` with fp32 group
        scales), so the headroom is capped at ``0.9 / r - 1`` for the largest
        ``r`` (0 for very small groups).
        """
        ratio = 0.5  # FP8 / bf16 bytes per element (the 4-bit formats take less)
        for layer in self.layers:
            spec = getattr(layer, "spec", None)
            if spec is not None:  # bf16 K and V: 4 bytes per element of one head
                ratio = max(ratio, spec.slot_bytes() / (4.0 * spec.num_kv_heads * spec.head_dim))
        return max(0.0, min(GROWTH_HEADROOM, 0.9 / ratio - 1.0))

    def pool_shape(
        self, batch_size: int, device: torch.device, first_tokens: int = 0
    ) -> tuple[int, int]:
        """``(num_pages, page_size)`` of every layer's pool; creates the allocator on first use.

        With ``num_pages`` or ``max_cache_tokens`` the pool has that fixed size.
        Without them it starts with the pages ``first_tokens`` take (the length
        of the first update: the prompt, or the first chunk of a chunked
        prefill) plus a sixteenth of them (:data:`START_HEADROOM`; at least one
        page) per sequence, and grows on demand (:meth:`reserve_through`), so
        that the pages hold memory in proportion to what is stored, like
        transformers' ``DynamicCache``.
        """
        alloc = self.book.allocator
        if alloc is None:
            num_pages = self._first_pool_pages(batch_size, device, first_tokens)
            if num_pages < 1:
                raise CacheUsageError(
                    f"the kvquant cache needs at least one page; got num_pages={num_pages}. "
                    "Fix: pass a positive max_cache_tokens or num_pages."
                )
            alloc = self.book.open(num_pages, batch_size, device)
        return alloc.num_pages, self.page_size

    def _first_pool_pages(self, batch_size: int, device: torch.device, first_tokens: int) -> int:
        """Pages of the first pool (:meth:`pool_shape`'s rule) for a first update of
        ``first_tokens`` tokens per sequence."""
        if self.num_pages_requested is not None:
            return int(self.num_pages_requested)
        if self.max_cache_tokens is not None:
            return -(-int(self.max_cache_tokens) // self.page_size)
        tokens = max(first_tokens, self._hinted_tokens(batch_size, device))
        return batch_size * self._prompt_pages(tokens)

    def _prompt_pages(self, tokens: int) -> int:
        """Pages per sequence a prefill of ``tokens`` tokens sizes for: the tokens plus
        :data:`START_HEADROOM` of them (at least one page)."""
        slots = tokens + tokens // START_HEADROOM
        return max(1, -(-slots // self.page_size))

    def _hinted_tokens(self, batch_size: int, device: torch.device) -> int:
        """The call's :attr:`length_hint`, where the device can hold that many tokens per sequence
        (:data:`GROWTH_MEMORY_SHARE` of its free memory; unknown off CUDA: taken as given), else 0."""
        hint = self.length_hint
        if not hint:
            return 0
        free = device_free_bytes(device)
        need = batch_size * hint * self.slot_bytes()
        return hint if free is None or need <= free * GROWTH_MEMORY_SHARE else 0

    def slots_for(self, layer: KVQuantLayer, batch_size: int, new_tokens: int) -> torch.Tensor:
        """Slot mapping int64 ``[B, new_tokens]`` of positions ``layer.seq_len ...``, reserving pages.

        The first layer to reach a position reserves its pages for all layers
        (all-or-nothing, before any write); later layers reuse them
        (:meth:`kvquant.cache.SequenceBook.slots`).

        Raises:
            CacheCapacityError: too few free pages (nothing changes).
            KVQuantError: the batch size differs from the one the cache was built for.
        """
        storage = layer.storage
        device = storage.device if storage is not None else _CPU
        book = self.book
        start = book.layer_lens[layer.layer_idx]
        memo = book._slot_memo
        if memo is not None and memo[0] == book.slot_key(start, new_tokens, device):
            return memo[1]
        self.pool_shape(batch_size, device)
        if batch_size != book.rows_in_view:
            where = "" if book.window is None else f" (rows {book.window[0]}..{book.window[1] - 1})"
            raise CacheUsageError(
                f"{layer.spec.name}: the kvquant cache holds {book.rows_in_view} sequences"
                f"{where} but the update has batch size {batch_size}. Fix: use a fresh cache (or "
                "let generate create one) for a different batch size."
            )
        self.reserve_through(start + new_tokens, layer)
        return book.slots(start, new_tokens, device)

    def reserve_through(self, tokens: int, layer: KVQuantLayer) -> None:
        """Reserve pages so that every sequence holds ``tokens`` slots (no-op if it does).

        A growable cache enlarges its pools first when the free pages do not suffice.

        Raises:
            CacheCapacityError: too few free pages (nothing changes).
        """
        book = self.book
        if tokens <= book.reserved:
            return
        alloc = book.require_allocator()
        ps = self.page_size
        extra_pages = book.pages_needed(tokens)
        free = alloc.num_free_pages
        if extra_pages > free and self.growable:
            self._grow(alloc, *self._growth_need(tokens, book.batch_size, alloc.device))
            free = alloc.num_free_pages
        if extra_pages > free:
            capacity = alloc.num_pages * ps
            raise CacheCapacityError(
                f"kvquant cache of {self.model_name} is full: {book.batch_size} sequence(s) of "
                f"{book.reserved} tokens need {tokens - book.reserved} more each ({extra_pages} "
                f"more pages of {ps} tokens), but only {free} of {alloc.num_pages} pages are free "
                f"(capacity {capacity} token slots in all). Nothing was written. Fix: "
                "kvquant.patch(model, max_cache_tokens=...) or num_pages=... with a larger value, "
                "or generate fewer tokens (max_new_tokens)."
            )
        try:
            book.reserve_through(tokens)
        except CacheCapacityError as err:  # pragma: no cover - pre-checked above
            raise CacheCapacityError(f"kvquant cache of {self.model_name}: {err}") from err

    def _growth_need(
        self, tokens: int, batch_size: int, device: torch.device
    ) -> tuple[int, int | None]:
        """``(pages per sequence, wanted pages per sequence or None)`` of a growth to ``tokens``.

        A chunk of a longer prompt (:attr:`length_hint`) grows the pools for the
        whole prompt at once, with :meth:`_prompt_pages`' small headroom only: the
        prefill's remaining chunks need the memory for their activations, and a
        decode graph's headroom comes later (:meth:`ensure_decode_headroom`).
        Otherwise the growth takes :meth:`headroom_fraction` (None).
        """
        hint = self._hinted_tokens(batch_size, device)
        if hint > tokens:
            pages = self._prompt_pages(hint)
            return pages, pages
        return -(-tokens // self.page_size), None

    def ensure_decode_headroom(self, tokens: int) -> None:
        """Before a decode graph is captured: room for ``tokens`` per sequence and the headroom.

        A capture is tied to the page tensors; growing them later costs a new
        capture. A growable cache that cannot hold ``tokens`` plus
        :meth:`headroom_fraction` of them grows now (as far as the device's
        memory allows, :meth:`_grow`), so that the capture serves many steps; a
        cache with a size bound is left as it is.
        """
        alloc = self.allocator
        if not self.growable or alloc is None or self.batch_size_ < 1:
            return
        # at least one page more than the step needs (and so at least two pages in the pool: a
        # compiled step marks the page count dynamic, and torch.compile specialises a size of 1)
        ps = self.page_size
        want = max(int(tokens * (1.0 + self.headroom_fraction())), tokens + ps)
        if self.book.pages_per_sequence() * ps >= want:
            return
        target, _ = self._growth_target(alloc, -(-tokens // ps), -(-want // ps))
        if target <= alloc.num_pages:
            return  # no memory to spare for headroom: the steps grow the pools when they must
        freed = self._page_bytes()[0] * alloc.num_pages
        try:
            self._grow_layers(target)
        except CacheCapacityError:
            return  # headroom only (the step reserves what it needs): grown layers keep theirs
        alloc.grow(target)
        self.capacity_version += 1
        self.decode_graph = None
        self._release_old_pools(freed)

    def slot_bytes(self) -> int:
        """Bytes one token slot of one sequence takes in every layer together (K and V pages and
        their group scales), from the layers' geometry: known before any pool exists."""
        specs = (getattr(layer, "spec", None) for layer in self.layers)
        return sum(spec.slot_bytes() for spec in specs if spec is not None)

    def bytes_to_hold(self, batch: int, tokens: int, device: torch.device) -> int:
        """Bytes the pools will allocate on ``device`` when ``batch`` sequences come to hold
        ``tokens`` each: the first pool, or the growth, that update makes.

        The same rules as :meth:`pool_shape` and :meth:`reserve_through`
        (:attr:`length_hint` included); 0 when the pools already hold the
        pages. An estimate for the prefill's row groups (a growth's headroom
        depends on the free memory when it happens).
        """
        alloc = self.allocator
        if alloc is None:
            pages = self._first_pool_pages(batch, device, tokens)
        else:
            pages = alloc.num_pages
            if self.book.pages_needed(tokens) > alloc.num_free_pages and self.growable:
                per_seq, want = self._growth_need(tokens, batch, alloc.device)
                pages = max(pages, self._growth_target(alloc, per_seq, want)[0])
        storages = [getattr(layer, "storage", None) for layer in self.layers]
        have = min((s.num_pages if s is not None else 0 for s in storages), default=0)
        return max(0, pages - have) * self.page_size * self.slot_bytes()

    def _page_bytes(self) -> tuple[int, int]:
        """Bytes of one page in every layer together, and in the largest layer (pages and scales)."""
        total = largest = 0
        for layer in self.layers:
            storage = getattr(layer, "storage", None)
            if storage is None or storage.num_pages < 1:
                continue
            held = storage.memory_bytes()
            one = (held["pages"] + held["group_scales"]) // storage.num_pages
            total += one
            largest = max(largest, one)
        return total, largest

    def _growth_target(
        self, alloc: PageAllocator, pages_per_seq: int, want_per_seq: int | None = None
    ) -> tuple[int, int]:
        """``(target, minimum)`` pool sizes in pages for ``pages_per_seq`` pages per sequence.

        The minimum holds the need; the target ``want_per_seq`` pages per
        sequence (default: the need plus :meth:`headroom_fraction` of it), less
        where the device cannot hand out the bytes (the new pools, grown one
        layer at a time, and the old pool of the layer being copied).
        """
        bsz, ps = self.batch_size_, self.page_size
        minimum = bsz * pages_per_seq
        if want_per_seq is None:
            want_per_seq = -(-int(pages_per_seq * ps * (1.0 + self.headroom_fraction())) // ps)
        target = bsz * max(pages_per_seq, want_per_seq)
        device = self._device()
        free = None if device is None else device_free_bytes(device)
        if free is not None and target > minimum:
            per_page, largest = self._page_bytes()
            if per_page > 0:
                room = int(free * GROWTH_MEMORY_SHARE) - largest * alloc.num_pages
                affordable = alloc.num_pages + max(0, room) // per_page
                target = max(minimum, min(target, affordable // bsz * bsz))
        return target, minimum

    def _grow(
        self, alloc: PageAllocator, pages_per_seq: int, want_per_seq: int | None = None
    ) -> None:
        """Enlarge the pool so that every sequence can hold ``pages_per_seq`` pages (or more).

        The new size is ``want_per_seq`` pages per sequence, by default the need
        plus the headroom (both as :meth:`_growth_target` allows); if that fails for want of memory, the need alone is tried. The layers'
        page tensors grow first, one at a time (old and new pools of one layer
        coexist only for its copy); the allocator grows only once all of them
        did, so a failure (out of memory) leaves a cache that still holds every
        token it held.

        Raises:
            CacheCapacityError: not even the need fits on the device.
        """
        target, minimum = self._growth_target(alloc, pages_per_seq, want_per_seq)
        freed = self._page_bytes()[0] * alloc.num_pages
        try:
            self._grow_layers(target)
        except CacheCapacityError:
            if target == minimum:
                raise
            target = minimum  # layers already grown further keep their pages
            self._grow_layers(target)
        if target > alloc.num_pages:
            alloc.grow(target)
        self.capacity_version += 1
        self.decode_graph = None  # captured on the old pools
        self._release_old_pools(freed)

    def _release_old_pools(self, freed: int) -> None:
        """After a growth that freed ``freed`` bytes of old pools: return large ones to the device."""
        if freed >= RELEASE_AFTER_GROWTH_BYTES:
            release_cached_blocks(self._device())

    def _device(self) -> torch.device | None:
        """The device of the layers' pools (None before any pool exists)."""
        storages = (getattr(layer, "storage", None) for layer in self.layers)
        return next((s.device for s in storages if s is not None), None)

    def _grow_layers(self, num_pages: int) -> None:
        for layer in self.layers:
            storage = getattr(layer, "storage", None)
            if storage is not None and storage.num_pages < num_pages:
                storage.grow(num_pages)
