"""SequenceBook: the one owner of a batch's reservation, block tables, slots, lengths and static step."""

from __future__ import annotations

import random

import pytest
import torch

from kvquant.cache import PageAllocator, SequenceBook, StaticStep
from kvquant.errors import CacheCapacityError, CacheUsageError
from kvquant.kernels import compute_slot_mapping, slot_mapping

CPU = torch.device("cpu")


def _book(num_pages: int = 32, batch: int = 3, page: int = 4, layers: int = 2) -> SequenceBook:
    book = SequenceBook(num_layers=layers, page_size=page)
    book.open(num_pages, batch, CPU)
    return book


def _want_slots(alloc: PageAllocator, rows: int, start: int, n: int) -> list[list[int]]:
    ps = alloc.page_size
    return [
        [alloc.pages(r)[p // ps] * ps + p % ps for p in range(start, start + n)]
        for r in range(rows)
    ]


def test_slot_mapping_matches_the_kernels_helper() -> None:
    gen = torch.Generator().manual_seed(0)
    for page in (1, 4, 16):
        table = torch.randperm(64, generator=gen)[:24].reshape(3, 8).to(torch.int32)
        pos = torch.randint(0, 8 * page, (3, 5), generator=gen)
        want = compute_slot_mapping(table, pos, page)
        base = table.to(torch.int64) * page
        assert torch.equal(slot_mapping(base, pos, page), want)
        col = int(pos[0, 0])
        one = compute_slot_mapping(table, torch.full((3, 1), col), page)
        assert torch.equal(slot_mapping(base, col, page), one)


def test_reservation_tables_and_slots_follow_the_allocator() -> None:
    rng = random.Random(1)
    book = _book()
    alloc = book.allocator
    assert alloc is not None
    start = 0
    for _ in range(12):
        n = rng.choice([1, 1, 1, 2, 5])
        version = book.version
        book.reserve_through(start + n)
        whole = -(-(start + n) // 4) * 4  # rows reserve whole pages
        assert book.reserved == whole
        assert all(alloc.seq_len(r) == whole for r in range(3))
        bt = book.block_table(CPU)
        assert bt.dtype == torch.int32 and torch.equal(bt, alloc.block_tables([0, 1, 2]))
        assert (book.version != version) == (-(-(start + n) // 4) != -(-start // 4))
        slots = book.slots(start, n, CPU)
        assert slots.dtype == torch.int64 and slots.tolist() == _want_slots(alloc, 3, start, n)
        assert book.slots(start, n, CPU) is slots  # the layers of a step share it
        for layer in range(2):
            book.advance(layer, n)
        assert book.layer_lens == [start + n] * 2
        lens = book.lens(start + n, CPU)
        assert lens.tolist() == [start + n] * 3 and book.lens(start + n, CPU) is lens
        start += n


def test_capacity_error_changes_nothing() -> None:
    book = _book(num_pages=6, batch=3, page=4)
    book.reserve_through(5)  # 2 pages per row: the pool is full
    bt, version = book.block_table(CPU).clone(), book.version
    assert book.pages_needed(9) == 3 and book.pages_needed(8) == 0
    with pytest.raises(CacheCapacityError):
        book.reserve_through(9)
    assert book.reserved == 8 and book.version == version
    assert torch.equal(book.block_table(CPU), bt)
    assert book.allocator is not None and book.allocator.num_free_pages == 0


def test_truncate_reset_and_beam_moves() -> None:
    book = _book(num_pages=12, batch=2, page=4)
    book.reserve_through(10)
    book.advance(0, 10)
    book.advance(1, 9)
    alloc = book.allocator
    assert alloc is not None
    src, dst = book.beam_moves(torch.tensor([1, 1]), 10, CPU)
    bt = book.block_table(CPU)
    assert dst.tolist() == bt[:, :3].reshape(-1).tolist()
    assert src.tolist() == bt[[1, 1], :3].reshape(-1).tolist()
    old = book.slots(4, 1, CPU)
    version = book.version
    book.truncate(3)
    assert book.layer_lens == [3, 3] and book.reserved == 3 and book.version > version
    assert alloc.num_used_pages == 2 and book.block_table(CPU).shape == (2, 1)
    book.reserve_through(5)
    assert book.slots(4, 1, CPU).tolist() == _want_slots(alloc, 2, 4, 1)
    assert book.slots(4, 1, CPU) is not old
    book.reset()
    assert book.reserved == 0 and book.layer_lens == [0, 0] and alloc.num_used_pages == 0
    with pytest.raises(CacheUsageError, match="holds nothing"):
        SequenceBook(1, 4).block_table(CPU)


def test_static_step_is_the_book_on_the_device() -> None:
    book = _book(num_pages=24, batch=3, page=4)
    book.reserve_through(7)
    st = book.static_step(CPU)
    assert isinstance(st, StaticStep) and st.block_table.shape == (3, 8)
    starts = torch.tensor([0, 2, 1], dtype=torch.int32)
    for pos in range(7, 14):
        book.reserve_through(pos + 1)
        version = st.version
        book.load_static(st, pos, starts)
        assert (st.version != version) == (pos % 4 == 0 or version == -1)
        eager = book.slots(pos, 1, CPU)
        st.derive(book.page_size)
        assert torch.equal(st.slots, eager) and st.lens.tolist() == [pos + 1] * 3
        assert torch.equal(st.kv_start, starts)
        book.static = st
        try:
            assert book.block_table(CPU) is st.block_table
            assert book.slots(pos, 1, CPU) is st.slots and book.lens(pos + 1, CPU) is st.lens
        finally:
            book.static = None
        book.advance_all(1)
    assert book.layer_lens == [7, 7]  # advance_all on lengths that began at 0
    book.truncate(5)  # pages move: the static table is copied again before the next step
    version = st.version
    book.reserve_through(6)
    book.load_static(st, 5, starts)
    assert st.version != version
    assert torch.equal(st.block_table[:, :2], book.block_table(CPU))
    other = torch.tensor([3, 0, 0], dtype=torch.int32)  # another mask's starts: copied in
    book.load_static(st, 5, other)
    assert torch.equal(st.kv_start, other)
    book.load_static(st, 5, starts)
    assert torch.equal(st.kv_start, starts)


def test_row_window_serves_the_windows_rows_from_the_same_lengths() -> None:
    book = _book(num_pages=40, batch=5, page=4)
    alloc = book.allocator
    assert alloc is not None
    book.reserve_through(3)
    for layer in range(2):
        book.advance(layer, 3)
    book.reserve_through(9)  # the whole batch's positions, before the first group
    full_bt = book.block_table(CPU).clone()
    for r0, r1 in ((0, 2), (2, 4), (4, 5)):
        with book.row_window(r0, r1, [3, 3]):
            assert book.layer_lens == [3, 3] and book.rows_in_view == r1 - r0
            assert torch.equal(book.block_table(CPU), full_bt[r0:r1])
            n = 6
            want = [row for r, row in enumerate(_want_slots(alloc, 5, 3, n)) if r0 <= r < r1]
            slots = book.slots(3, n, CPU)
            assert slots.tolist() == want and book.slots(3, n, CPU) is slots
            assert book.slots(3, 1, CPU).tolist() == [row[:1] for row in want]
            assert book.lens(9, CPU).tolist() == [9] * (r1 - r0)
            for layer in range(2):
                book.advance(layer, n)
    assert book.window is None and book.rows_in_view == 5 and book.layer_lens == [9, 9]
    assert book.slots(3, 6, CPU).tolist() == _want_slots(alloc, 5, 3, 6)
    assert book.lens(9, CPU).shape == (5,)


def test_row_window_refuses_bad_rows_and_nesting() -> None:
    book = _book(num_pages=40, batch=3, page=4)
    for r0, r1 in ((1, 1), (-1, 2), (2, 4)):
        with pytest.raises(CacheUsageError, match=r"expected 0 <= r0 < r1 <= 3"):
            with book.row_window(r0, r1, [0, 0]):
                pass
    with pytest.raises(CacheUsageError, match="2 layers"):
        with book.row_window(0, 1, [0]):
            pass
    with book.row_window(0, 1, [0, 0]):
        with pytest.raises(CacheUsageError, match="already open"):
            with book.row_window(1, 2, [0, 0]):
                pass
    with pytest.raises(CacheUsageError, match="holds nothing"):
        with SequenceBook(1, 4).row_window(0, 1, [0]):
            pass
    assert book.window is None


def test_token_by_token_reservation_takes_the_allocator_once_per_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step's reservation inside a row's last page needs no allocator call."""
    book = _book(num_pages=12, batch=3, page=4)
    alloc = book.allocator
    assert alloc is not None
    calls = []
    real = alloc.reserve_pages
    monkeypatch.setattr(alloc, "reserve_pages", lambda *a: calls.append(a) or real(*a))
    for tokens in range(1, 13):
        book.reserve_through(tokens)
        assert book.pages_needed(tokens) == 0 and book.reserved >= tokens
    assert len(calls) == 3  # pages 1, 2, 3 of each row
    assert book.block_table(CPU).shape == (3, 3) and alloc.num_used_pages == 9
