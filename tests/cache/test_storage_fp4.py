"""PagedLayerStorage over 4-bit pages (nvfp4, mxfp4, fp8-k-nvfp4-v): the class the granularity
picks, write/attend/dense against the kernels' references, growth, page copies, accounting,
and the constructor's refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.cache.storage import Fp4Storage, Fp8KNvfp4VStorage
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.kernels import hadamard, paged_attention
from kvquant.kernels.fp4 import dequantize_fp4
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.schemes import Mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D, PAGE = 2, 64, 8

SCALES: dict[str, dict[str, Any]] = {
    "nvfp4": {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)},
    "mxfp4": {},
    "fp8-k-nvfp4-v": {"k_scale": torch.full((H,), 0.02), "v_scale": torch.full((H,), 0.5)},
}


def _storage(gran: str, num_pages: int = 6, backend: str = "torch", **kw: Any) -> Any:
    return PagedLayerStorage(num_pages, PAGE, H, D, granularity=gran, device=DEV,
                             backend=backend, **(SCALES[gran] | kw))  # fmt: skip


def _fill(store: Any, alloc: PageAllocator, ids: list[int], n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(ids), n, H, D, generator=g).to(DEV)
    v = torch.randn(len(ids), n, H, D, generator=g).to(DEV)
    store.write(k, v, alloc.reserve(ids, n).to(DEV))
    return torch.stack([k, v])


def _dense_reference(store: Any, bt: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The tokens dequantized straight from the pools, page by page (not through dense())."""
    out = []
    for side in "kv":
        pages = getattr(store, f"{side}_pages")[bt[0].long()]
        g = getattr(store, f"{side}_scale")
        if pages.dtype == torch.uint8:
            fmt = getattr(store.scheme, f"{side}_format")
            full = dequantize_fp4(
                pages, getattr(store, f"{side}_block_scales")[bt[0].long()], fmt, g
            )
        else:
            full = dequantize_pages(pages, g, None)
        out.append(full.reshape(1, -1, H, D)[:, :n])
    return tuple(out)


@pytest.mark.parametrize(
    ("gran", "cls"),
    [("nvfp4", Fp4Storage), ("mxfp4", Fp4Storage), ("fp8-k-nvfp4-v", Fp8KNvfp4VStorage)],
)
def test_write_attend_dense_grow_and_copy(gran: str, cls: type) -> None:
    store = _storage(gran)
    assert type(store) is cls
    alloc = PageAllocator(num_pages=6, page_size=PAGE)
    kv = _fill(store, alloc, ["a"], 13, seed=1)
    bt, lens = alloc.block_tables(["a"]), alloc.seq_lens(["a"])
    bt_dev, lens_dev = bt.to(DEV), lens.to(DEV)
    dense = store.dense(bt_dev, 13)
    want = _dense_reference(store, bt_dev, 13)
    for got, ref, orig in zip(dense, want, kv, strict=True):
        assert torch.equal(got, ref)
        # 4-bit (or FP8) of the written tokens: close, not exact (measured 0.03..0.13)
        assert float((got - orig).norm() / orig.norm()) < 0.2
    q = torch.randn(1, 13, 2 * H, D, device=DEV)
    out = store.attend(q, bt_dev, lens_dev)
    ref = paged_attention(q, store.pages, bt_dev, lens_dev, store.scheme, sm_scale=D**-0.5,
                          mask=Mask(), backend="torch")  # fmt: skip
    assert torch.equal(out, ref)
    # growth keeps every page (pages and block scales), new pages read as zeros
    store.grow(9)
    assert store.num_pages == 9 and store.v_pages.shape[0] == 9
    for a, b in zip(store.dense(bt_dev, 13), dense, strict=True):
        assert torch.equal(a, b)
    assert not store.v_pages[6:].any()
    # a page copy moves codes and block scales together
    src, dst = bt[:1, 0].to(DEV), torch.tensor([8], device=DEV)
    store.copy_pages(src, dst)
    moved = store.dense(torch.tensor([[8]], dtype=torch.int32, device=DEV), PAGE)
    for a, b in zip(moved, dense, strict=True):
        assert torch.equal(a[0], b[0, :PAGE])


def test_triton_storage_matches_torch_storage() -> None:
    ref, tri = _storage("nvfp4"), _storage("nvfp4", backend="triton")
    alloc = PageAllocator(num_pages=6, page_size=PAGE)
    slots = alloc.reserve(["a", "b"], [11, 5]).to(DEV)
    k, v = (torch.randn(2, 11, H, D, device=DEV) for _ in range(2))
    ref.write(k, v, slots)
    tri.write(k, v, slots)
    for name in Fp4Storage.pool_names:
        assert torch.equal(
            getattr(ref, name).view(torch.uint8), getattr(tri, name).view(torch.uint8)
        )
    bt, lens = alloc.block_tables(["a", "b"]).to(DEV), alloc.seq_lens(["a", "b"]).to(DEV)
    q = torch.randn(2, 1, 2 * H, D, device=DEV)
    a, b = ref.attend(q, bt, lens), tri.attend(q, bt, lens)
    assert float((a - b).norm() / a.norm()) < 5e-3


def test_memory_bytes_count_4bit_pages_and_block_scales() -> None:
    # per token and KV head: D / 2 code bytes, D / 16 e4m3 (nvfp4) or D / 32 e8m0 (mxfp4) scales
    slots = 6 * PAGE * H
    nv = _storage("nvfp4").memory_bytes()
    assert nv == {"pages": 2 * slots * D // 2, "group_scales": 2 * slots * D // 16,
                  "recent": 0, "static_scales": 8, "k_transform": 0, "total": 2 * slots * 36 + 8}  # fmt: skip
    mx = _storage("mxfp4").memory_bytes()
    assert (mx["pages"], mx["group_scales"], mx["static_scales"]) == (slots * D, slots * 4, 0)
    mixed = _storage("fp8-k-nvfp4-v").memory_bytes()
    assert (mixed["pages"], mixed["group_scales"]) == (slots * D + slots * D // 2, slots * 4)
    assert mixed["static_scales"] == 2 * H * 4


@pytest.mark.parametrize(
    ("gran", "kw", "err", "match"),
    [
        ("nvfp4", {"k_scale": None}, ScaleFormatError, "L: nvfp4 scales: k_global_scale is a NoneType"),
        ("nvfp4", {"v_scale": torch.tensor(0.0)}, ScaleFormatError, "v_global_scale element 0"),
        ("mxfp4", {"k_scale": torch.tensor(1.0)}, ScaleFormatError, "mxfp4 computes every scale"),
        ("nvfp4", {"group_size": 16}, CacheUsageError, "group_size=16 was given"),
        ("nvfp4", {"kv_dtype": torch.float8_e5m2}, CacheUsageError, "e4m3fn"),
        ("fp8-k-nvfp4-v", {"k_offset": torch.zeros(H, D)}, CacheUsageError, "k-transform"),
        ("fp8-k-nvfp4-v", {"k_rotation": hadamard(D)}, CacheUsageError, "k-transform"),
        ("nvfp4", {"k_offset": torch.zeros(H, D)}, CacheUsageError, "k-transform"),
        ("mxfp4", {"k_rotation": torch.ones(D, D)}, ScaleFormatError, "L: mxfp4 scales: .*not "
         "orthonormal"),
        ("nvfp4", {"k_rotation": hadamard(32)}, ScaleFormatError, r"k_rotation has shape"),
    ],
)  # fmt: skip
def test_constructor_refuses_with_the_owner(
    gran: str, kw: dict[str, Any], err: type[Exception], match: str
) -> None:
    with pytest.raises(err, match=match):
        _storage(gran, name="L", **kw)


@pytest.mark.parametrize("gran", ["nvfp4", "mxfp4"])
def test_rotated_k_is_stored_rotated_and_read_back_in_the_models_frame(gran: str) -> None:
    """``k_rotation``: K's pages hold the codes of ``k @ H`` (the scheme carries H, the
    attention rotates the query), ``dense()`` rotates K back; V and the byte counts of the
    pages are those of the unrotated storage, plus H under ``k_transform``."""
    h = hadamard(D)
    store, plain = _storage(gran, k_rotation=h), _storage(gran)
    assert torch.equal(store.k_rotation.cpu(), h) and plain.k_rotation is None
    assert torch.equal(store.scheme.kernel_view().k_rotation.cpu(), h)
    assert "K rotated" in repr(store) and "K rotated" not in repr(plain)
    alloc = PageAllocator(num_pages=6, page_size=PAGE)
    kv = _fill(store, alloc, ["a"], 13, seed=2)
    plain.write(kv[0] @ h.to(DEV), kv[1], _slots_of(alloc, 13))
    for name in Fp4Storage.pool_names:  # the rotated K quantized as usual, V as given
        assert torch.equal(getattr(store, name).view(torch.uint8),
                           getattr(plain, name).view(torch.uint8)), name  # fmt: skip
    bt, lens = alloc.block_tables(["a"]).to(DEV), alloc.seq_lens(["a"]).to(DEV)
    k, v = store.dense(bt, 13)
    k_rot, v_plain = plain.dense(bt, 13)
    assert torch.allclose(k, k_rot @ h.to(DEV).T, atol=1e-5) and torch.equal(v, v_plain)
    assert float((k - kv[0]).norm() / kv[0].norm()) < 0.2  # the model's K, 4-bit close
    q = torch.randn(1, 13, 2 * H, D, device=DEV)
    rotated_q = plain.attend(q @ h.to(DEV), bt, lens)
    assert torch.allclose(store.attend(q, bt, lens), rotated_q, atol=1e-5)
    held, before = store.memory_bytes(), plain.memory_bytes()
    assert held["k_transform"] == D * D * 4
    assert held["total"] == before["total"] + D * D * 4


def _slots_of(alloc: PageAllocator, n: int) -> torch.Tensor:
    """The slots of sequence ``"a"``'s first ``n`` tokens (already reserved)."""
    bt = alloc.block_tables(["a"])[0].long()
    pos = torch.arange(n)
    return (bt[pos // PAGE] * PAGE + pos % PAGE).reshape(1, n).to(DEV)


def test_head_dim_must_hold_whole_blocks() -> None:
    with pytest.raises(ScaleFormatError, match="head_dim is 48; expected an int, a multiple of"):
        PagedLayerStorage(2, PAGE, H, 48, granularity="mxfp4")


def test_bf16_global_scales_become_fp32_and_caller_pages_are_adopted() -> None:
    store = _storage("nvfp4", k_scale=torch.tensor(0.5, dtype=torch.bfloat16))
    assert store.k_scale.dtype == torch.float32 and float(store.k_scale) == 0.5
    own = _storage("mxfp4")
    pools = {n: getattr(own, n) for n in Fp4Storage.pool_names}
    adopted = _storage("mxfp4", pages=pools)
    assert adopted.external and adopted.v_block_scales is pools["v_block_scales"]
    with pytest.raises(CacheUsageError, match="expected"):
        _storage("mxfp4", pages={"k_pages": pools["k_pages"], "v_pages": pools["v_pages"]})
