"""PagedLayerStorage with the ``k-transform`` format: offset, rotation, first-token side buffer.

Checked against the torch reference called with explicitly built arguments, against fp32
attention over the unquantized keys (FP8 tolerance), and with the first tokens' page
slots poisoned with NaN (the side buffer, not the pages, must serve them). Fresh random
data per test; biased keys so that the offset matters.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_rel

from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.kernels import hadamard, paged_attention_reference
from kvquant.schemes import KTransformScales, Mask

HKV, HQ, D, PAGE = 2, 4, 16, 4


def _biased_keys(gen: torch.Generator, bsz: int, n: int) -> torch.Tensor:
    """Keys whose channels carry large constant offsets (like RoPE's slow channels)."""
    bias = 12.0 * torch.randn(HKV, D, generator=gen)
    return bias + torch.randn(bsz, n, HKV, D, generator=gen)


def _transform(keys: torch.Tensor, rotation: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    rot = keys @ rotation if rotation is not None else keys
    offset = rot.mean(dim=(0, 1))
    k_scale = (rot - offset).abs().amax(dim=(0, 1, 3)) / 448 * 1.5
    return offset, k_scale


def _storage(
    offset: torch.Tensor,
    k_scale: torch.Tensor,
    rotation: torch.Tensor | None,
    first_tokens: int,
    num_pages: int = 16,
) -> PagedLayerStorage:
    return PagedLayerStorage(
        num_pages, PAGE, HKV, D, granularity="k-transform",
        k_scale=k_scale, v_scale=torch.full((HKV,), 4.0 / 448),
        k_offset=offset, k_rotation=rotation, first_tokens=first_tokens, backend="torch",
    )  # fmt: skip


def _fp32_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int]
) -> torch.Tensor:
    """Causal fp32 attention of the newest ``Lq`` positions, keys from ``starts[b]`` on."""
    bsz, lq, hq, d = q.shape
    t = k.shape[1]
    out = torch.zeros(bsz, lq, hq, d)
    for b in range(bsz):
        kk = k[b, starts[b] :].repeat_interleave(hq // HKV, dim=1)  # [T', Hq, D]
        vv = v[b, starts[b] :].repeat_interleave(hq // HKV, dim=1)
        pos = torch.arange(t - lq, t)[:, None]
        cols = torch.arange(starts[b], t)[None, :]
        logits = torch.einsum("qhd,khd->hqk", q[b], kk) * d**-0.5
        logits = logits.masked_fill(~(cols <= pos)[None], float("-inf"))
        out[b] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vv)
    return out


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("first_tokens", [0, 1, 3])
def test_storage_matches_reference_and_fp32_with_left_padding(
    rotated: bool, first_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(100 + 7 * first_tokens + rotated)
    bsz, n, starts = 2, 11, [0, 3]
    keys = _biased_keys(gen, bsz, n)
    values = torch.randn(bsz, n, HKV, D, generator=gen)
    rotation = hadamard(D) if rotated else None
    offset, k_scale = _transform(keys, rotation)
    store = _storage(offset, k_scale, rotation, first_tokens)
    alloc = PageAllocator(16, PAGE)
    kv_start = torch.tensor(starts, dtype=torch.int32)
    for lo, hi in ((0, 2), (2, 7), (7, n)):  # three updates, the first window spans two
        slots = alloc.reserve([0, 1], hi - lo)
        store.write(keys[:, lo:hi], values[:, lo:hi], slots)
        store.keep_first(keys[:, lo:hi], values[:, lo:hi], lo, kv_start)
    if first_tokens:
        assert store.first_k is not None and store.first_v is not None
        assert store.first_lens is not None and store.first_lens.tolist() == [first_tokens] * 2
        for b, s in enumerate(starts):
            rot = (
                keys[b, s : s + first_tokens] @ rotation if rotated else keys[b, s:][:first_tokens]
            )
            torch.testing.assert_close(store.first_k[b], rot, rtol=1e-6, atol=1e-5)
            assert torch.equal(store.first_v[b], values[b, s : s + first_tokens])
    else:
        assert store.first_buffer() is None
    bt, lens = alloc.block_tables([0, 1]), alloc.seq_lens([0, 1])
    q = torch.randn(bsz, 3, HQ, D, generator=gen)
    got = store.attend(q, bt, lens, kv_start=kv_start)
    scheme = KTransformScales(store.k_scale, store.v_scale, offset, rotation, first_tokens)
    want = paged_attention_reference(
        q, store.pages, bt, lens, scheme, sm_scale=D**-0.5, mask=Mask(kv_start=kv_start),
        first=store.first_buffer(kv_start),
    )  # fmt: skip
    assert torch.equal(got, want)
    assert_close_rel(got, _fp32_attention(q, keys, values, starts), rel_tol=5e-2)
    # the model-frame keys of dense() are the keys within FP8 rounding of (k @ R - c)
    k_dense, v_dense = store.dense(bt, n)
    err = (k_dense - keys).abs().amax(dim=(0, 1, 3))
    assert bool((err <= 448 * k_scale * 2**-4).all()), err
    assert_close_rel(v_dense, values, rel_tol=5e-2)


def test_first_tokens_are_read_from_the_side_buffer_not_the_pages() -> None:
    gen = torch.Generator().manual_seed(3)
    keys = _biased_keys(gen, 2, 6)
    values = torch.randn(2, 6, HKV, D, generator=gen)
    offset, k_scale = _transform(keys, hadamard(D))
    store = _storage(offset, k_scale, hadamard(D), first_tokens=2)
    alloc = PageAllocator(16, PAGE)
    kv_start = torch.tensor([0, 1], dtype=torch.int32)
    slots = alloc.reserve([0, 1], 6)
    store.write(keys, values, slots)
    store.keep_first(keys, values, 0, kv_start)
    bt, lens = alloc.block_tables([0, 1]), alloc.seq_lens([0, 1])
    q = torch.randn(2, 1, HQ, D, generator=gen)
    before = store.attend(q, bt, lens, kv_start=kv_start)
    for b, s in enumerate((0, 1)):
        for p in (s, s + 1):  # the two first visible tokens of row b
            page, off = int(bt[b, p // PAGE]), p % PAGE
            store.k_pages[page, off] = float("nan")
            store.v_pages[page, off] = float("nan")
    after = store.attend(q, bt, lens, kv_start=kv_start)
    assert bool(torch.isfinite(after).all())
    assert torch.equal(before, after)


def test_a_window_that_moves_restarts_or_is_given_up() -> None:
    """A chunk that was all padding for a row gave it kv_start 0; the next chunk tells the truth."""
    gen = torch.Generator().manual_seed(5)
    keys = _biased_keys(gen, 2, 8)
    values = torch.randn(2, 8, HKV, D, generator=gen)
    offset, k_scale = _transform(keys, None)
    store = _storage(offset, k_scale, None, first_tokens=2)
    store.keep_first(keys[:, :4], values[:, :4], 0, torch.tensor([0, 0], dtype=torch.int32))
    assert store.first_lens is not None and store.first_start is not None
    assert store.first_lens.tolist() == [2, 2]
    # row 0's start moves to 5 (after this chunk's start 4): restarted; row 1's to 2 (< 4):
    # its first tokens are gone, so it keeps none (its keys come from the pages)
    store.keep_first(keys[:, 4:], values[:, 4:], 4, torch.tensor([5, 2], dtype=torch.int32))
    assert store.first_start.tolist() == [5, -1]
    assert store.first_lens.tolist() == [2, 0]
    assert store.first_k is not None and torch.equal(store.first_k[0], keys[0, 5:7])
    assert store.first_window_end() == 7
    store.truncate_first(6)  # crop: position 6 is gone
    assert store.first_lens.tolist() == [1, 0]
    store.reorder_first(torch.tensor([0, 0]))
    assert store.first_start.tolist() == [5, 5] and store.first_lens.tolist() == [1, 1]
    assert torch.equal(store.first_k[1], store.first_k[0])
    assert store.memory_bytes()["k_transform"] == (
        4 * HKV * D + 2 * (2 * 2 * HKV * D * 4) + 2 * 2 * 4
    )
    # an attention call whose kv_start differs from a row's window reads that row from the pages
    first = store.first_buffer(torch.tensor([5, 4], dtype=torch.int32))
    assert first is not None and first.lens.tolist() == [1, 0]
    first = store.first_buffer()
    assert first is not None and first.lens.tolist() == [0, 0]
    store.reset_first()
    assert store.first_buffer() is None and store.first_window_end() == 0


def test_row_groups_fill_the_batchs_side_buffer_like_one_call() -> None:
    """keep_first / first_buffer with ``rows``: each group's rows of the batch's buffers."""
    gen = torch.Generator().manual_seed(8)
    keys = _biased_keys(gen, 5, 6)
    values = torch.randn(5, 6, HKV, D, generator=gen)
    offset, k_scale = _transform(keys, hadamard(D))
    starts = torch.tensor([0, 3, 1, 7, 2], dtype=torch.int32)  # row 3: no real token yet
    whole = _storage(offset, k_scale, hadamard(D), first_tokens=2)
    whole.keep_first(keys, values, 0, starts)
    split = _storage(offset, k_scale, hadamard(D), first_tokens=2)
    for r0, r1 in ((0, 2), (2, 4), (4, 5)):
        split.keep_first(keys[r0:r1], values[r0:r1], 0, starts[r0:r1], rows=(r0, r1), batch=5)
        got = split.first_buffer(starts[r0:r1], rows=(r0, r1))
        assert got is not None and got.k.shape[0] == r1 - r0 and got.v.shape[0] == r1 - r0
        assert got.lens.tolist() == split.first_lens[r0:r1].tolist()
    for name in ("first_k", "first_v", "first_lens", "first_start"):
        assert torch.equal(getattr(split, name), getattr(whole, name)), name
    assert whole.first_start is not None and whole.first_start.tolist() == [0, 3, 1, 7, 2]
    with pytest.raises(CacheUsageError, match=r"rows \(3, 5\) of a batch of 4"):
        split.keep_first(keys[:2], values[:2], 6, starts[:2], rows=(3, 5), batch=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k_offset": None}, ScaleFormatError, "needs k_offset"),
        ({"k_offset": torch.zeros(HKV, D // 2)}, ScaleFormatError, r"k_offset has shape \(2, 8\)"),
        (
            {"k_offset": torch.full((HKV, D), float("nan"))},
            ScaleFormatError,
            "k_offset holds a non-finite",
        ),
        ({"k_rotation": 2 * torch.eye(D)}, ScaleFormatError, "not orthonormal"),
        ({"k_rotation": torch.eye(D)[:, :8]}, ScaleFormatError, r"k_rotation has shape"),
        ({"first_tokens": -1}, CacheUsageError, "first_tokens is -1"),
        ({"first_tokens": 5000}, CacheUsageError, "first_tokens is 5000"),
        ({"first_tokens": 1.0}, CacheUsageError, "expected an int"),
    ],
)
def test_bad_transforms_are_refused_at_construction(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {
        "k_scale": torch.full((HKV,), 0.1),
        "v_scale": torch.full((HKV,), 0.1),
        "k_offset": torch.zeros(HKV, D),
        "k_rotation": hadamard(D),
        "first_tokens": 1,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        PagedLayerStorage(4, PAGE, HKV, D, granularity="k-transform", backend="torch", **args)  # type: ignore[arg-type]


def test_transform_arguments_need_the_k_transform_granularity() -> None:
    with pytest.raises(CacheUsageError, match="granularity='k-transform'"):
        PagedLayerStorage(
            4, PAGE, HKV, D, granularity="per-head", k_scale=torch.full((HKV,), 0.1),
            v_scale=torch.full((HKV,), 0.1), k_offset=torch.zeros(HKV, D), backend="torch",
        )  # fmt: skip


def test_triton_backend_through_the_storage_matches_the_torch_backend() -> None:
    """The storage's own tensors (offset, rotation, side buffer, masked first_lens) suit Triton.

    Triton 3.9's interpreter rounds an fp32 value just below a power of two to half that
    power when it casts to float8e4nv (``-127.8 -> -64``; a GPU converts it to -128), so
    on CPU the Triton write may differ from the reference by exactly that; attention is
    compared on the reference's pages.
    """
    gen = torch.Generator().manual_seed(21)
    bsz, n = 2, 9
    keys = _biased_keys(gen, bsz, n)
    values = torch.randn(bsz, n, HKV, D, generator=gen)
    offset, k_scale = _transform(keys, hadamard(D))
    kv_start = torch.tensor([0, 2], dtype=torch.int32)
    q = torch.randn(bsz, 2, HQ, D, generator=gen)
    stores = {}
    for backend in ("torch", "triton"):
        store = PagedLayerStorage(
            16, PAGE, HKV, D, granularity="k-transform", k_scale=k_scale,
            v_scale=torch.full((HKV,), 4.0 / 448), k_offset=offset, k_rotation=hadamard(D),
            first_tokens=2, backend=backend,
        )  # fmt: skip
        alloc = PageAllocator(16, PAGE)
        slots = alloc.reserve([0, 1], n)
        store.write(keys, values, slots)
        store.keep_first(keys, values, 0, kv_start)
        stores[backend] = store
    ref, tri = stores["torch"], stores["triton"]
    for a, b in ((ref.k_pages, tri.k_pages), (ref.v_pages, tri.v_pages)):
        x, y = a.float(), b.float()
        assert bool(((x == y) | (x == 2 * y)).all())
        b.copy_(a)
    bt, lens = alloc.block_tables([0, 1]), alloc.seq_lens([0, 1])
    got = tri.attend(q, bt, lens, kv_start=kv_start)
    want = ref.attend(q, bt, lens, kv_start=kv_start)
    assert bool(torch.isfinite(got).all())
    assert_close_rel(got, want, rel_tol=5e-3)
