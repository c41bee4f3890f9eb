"""PagedLayerStorage(..., recent_tokens=R): the ring of each sequence's newest tokens."""

from __future__ import annotations

import pytest
import torch

from kvquant.cache import PageAllocator
from kvquant.cache.storage import PagedLayerStorage
from kvquant.errors import CacheUsageError
from kvquant.kernels import hadamard, paged_attention_reference
from kvquant.schemes import RecentTokens

HKV, D = 2, 32


def _storage(granularity: str = "fp32-group", ring: int = 3, **kw: object) -> PagedLayerStorage:
    return PagedLayerStorage(
        16, 4, num_kv_heads=HKV, head_dim=D, granularity=granularity, backend="torch",
        recent_tokens=ring, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _kv(bsz: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(bsz, n, HKV, D, generator=g), torch.randn(bsz, n, HKV, D, generator=g)


def _fill(store: PagedLayerStorage, alloc: PageAllocator, chunks: list[int], bsz: int = 2):
    """Write ``chunks`` tokens at a time; the keys and values of every position."""
    keys, values, start = [], [], 0
    for i, n in enumerate(chunks):
        k, v = _kv(bsz, n, seed=i)
        store.write(k, v, alloc.reserve(list(range(bsz)), n))
        store.keep_recent(k, v, start)
        keys.append(k)
        values.append(v)
        start += n
    return torch.cat(keys, 1), torch.cat(values, 1)


@pytest.mark.parametrize("chunks", [[2], [7], [5, 1, 1], [1, 1, 1, 1]])
def test_the_ring_holds_each_position_in_its_slot(chunks: list[int]) -> None:
    store, alloc = _storage(ring=3), PageAllocator(16, 4)
    keys, values = _fill(store, alloc, chunks)
    ring = store.recent_kv()
    assert ring is not None and ring.shape == (2, 2, 3, HKV, D)
    total = sum(chunks)
    for p in range(max(0, total - 3), total):
        assert torch.equal(ring[:, 0, p % 3], keys[:, p])
        assert torch.equal(ring[:, 1, p % 3], values[:, p])
    assert store.memory_bytes()["recent"] == ring.numel() * 4


def test_keys_are_kept_in_the_pages_frame() -> None:
    """With a K rotation the ring holds ``k @ R`` (as the query is rotated alike)."""
    rot = hadamard(D)
    store, alloc = _storage(ring=4, k_rotation=rot), PageAllocator(16, 4)
    keys, values = _fill(store, alloc, [6])
    ring = store.recent_kv()
    assert ring is not None
    torch.testing.assert_close(ring[:, 0, 5 % 4], keys[:, 5] @ rot)
    assert torch.equal(ring[:, 1, 5 % 4], values[:, 5])


def test_attention_reads_the_newest_keys_from_the_ring() -> None:
    """``attend`` passes the ring: equal to the reference over the same pages and ring, and
    not to the pages alone."""
    store, alloc = _storage(ring=3), PageAllocator(16, 4)
    _fill(store, alloc, [9])
    bt, lens = alloc.block_tables([0, 1]), alloc.seq_lens([0, 1])
    q = torch.randn(2, 1, 4, D, generator=torch.Generator().manual_seed(5))
    got = store.attend(q, bt, lens)
    ring = RecentTokens(store.recent_kv())  # type: ignore[arg-type]
    ref = paged_attention_reference(
        q, store.pages, bt, lens, store.scheme, sm_scale=D**-0.5, recent=ring
    )
    pages_only = paged_attention_reference(q, store.pages, bt, lens, store.scheme, sm_scale=D**-0.5)
    torch.testing.assert_close(got, ref)
    assert float((got - pages_only).abs().max()) > 1e-4


def test_row_groups_fill_their_rows_of_the_batch_ring() -> None:
    store = _storage(ring=2)
    k, v = _kv(3, 5, seed=1)
    for r0, r1 in ((0, 2), (2, 3)):
        store.keep_recent(k[r0:r1], v[r0:r1], 0, rows=(r0, r1), batch=3)
    ring = store.recent_kv()
    assert ring is not None and ring.shape[0] == 3
    assert torch.equal(ring[:, 0, 4 % 2], k[:, 4]) and torch.equal(ring[:, 1, 3 % 2], v[:, 3])
    buf = store.recent.buffer((2, 3))  # type: ignore[union-attr]
    assert buf is not None and buf.kv.is_contiguous() and torch.equal(buf.kv, ring[2:3])
    with pytest.raises(CacheUsageError, match="rows \\(2, 4\\) of a batch of 3"):
        store.keep_recent(k[:2], v[:2], 0, rows=(2, 4), batch=3)


@pytest.mark.parametrize("granularity", ["fp32-group", "per-tensor"])
def test_a_decode_step_at_a_device_position(granularity: str) -> None:
    """A decode step's write (its position a device tensor) keeps the token in the ring in the
    same call; the other slots keep their tokens; the pages get the token too."""
    scales = {"k_scale": torch.tensor(0.05), "v_scale": torch.tensor(0.05)}
    kw = scales if granularity == "per-tensor" else {}
    store, alloc = _storage(granularity, ring=3, **kw), PageAllocator(16, 4)
    _fill(store, alloc, [4])
    ring = store.recent_kv()
    assert ring is not None
    before = ring.clone()
    k, v = _kv(2, 1, seed=9)
    slots = alloc.reserve([0, 1], 1)
    store.write(k, v, slots, step_pos=torch.tensor([4]))
    assert torch.equal(ring[:, 0, 4 % 3], k[:, 0]) and torch.equal(ring[:, 1, 4 % 3], v[:, 0])
    others = [s for s in range(3) if s != 4 % 3]
    assert torch.equal(ring[:, :, others], before[:, :, others])
    dense_k, dense_v = store.dense(alloc.block_tables([0, 1]), 5)
    torch.testing.assert_close(dense_k[:, 4], k[:, 0], rtol=0.07, atol=0.05)
    torch.testing.assert_close(dense_v[:, 4], v[:, 0], rtol=0.07, atol=0.05)
    fresh = _storage(granularity, ring=3, **kw)
    with pytest.raises(CacheUsageError, match="before the ring of its batch was filled"):
        fresh.write(k, v, slots, step_pos=torch.tensor([0]))


def test_truncate_reads_overwritten_positions_back_from_the_pages() -> None:
    """After a crop the ring holds the newest positions before the cut: those it still had
    exactly, the older ones (overwritten) as the pages hold them."""
    store, alloc = _storage(ring=3), PageAllocator(16, 4)
    keys, _ = _fill(store, alloc, [6, 4])  # 10 positions; the ring holds 7, 8, 9
    bt = alloc.block_tables([0, 1])
    store.truncate_recent(8, 10, bt)  # keep 8: the ring must hold 5, 6, 7
    ring = store.recent_kv()
    assert ring is not None
    assert torch.equal(ring[:, 0, 7 % 3], keys[:, 7])  # still held exactly
    dense_k, dense_v = store.dense(bt, 8)
    for p in (5, 6):  # overwritten by 8 and 9: read back, rounded
        assert torch.equal(ring[:, 0, p % 3], dense_k[:, p])
        assert torch.equal(ring[:, 1, p % 3], dense_v[:, p])
        assert not torch.equal(ring[:, 0, p % 3], keys[:, p])


def test_reorder_moves_rows() -> None:
    store, alloc = _storage(ring=2), PageAllocator(16, 4)
    keys, _ = _fill(store, alloc, [3])
    store.reorder_recent(torch.tensor([1, 1]))
    ring = store.recent_kv()
    assert ring is not None and torch.equal(ring[0, 0, 2 % 2], keys[1, 2])


@pytest.mark.parametrize(
    ("value", "match"),
    [(-1, "expected 0..1024"), (2000, "expected 0..1024"), (True, "expected an int"),
     ("4", "expected an int")],
)  # fmt: skip
def test_bad_ring_lengths_are_refused(value: object, match: str) -> None:
    with pytest.raises(CacheUsageError, match=match) as info:
        _storage(ring=value)  # type: ignore[arg-type]
    assert "Fix:" in str(info.value)


def test_no_ring_by_default() -> None:
    store = PagedLayerStorage(4, 4, num_kv_heads=HKV, head_dim=D, granularity="fp32-group")
    assert store.recent is None and store.recent_kv() is None
    assert store.memory_bytes()["recent"] == 0
