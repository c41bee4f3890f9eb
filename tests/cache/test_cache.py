"""PageAllocator and PagedLayerStorage: growth, freeing, reset, capacity, accounting, write/attend."""

from __future__ import annotations

import math

import pytest
import torch

from kvquant.cache import PageAllocator, PagedLayerStorage, total_memory_bytes
from kvquant.errors import CacheCapacityError, CacheUsageError, KernelInputError, ScaleFormatError
from kvquant.kernels import hadamard
from kvquant.schemes import KTransformScales, PerHeadScales, scheme_class

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA, or interpreted on CPU


def _expected_slots(pages: tuple[int, ...], start: int, n: int, page: int) -> list[int]:
    return [pages[p // page] * page + p % page for p in range(start, start + n)]


# --------------------------------------------------------------- allocator


@pytest.mark.parametrize("page", [16, 32, 64])
def test_grow_page_by_page(page: int) -> None:
    alloc = PageAllocator(num_pages=6, page_size=page)
    assert alloc.num_free_pages == 6
    all_slots: list[int] = []
    for step in range(2 * page + 1):  # decode: one token at a time across two page boundaries
        slots = alloc.reserve(["a"], 1)
        assert slots.shape == (1, 1) and slots.dtype == torch.int64
        all_slots.append(int(slots))
        assert alloc.seq_len("a") == step + 1
        assert len(alloc.pages("a")) == math.ceil((step + 1) / page)
    assert alloc.num_free_pages == 3
    pages = alloc.pages("a")
    assert all_slots == _expected_slots(pages, 0, 2 * page + 1, page)
    bt = alloc.block_tables(["a"])
    assert bt.dtype == torch.int32 and bt.tolist() == [list(pages)]
    assert alloc.seq_lens(["a"]).tolist() == [2 * page + 1]
    assert alloc.seq_lens(["a"]).dtype == torch.int32


def test_ragged_prefill_then_decode() -> None:
    alloc = PageAllocator(num_pages=10, page_size=16)
    slots = alloc.reserve([7, 3, 9], [20, 0, 5])
    assert slots.shape == (3, 20)
    assert (slots[1] == -1).all() and (slots[2, 5:] == -1).all()
    assert slots[0].tolist() == _expected_slots(alloc.pages(7), 0, 20, 16)
    assert slots[2, :5].tolist() == _expected_slots(alloc.pages(9), 0, 5, 16)
    assert alloc.seq_len(3) == 0 and alloc.pages(3) == ()
    # all slots distinct
    used = slots[slots >= 0]
    assert used.unique().numel() == used.numel()
    step = alloc.reserve([7, 3, 9], 1)
    assert step[:, 0].tolist() == [
        _expected_slots(alloc.pages(7), 20, 1, 16)[0],
        _expected_slots(alloc.pages(3), 0, 1, 16)[0],
        _expected_slots(alloc.pages(9), 5, 1, 16)[0],
    ]
    bt = alloc.block_tables([7, 3, 9])
    assert bt.shape == (3, 2)
    assert bt[1].tolist() == [alloc.pages(3)[0], 0]  # padded with page 0
    assert alloc.seq_lens([9, 7]).tolist() == [6, 21]


def test_free_returns_pages_and_leaves_others() -> None:
    alloc = PageAllocator(num_pages=4, page_size=16)
    alloc.reserve(["x", "y"], [17, 16])
    x_pages, y_pages = alloc.pages("x"), alloc.pages("y")
    assert alloc.num_free_pages == 1
    alloc.free("x")
    assert "x" not in alloc and alloc.num_free_pages == 3
    assert alloc.pages("y") == y_pages and alloc.seq_len("y") == 16
    slots = alloc.reserve(["z"], 48)  # reuses x's pages and the free one
    assert set(alloc.pages("z")) == set(x_pages) | ({0, 1, 2, 3} - set(x_pages) - set(y_pages))
    assert not set(alloc.pages("z")) & set(y_pages)
    assert (slots >= 0).all()
    with pytest.raises(CacheUsageError, match="sequence 'x' is unknown"):
        alloc.free("x")


def test_reset() -> None:
    alloc = PageAllocator(num_pages=3, page_size=16)
    alloc.reserve([0, 1], [20, 10])
    alloc.reset()
    assert alloc.num_free_pages == 3 and alloc.sequences == ()
    assert alloc.reserve([5], 1).tolist() == [[0]]


def test_capacity_error_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=16)
    alloc.reserve(["a"], 30)  # 2 pages
    table = alloc.block_tables(["a"])
    state = (alloc.num_free_pages, alloc.pages("a"), alloc.seq_len("a"), alloc.sequences)
    with pytest.raises(CacheCapacityError) as info:
        alloc.reserve(["a", "b"], [3, 33])  # a needs 1 page, b needs 3: 4 > 2 free
    msg = str(info.value)
    assert "need 4 new pages" in msg and "only 2 of 4 pages are free" in msg and "Fix:" in msg
    assert (alloc.num_free_pages, alloc.pages("a"), alloc.seq_len("a"), alloc.sequences) == state
    assert "b" not in alloc
    assert alloc.block_tables(["a"]) is table  # cache untouched
    alloc.reserve(["a", "b"], [2, 32])  # exactly fits
    assert alloc.num_free_pages == 0


def test_allocator_usage_errors() -> None:
    alloc = PageAllocator(num_pages=4, page_size=16)
    with pytest.raises(CacheUsageError, match="appears twice"):
        alloc.reserve([1, 1], 1)
    with pytest.raises(CacheUsageError, match="2 token counts for 3 sequences"):
        alloc.reserve([1, 2, 3], [1, 2])
    with pytest.raises(CacheUsageError, match="asks for -1 new tokens"):
        alloc.reserve([1], -1)
    assert alloc.sequences == ()
    with pytest.raises(CacheUsageError, match="unknown"):
        alloc.block_tables([1])
    with pytest.raises(CacheUsageError, match="unknown"):
        alloc.seq_lens([1])
    with pytest.raises(CacheUsageError, match="page_size is 0"):
        PageAllocator(4, 0)
    alloc.reserve([1], 40)
    with pytest.raises(CacheUsageError, match="width=2 but a sequence holds 3 pages"):
        alloc.block_tables([1], width=2)


def test_block_tables_reused_until_pages_change() -> None:
    alloc = PageAllocator(num_pages=8, page_size=16)
    alloc.reserve([0, 1], 10)
    t1 = alloc.block_tables([0, 1])
    alloc.reserve([0, 1], 1)  # inside the first page: no new page
    assert alloc.block_tables([0, 1]) is t1
    alloc.reserve([0, 1], 10)  # crosses into page 2
    t2 = alloc.block_tables([0, 1])
    assert t2 is not t1 and t2.shape == (2, 2)
    wide = alloc.block_tables([0, 1], width=5)
    assert wide.shape == (2, 5) and wide[:, :2].tolist() == t2.tolist()


# ------------------------------------------------------------------ cache


def _exact_kv(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """Random values that are e4m3 codes times ``scale`` (stored without rounding)."""
    codes = (torch.randn(shape) * 4).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return codes * scale


@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "fp32-group"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cache_decode_matches_dense_attention(page: int, granularity: str, backend: str) -> None:
    """Prefill + decode through the cache equals dense causal attention on the original values.

    Inputs are exactly representable (e4m3 codes x power-of-two scales; for fp32-group each
    group's amax is 448 x its scale), so the pages hold the inputs exactly and the oracle is
    plain attention over the history, independent of the kernels' reference.
    """
    torch.manual_seed(page)
    hkv, d, hq, layers = 2, 32, 4, 2
    kw: dict = {}
    if granularity == "per-tensor":
        kw = {"k_scale": torch.tensor(0.25), "v_scale": torch.tensor(0.5)}
    elif granularity == "per-head":
        kw = {"k_scale": torch.tensor([0.25, 0.125]), "v_scale": torch.tensor([0.5, 1.0])}
    else:
        kw = {"group_size": 16}
    alloc = PageAllocator(8, page, DEV)  # shared by the layers: a token has one slot in each
    stores = [
        PagedLayerStorage(
            8, page, hkv, d, granularity=granularity, backend=backend, device=DEV, **kw
        )
        for _ in range(layers)
    ]
    lens = [page + 3, page - 1]  # the first spans two pages; decode takes the second across one
    steps = 3
    total = max(lens) + steps
    hist_k = torch.zeros(2, total, hkv, d)
    hist_v = torch.zeros(2, total, hkv, d)
    for b in range(2):
        for t in range(total):
            if granularity == "fp32-group":
                # each group of 16 holds a ±448 code: its scale is exactly the power of two
                k = _exact_kv((hkv, d), 2.0**-6)
                k[:, 0], k[:, 16] = 448 * 2.0**-6, -448 * 2.0**-6
                v = _exact_kv((hkv, d), 2.0**-8)
                v[:, 0], v[:, 16] = 448 * 2.0**-8, 448 * 2.0**-8
            else:
                sk = kw["k_scale"].reshape(-1, 1)
                sv = kw["v_scale"].reshape(-1, 1)
                k = _exact_kv((hkv, d), 1.0) * sk
                v = _exact_kv((hkv, d), 1.0) * sv
            hist_k[b, t], hist_v[b, t] = k, v

    def check(layer: int, q: torch.Tensor, q_lens: list[int], seq_lens: list[int]) -> None:
        bt = alloc.block_tables([0, 1])
        sl = alloc.seq_lens([0, 1])
        ql = torch.tensor(q_lens, dtype=torch.int32)
        out = stores[layer].attend(q.to(DEV), bt, sl, q_lens=ql.to(DEV)).cpu()
        for b in range(2):
            n, nq = seq_lens[b], q_lens[b]
            k = hist_k[b, :n].repeat_interleave(hq // hkv, dim=1)
            v = hist_v[b, :n].repeat_interleave(hq // hkv, dim=1)
            s = torch.einsum("qhd,khd->hqk", q[b, :nq].float(), k) * d**-0.5
            mask = torch.arange(n)[None, :] <= torch.arange(n - nq, n)[:, None]
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            want = torch.einsum("hqk,khd->qhd", p, v)
            torch.testing.assert_close(out[b, :nq].float(), want, atol=1e-2, rtol=1e-2)
            assert (out[b, nq:] == 0).all()

    # prefill (ragged)
    slots = alloc.reserve([0, 1], lens)
    key = torch.zeros(2, max(lens), hkv, d)
    val = torch.zeros(2, max(lens), hkv, d, dtype=torch.bfloat16)
    for b in range(2):
        key[b, : lens[b]] = hist_k[b, : lens[b]]
        val[b, : lens[b]] = hist_v[b, : lens[b]].to(torch.bfloat16)
    for layer in range(layers):
        stores[layer].write(key.to(DEV), val.to(DEV), slots)
    q = torch.randn(2, max(lens), hq, d, dtype=torch.float16)
    check(1, q, lens, lens)
    # decode
    cur = list(lens)
    for _ in range(steps):
        slots = alloc.reserve([0, 1], 1)
        key = torch.stack([hist_k[b, cur[b]] for b in range(2)])[:, None]
        val = torch.stack([hist_v[b, cur[b]] for b in range(2)])[:, None]
        for layer in range(layers):
            stores[layer].write(key.to(DEV), val.to(DEV), slots)
        cur = [c + 1 for c in cur]
        check(0, torch.randn(2, 1, hq, d), [1, 1], cur)
    if granularity == "fp32-group":
        g = stores[0].k_group_scales.reshape(-1, hkv, 2).cpu()
        used = alloc.block_tables([0])[0, 0].item() * page
        assert (g[used : used + 3] == 2.0**-6).all()


def test_capacity_error_before_anything_written() -> None:
    alloc = PageAllocator(2, 16)
    store = PagedLayerStorage(2, 16, 1, 16, granularity="fp32-group", backend="torch")
    alloc.reserve([0], 20)
    assert store.k_group_scales is not None
    before = (store.k_pages.clone(), store.k_group_scales.clone())
    with pytest.raises(CacheCapacityError):
        slots = alloc.reserve([0, 1], [1, 16])
        store.write(torch.ones(2, 16, 1, 16), torch.ones(2, 16, 1, 16), slots)
    assert torch.equal(store.k_pages.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(store.k_group_scales, before[1])
    assert alloc.seq_len(0) == 20 and 1 not in alloc


def test_failed_write_leaves_storage_unchanged() -> None:
    alloc = PageAllocator(2, 16)
    store = PagedLayerStorage(
        2, 16, 2, 32, granularity="per-tensor", k_scale=torch.tensor(0.1),
        v_scale=torch.tensor(0.1), backend="torch",
    )  # fmt: skip
    slots = alloc.reserve([0], 3)
    store.write(torch.randn(1, 3, 2, 32), torch.randn(1, 3, 2, 32), slots)
    snap = store.k_pages.clone(), store.v_pages.clone()
    with pytest.raises(KernelInputError, match="value has shape"):
        store.write(torch.randn(1, 3, 2, 32), torch.randn(1, 2, 2, 32), slots)
    assert torch.equal(store.k_pages.view(torch.uint8), snap[0].view(torch.uint8))
    assert torch.equal(store.v_pages.view(torch.uint8), snap[1].view(torch.uint8))


def test_memory_accounting() -> None:
    group = [
        PagedLayerStorage(10, 16, 4, 64, granularity="fp32-group", group_size=32) for _ in range(3)
    ]
    m = total_memory_bytes(group)
    assert m["pages"] == 2 * 3 * 10 * 16 * 4 * 64
    assert m["group_scales"] == 2 * 3 * 10 * 16 * 4 * 2 * 4
    assert m["static_scales"] == m["k_transform"] == 0
    assert m["total"] == m["pages"] + m["group_scales"]
    assert m["total"] == sum(s.memory_bytes()["total"] for s in group)
    static = [
        PagedLayerStorage(
            5, 32, 4, 64, granularity="per-head", k_scale=torch.ones(4), v_scale=torch.ones(4)
        )
        for _ in range(2)
    ]
    assert total_memory_bytes(static)["static_scales"] == 2 * 2 * 4 * 4
    assert total_memory_bytes(static)["pages"] == 2 * 2 * 5 * 32 * 4 * 64
    assert static[0].k_pages.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "fp32-group", "k-transform"])
def test_scheme_slot_bytes_are_what_the_storage_allocates_per_slot(granularity: str) -> None:
    """The pool sizing asks the scheme's class what a slot costs before any storage exists."""
    h, d, g = 3, 32, 8
    scheme = scheme_class(granularity)
    kw: dict[str, object] = {}
    shape = scheme.scale_shape(h)
    if shape is not None:
        kw = {"k_scale": torch.full(shape, 0.5), "v_scale": torch.full(shape, 0.25)}
    if scheme.transforms_keys:
        kw |= {"k_offset": torch.zeros(h, d), "k_rotation": hadamard(d)}
    if scheme.dynamic:
        kw["group_size"] = g
    store = PagedLayerStorage(5, 4, h, d, granularity=granularity, backend="torch", **kw)
    held = store.memory_bytes()
    per_slot = (held["pages"] + held["group_scales"]) / (5 * 4)
    assert scheme.slot_bytes(h, d, g if scheme.dynamic else None) == per_slot


def test_storage_defaults_and_e5m2() -> None:
    c = PagedLayerStorage(2, 16, 1, 128, granularity="fp32-group", kv_dtype=torch.float8_e5m2)
    assert c.k_group_scales is not None
    assert c.group_size == 64 and c.k_group_scales.shape == (2, 16, 1, 2)
    assert c.v_pages.dtype == torch.float8_e5m2
    c2 = PagedLayerStorage(2, 16, 1, 32, granularity="fp32-group")
    assert c2.group_size == 32  # default 64 capped at head_dim


def test_storage_constructor_errors() -> None:
    with pytest.raises(CacheUsageError, match="granularity='per-token'"):
        PagedLayerStorage(2, 16, 1, 32, granularity="per-token")
    with pytest.raises(CacheUsageError, match="group_size=24 does not divide head_dim 32"):
        PagedLayerStorage(2, 16, 1, 32, granularity="fp32-group", group_size=24)
    with pytest.raises(CacheUsageError, match="kv_dtype"):
        PagedLayerStorage(2, 16, 1, 32, granularity="fp32-group", kv_dtype=torch.float16)
    with pytest.raises(CacheUsageError, match="k_scale/v_scale were given"):
        PagedLayerStorage(2, 16, 1, 32, granularity="fp32-group", k_scale=torch.tensor(1.0))
    with pytest.raises(ScaleFormatError, match="k_scale is None"):
        PagedLayerStorage(2, 16, 1, 32, granularity="per-tensor")
    with pytest.raises(ScaleFormatError, match=r"v_scale has shape \(2,\); expected \(\)"):
        PagedLayerStorage(
            2, 16, 2, 32, granularity="per-tensor", k_scale=torch.tensor(1.0),
            v_scale=torch.ones(2),
        )  # fmt: skip
    with pytest.raises(ScaleFormatError, match="zero, negative, non-finite"):
        PagedLayerStorage(
            2, 16, 1, 32, granularity="per-head", k_scale=torch.zeros(1), v_scale=torch.ones(1)
        )
    c = PagedLayerStorage(
        2, 16, 1, 32, granularity="per-tensor", k_scale=torch.tensor(1.0, dtype=torch.bfloat16),
        v_scale=torch.tensor(2.0),
    )  # fmt: skip
    assert c.k_scale is not None and c.k_scale.dtype == torch.float32


@pytest.mark.parametrize("granularity", ["per-head", "k-transform"])
def test_bf16_scales_are_converted_to_fp32_before_the_scheme(granularity: str) -> None:
    """Checkpoints ship bf16 scales: the storage converts them (the schemes take fp32 only), and
    writes and attends exactly (a rotation of 16 channels is exact in bf16) like a storage given the same values in fp32."""
    gen = torch.Generator().manual_seed(3)
    scales = {"k_scale": torch.tensor([0.02, 0.05]), "v_scale": torch.tensor([0.03, 0.01])}
    if granularity == "k-transform":
        scales.update(k_offset=torch.randn(2, 16, generator=gen), k_rotation=hadamard(16))
    exact = {k: v.to(torch.bfloat16).float() for k, v in scales.items()}
    stores = [
        PagedLayerStorage(2, 16, 2, 16, granularity=granularity, backend="torch", **kw)
        for kw in (exact, {k: v.to(torch.bfloat16) for k, v in exact.items()})
    ]
    assert [type(s.scheme) for s in stores] == [scheme_class(granularity)] * 2
    scheme = stores[1].scheme
    assert isinstance(scheme, (PerHeadScales, KTransformScales))
    assert scheme.k_scale.dtype == scheme.v_scale.dtype == torch.float32
    if isinstance(scheme, KTransformScales):
        assert scheme.k_offset is not None and scheme.k_offset.dtype == torch.float32
        assert scheme.k_rotation is not None and scheme.k_rotation.dtype == torch.float32
    key, val = torch.randn(2, 1, 5, 2, 16, generator=gen)
    alloc = PageAllocator(2, 16)
    slots = alloc.reserve([0], 5)
    bt, lens = alloc.block_tables([0]), alloc.seq_lens([0])
    q = torch.randn(1, 5, 4, 16, generator=gen)
    outs = []
    for store in stores:
        store.write(key, val, slots)
        outs.append(store.attend(q, bt, lens))
    assert torch.equal(stores[0].k_pages.view(torch.uint8), stores[1].k_pages.view(torch.uint8))
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------ layer storage


def test_layer_storage_dense_copy_pages_and_accounting() -> None:
    """One PagedLayerStorage: exact round trip through dense(), page copies, bytes, errors."""
    torch.manual_seed(7)
    hkv, d, page = 2, 32, 4
    alloc = PageAllocator(num_pages=6, page_size=page)
    store = PagedLayerStorage(
        6, page, hkv, d, granularity="fp32-group", group_size=16, backend="torch", name="L0"
    )
    k_pages, k_groups = store.k_pages, store.k_group_scales
    slots = alloc.reserve(["a", "b"], 6)  # two pages each, the second partly used
    key = _exact_kv((2, 6, hkv, d), 2.0**-6)
    key[..., 0], key[..., 16] = 448 * 2.0**-6, -448 * 2.0**-6  # exact group scales
    val = _exact_kv((2, 6, hkv, d), 2.0**-8)
    val[..., 0], val[..., 16] = 448 * 2.0**-8, 448 * 2.0**-8
    store.write(key, val.to(torch.bfloat16), slots)
    assert store.k_pages is k_pages and store.k_group_scales is k_groups  # written in place
    bt = alloc.block_tables(["a", "b"])
    k, v = store.dense(bt, 6, torch.float64)
    assert k.shape == (2, 6, hkv, d) and k.dtype == torch.float64
    assert torch.equal(k.float(), key) and torch.equal(v.float(), val)
    # beam reorder: both rows take sequence "b"'s pages (src and dst overlap)
    store.copy_pages(bt[[1, 1]].reshape(-1), bt.reshape(-1))
    k2, v2 = store.dense(bt, 6)
    assert torch.equal(k2, key[[1, 1]]) and torch.equal(v2, val[[1, 1]])
    m = store.memory_bytes()
    assert m == {
        "pages": 2 * 6 * page * hkv * d,
        "group_scales": 2 * 6 * page * hkv * 2 * 4,
        "recent": 0,
        "static_scales": 0,
        "k_transform": 0,
        "total": 2 * 6 * page * hkv * (d + 8),
    }
    with pytest.raises(CacheUsageError, match=r"L0\.copy_pages: src \(3,\) and dst \(2,\)"):
        store.copy_pages(torch.arange(3), torch.arange(2))
    with pytest.raises(CacheUsageError, match="seq_len=9 needs 3 pages"):
        store.dense(bt, 9)


def test_layer_storage_errors_name_the_owner() -> None:
    with pytest.raises(ScaleFormatError, match=r"layers\.3\.self_attn: k_scale is None"):
        PagedLayerStorage(2, 16, 2, 32, granularity="per-head", name="layers.3.self_attn")
    with pytest.raises(ScaleFormatError, match=r"X: v_scale has shape \(3,\); expected \(2,\)"):
        PagedLayerStorage(
            2, 16, 2, 32, granularity="per-head", k_scale=torch.ones(2), v_scale=torch.ones(3),
            name="X",
        )  # fmt: skip
    with pytest.raises(CacheUsageError, match="X: group_size=8 was given"):
        PagedLayerStorage(
            2, 16, 2, 32, granularity="per-tensor", group_size=8, k_scale=torch.tensor(1.0),
            v_scale=torch.tensor(1.0), name="X",
        )  # fmt: skip
    with pytest.raises(CacheUsageError, match="X: backend='cuda'"):
        PagedLayerStorage(2, 16, 2, 32, granularity="fp32-group", backend="cuda", name="X")
    with pytest.raises(CacheUsageError, match="X: num_pages is 0"):
        PagedLayerStorage(0, 16, 2, 32, granularity="fp32-group", name="X")


def test_storage_over_pages_of_the_callers_buffer() -> None:
    """``pages=``: the storage writes into the caller's views (here: every second page of a
    buffer, as a batching cache interleaves layers) and refuses views of another geometry."""
    from kvquant.errors import CacheUsageError

    buffer = torch.zeros(2 * 4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    views = {"k_pages": buffer[0::2], "v_pages": buffer[1::2]}
    storage = PagedLayerStorage(
        4, 4, 2, 16, granularity="per-tensor", k_scale=torch.tensor(0.05),
        v_scale=torch.tensor(0.05), backend="torch", pages=views,
    )  # fmt: skip
    assert storage.k_pages is views["k_pages"] and storage.external
    key = torch.randn(1, 3, 2, 16)
    storage.write(key, key, torch.tensor([[4, 5, 6]]))
    assert bool(buffer[2].float().abs().sum() > 0) and bool(buffer[3].float().abs().sum() > 0)
    assert not bool(buffer[0].float().any()) and not bool(buffer[4:].float().any())
    with pytest.raises(CacheUsageError, match="belong to the caller"):
        storage.grow(8)
    with pytest.raises(CacheUsageError, match=r"pages\['v_pages'\] is \(4, 4, 2, 8\)"):
        PagedLayerStorage(
            4, 4, 2, 16, granularity="per-tensor", k_scale=torch.tensor(0.05),
            v_scale=torch.tensor(0.05), backend="torch",
            pages={"k_pages": views["k_pages"], "v_pages": views["v_pages"][..., :8]},
        )  # fmt: skip
    with pytest.raises(CacheUsageError, match=r"expected.*k_group_scales"):
        PagedLayerStorage(4, 4, 2, 16, granularity="fp32-group", backend="torch", pages=views)
