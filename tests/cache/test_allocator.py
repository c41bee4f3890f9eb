"""PageAllocator's fast paths: :meth:`PageAllocator.reserve` (slots from
:func:`kvquant.kernels.slot_mapping` for ragged counts), :meth:`PageAllocator.reserve_pages`
and the block tables it keeps, against the page lists they must match.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvquant.cache import PageAllocator
from kvquant.errors import CacheCapacityError, CacheUsageError


def _expected_slots(alloc: PageAllocator, ids: list[int], olds: list[int], counts: list[int]):
    width = max(counts, default=0)
    rows = []
    for sid, old, n in zip(ids, olds, counts, strict=True):
        pages = alloc.pages(sid)
        row = [
            pages[p // alloc.page_size] * alloc.page_size + p % alloc.page_size
            for p in range(old, old + n)
        ]
        rows.append(row + [-1] * (width - n))
    return rows


@pytest.mark.parametrize("big", [False, True])
def test_reserve_slots_match_page_lists(big: bool) -> None:
    rng = random.Random(1 if big else 0)
    alloc = PageAllocator(num_pages=2000, page_size=4)
    ids = [0, 1, 2, 3]
    for _ in range(12):
        counts = [rng.randrange(0, 100 if big else 6) for _ in ids]
        olds = [alloc.seq_len(s) if s in alloc else 0 for s in ids]
        got = alloc.reserve(ids, counts)
        assert got.dtype == torch.int64 and got.shape == (4, max(counts))
        assert got.tolist() == _expected_slots(alloc, ids, olds, counts)
    # every slot is owned once
    slots = [p * 4 + o for s in ids for p in alloc.pages(s) for o in range(4)]
    assert len(slots) == len(set(slots))


def test_reserve_empty_and_zero_counts() -> None:
    alloc = PageAllocator(num_pages=4, page_size=4)
    assert alloc.reserve([], 3).shape == (0, 0)
    out = alloc.reserve([7, 8], 0)
    assert out.shape == (2, 0) and alloc.seq_len(7) == 0 and alloc.pages(7) == ()


def test_reserve_pages_returns_taken_pages_and_matches_reserve() -> None:
    a, b = PageAllocator(num_pages=16, page_size=4), PageAllocator(num_pages=16, page_size=4)
    for counts in ([3, 5], [1, 1], [1, 4], [0, 9]):
        before = [a.pages(s) if s in a else () for s in (0, 1)]
        taken = a.reserve_pages([0, 1], counts)
        b.reserve([0, 1], counts)
        for sid, old, new in zip((0, 1), before, taken, strict=True):
            assert a.pages(sid) == old + tuple(new)
            assert a.pages(sid) == b.pages(sid) and a.seq_len(sid) == b.seq_len(sid)
    assert a.block_tables([0, 1]).tolist() == b.block_tables([0, 1]).tolist()


def test_reserve_pages_all_or_nothing_and_errors() -> None:
    alloc = PageAllocator(num_pages=3, page_size=4)
    alloc.reserve_pages([0, 1], 4)
    state = (alloc.num_free_pages, alloc.pages(0), alloc.pages(1), alloc.seq_len(0))
    with pytest.raises(CacheCapacityError, match="reserve_pages"):
        alloc.reserve_pages([0, 1], 1)  # needs 2 pages, 1 free
    assert (alloc.num_free_pages, alloc.pages(0), alloc.pages(1), alloc.seq_len(0)) == state
    with pytest.raises(CacheUsageError, match="twice"):
        alloc.reserve_pages([0, 0], 1)
    with pytest.raises(CacheUsageError, match="new tokens"):
        alloc.reserve_pages([0, 1], -1)
    with pytest.raises(CacheUsageError, match="new tokens"):
        alloc.reserve([0, 1], [1, -2])
    with pytest.raises(CacheCapacityError):
        alloc.reserve([0, 1], 1)
    assert (alloc.num_free_pages, alloc.pages(0), alloc.pages(1), alloc.seq_len(0)) == state


def test_block_tables_follow_reservations_free_and_reset() -> None:
    alloc = PageAllocator(num_pages=8, page_size=2)
    alloc.reserve([0, 1], 1)
    t1 = alloc.block_tables([0, 1])
    alloc.reserve([0, 1], 1)  # same page: cached table reused
    assert alloc.block_tables([0, 1]) is t1
    alloc.reserve([0, 1], 1)  # new pages
    assert alloc.block_tables([0, 1]).tolist() == [list(alloc.pages(0)), list(alloc.pages(1))]
    alloc.free(0)
    alloc.reserve([1, 2], 3)
    assert alloc.block_tables([1, 2]).tolist()[1][: len(alloc.pages(2))] == list(alloc.pages(2))
    alloc.reset()
    alloc.reserve([5], 1)
    assert alloc.block_tables([5]).tolist() == [[0]]
