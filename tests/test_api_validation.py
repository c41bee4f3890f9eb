"""kvquant.kernels and kvquant.cache refuse bad scales, indices and sizes with KVQuantErrors only;
the public entry points type their arguments (OptionTypeError naming the argument)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.errors import (
    CacheUsageError,
    KernelInputError,
    KVQuantError,
    ScaleFormatError,
)
from kvquant.kernels import (
    compute_slot_mapping,
    page_storage,
    paged_attention,
    paged_attention_reference,
    write_kv,
)
from kvquant.kernels import validate as kval
from kvquant.schemes import KTransformScales, Mask, Pages, PerHeadScales, PerTensorScales

HKV, D, PS, PAGES = 2, 16, 4, 4
BAD_SCALES = [0.0, float("nan"), -0.5, float("inf"), 1e-40, 1e31]


def _pages(gen: torch.Generator, dtype: torch.dtype = torch.float8_e4m3fn):
    k, v = page_storage(PAGES, PS, HKV, D, dtype=dtype)
    k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
    v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return k, v


def _storage(**kw: Any) -> PagedLayerStorage:
    args: dict[str, Any] = dict(
        granularity="per-tensor", k_scale=torch.tensor(0.1), v_scale=torch.tensor(0.1)
    )
    args.update(kw)
    return PagedLayerStorage(PAGES, PS, HKV, D, backend="torch", name="L", **args)


def _refused(err: type[KVQuantError], call: Callable[[], Any], match: str | None = None) -> None:
    with pytest.raises(err, match=match) as info:
        call()
    assert isinstance(info.value, (ValueError, RuntimeError, KeyError, TypeError))


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_bad_static_scales_are_refused_where_they_enter(bad: float) -> None:
    """A bad static scale is refused where it enters: the scheme's construction, or the storage."""
    good, wrong = torch.tensor(0.1), torch.tensor(bad)
    heads, wrong_heads = torch.full((HKV,), 0.1), torch.tensor([0.1, bad])
    found_expected_fix = r"k_scale element 0 is .*; expected finite .*\. Fix: "
    _refused(ScaleFormatError, lambda: PerTensorScales(wrong, good), found_expected_fix)
    _refused(ScaleFormatError, lambda: PerTensorScales(good, wrong), "v_scale element 0")
    _refused(ScaleFormatError, lambda: PerHeadScales(wrong_heads, heads), "k_scale element 1")
    _refused(ScaleFormatError, lambda: PerHeadScales(heads, wrong_heads), "v_scale element 1")
    _refused(ScaleFormatError, lambda: KTransformScales(wrong_heads, heads), "k_scale element 1")
    per_head = torch.tensor([0.1, bad])
    _refused(ScaleFormatError, lambda: _storage(granularity="per-head", k_scale=torch.ones(2),
                                                v_scale=per_head))  # fmt: skip


def test_scale_values_are_read_once_when_the_scheme_is_built() -> None:
    """The scheme checks its scales once and keeps its own copy: a later in-place change of the
    caller's tensor reaches neither the scheme nor the pages; a scheme built from it is refused."""
    gen = torch.Generator().manual_seed(1)
    kp, vp = _pages(gen)
    scale = torch.tensor([0.1, 0.2])
    scheme = PerHeadScales(scale, scale)
    key = torch.randn(1, 1, HKV, D, generator=gen)
    write_kv(key, key, Pages(kp, vp), torch.tensor([[0]]), scheme, backend="torch")
    scale[1] = 0.0  # written in place after the scheme was built
    assert scheme.k_scale.tolist() == pytest.approx([0.1, 0.2])
    write_kv(key, key, Pages(kp, vp), torch.tensor([[1]]), scheme, backend="torch")
    assert torch.equal(kp[0, 1].view(torch.uint8), kp[0, 0].view(torch.uint8))
    _refused(ScaleFormatError, lambda: PerHeadScales(scale, scale), "element 1 is 0.0")


def test_scale_bounds_are_the_registrys() -> None:
    from kvquant.registry.policy import MAX_SCALE, MIN_SCALE

    assert (kval.SCALE_MIN, kval.SCALE_MAX) == (MIN_SCALE, MAX_SCALE)


@pytest.mark.parametrize("softcap", [float("inf"), float("nan"), -1.0, True])
def test_softcap_must_be_finite_and_positive(softcap: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    kp, vp = _pages(gen)
    s = torch.tensor(0.1)
    q = torch.randn(1, 1, 2 * HKV, D, generator=gen)
    bt, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    call = lambda: paged_attention(  # noqa: E731
        q, Pages(kp, vp), bt, lens, PerTensorScales(s, s), sm_scale=0.25, mask=Mask(softcap=softcap)
    )
    _refused(KernelInputError, call, "softcap")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mask", ["kv_start", "window"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_masked_out_slots_never_reach_the_output(backend: str, mask: str, q_len: int) -> None:
    """A NaN/inf in a K or V slot that no query sees leaves the output as if the slot held zeros."""
    gen = torch.Generator().manual_seed(3)
    kp, vp = _pages(gen, torch.float8_e5m2)  # e5m2 stores inf as well as NaN
    bt = torch.tensor([[2, 0]], dtype=torch.int32)
    lens = torch.tensor([7], dtype=torch.int32)
    q = torch.randn(1, q_len, 2 * HKV, D, generator=gen)
    masked = (
        Mask(kv_start=torch.tensor([2], dtype=torch.int32))
        if mask == "kv_start"
        else Mask(window=3)
    )
    scheme = PerTensorScales(torch.tensor(0.5), torch.tensor(0.5))

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_attention(
            q, Pages(k, v), bt, lens, scheme, sm_scale=0.25, mask=masked, backend=backend
        )

    clean_k, clean_v = kp.clone(), vp.clone()
    clean_k[2, :2] = 0.0  # positions 0 and 1 (page 2, slots 0-1): seen by no query
    clean_v[2, :2] = 0.0
    want = attend(clean_k, clean_v)
    poisoned_k, poisoned_v = clean_k.clone(), clean_v.clone()
    poisoned_v[2, 0] = float("inf")
    poisoned_v[2, 1] = float("nan")
    poisoned_k[2, 1] = float("nan")
    got = attend(poisoned_k, poisoned_v)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if backend == "torch":  # and a NaN in a slot that queries do see still shows
        poisoned_v[0, 2] = float("nan")  # position 6, the newest: every query's row sees it
        assert torch.isnan(attend(clean_k, poisoned_v)[0, -1]).all()


def test_reference_masked_slot_without_the_public_wrapper() -> None:
    gen = torch.Generator().manual_seed(4)
    kp, vp = _pages(gen, torch.float8_e5m2)
    vp[0, 0] = float("nan")
    s = torch.tensor(0.5)
    out = paged_attention_reference(
        torch.randn(1, 2, 2 * HKV, D, generator=gen),
        Pages(kp, vp),
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        PerTensorScales(s, s),
        sm_scale=0.25,
        mask=Mask(kv_start=torch.tensor([1], dtype=torch.int32)),
    )
    assert torch.isfinite(out).all()


def test_copy_pages_and_dense_check_page_ids() -> None:
    store = _storage()
    gen = torch.Generator().manual_seed(5)
    store.write(torch.randn(1, 4, HKV, D, generator=gen), torch.randn(1, 4, HKV, D, generator=gen),
                torch.arange(4)[None])  # fmt: skip
    before = store.k_pages.view(torch.uint8).clone()
    for src, dst in (
        (torch.tensor([0, 1]), torch.tensor([2, -1])),  # negative: would wrap to the last page
        (torch.tensor([0]), torch.tensor([PAGES])),
        (torch.tensor([0.0]), torch.tensor([1.0])),
        ([0], [1]),
        (torch.tensor([0, 1]), torch.tensor([1])),
    ):
        _refused(CacheUsageError, lambda s=src, d=dst: store.copy_pages(s, d))
    assert torch.equal(store.k_pages.view(torch.uint8), before)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    for table, n in (
        (torch.tensor([[0, PAGES]], dtype=torch.int32), 8),
        (torch.tensor([[-1]], dtype=torch.int32), 2),
        (bt, -1),
        (bt, 9),
        ([[0]], 2),
        (torch.tensor([0], dtype=torch.int32), 2),
    ):
        _refused(CacheUsageError, lambda t=table, m=n: store.dense(t, m))  # type: ignore[misc]


def test_allocator_reserve_refuses_bad_ids_and_counts() -> None:
    alloc = PageAllocator(PAGES, PS)
    for ids, counts in (
        ([0], 2.5),
        ([0], "3"),
        ([[0]], 1),
        (0, 1),
        ("ab", 1),
        ([0, 1], [1]),
        ([0], [-1]),
    ):
        _refused(CacheUsageError, lambda i=ids, c=counts: alloc.reserve(i, c))
    assert alloc.sequences == () and alloc.num_free_pages == PAGES
    _refused(CacheUsageError, lambda: PageAllocator(2**40, 16), "at most")
    _refused(CacheUsageError, lambda: PagedLayerStorage(4, 2**20, HKV, D, granularity="fp32-group"))
    alloc.reserve([0], 6)
    _refused(CacheUsageError, lambda: alloc.truncate(0, 7))
    alloc.truncate(0, 3)
    assert alloc.seq_len(0) == 3 and alloc.num_used_pages == 1


def test_compute_slot_mapping_checks_its_arguments() -> None:
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    pos = torch.tensor([[0, 5]])
    assert compute_slot_mapping(bt, pos, 4).tolist() == [[12, 5]]
    for table, positions, page in (
        (bt, pos, 0),
        (bt, pos, 2.0),
        (bt, torch.tensor([[8]]), 4),  # beyond the two pages listed
        (bt, torch.tensor([[0.5]]), 4),
        (bt, torch.tensor([[0], [1]]), 4),
        (bt[0], pos[0], 4),
        ([[3, 1]], pos, 4),
    ):
        _refused(
            KernelInputError, lambda t=table, p=positions, s=page: compute_slot_mapping(t, p, s)
        )


def test_paged_attention_refuses_an_out_whose_elements_alias() -> None:
    gen = torch.Generator().manual_seed(6)
    kp, vp = _pages(gen)
    scheme = PerTensorScales(torch.tensor(0.1), torch.tensor(0.1))
    q = torch.randn(1, 1, 2 * HKV, D, generator=gen)
    bt, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    out = torch.zeros(1, 1, 1, D).expand(1, 1, 2 * HKV, D)
    _refused(
        KernelInputError,
        lambda: paged_attention(q, Pages(kp, vp), bt, lens, scheme, sm_scale=0.25, out=out),
        "share memory",
    )
    fine = torch.empty(2 * HKV, D).t().t()[None, None]  # any strides without aliasing are fine
    paged_attention(q, Pages(kp, vp), bt, lens, scheme, sm_scale=0.25, out=fine)
    assert torch.isfinite(fine).all()


def test_allocator_token_count_of_the_wrong_type_names_the_argument() -> None:
    """A 0-d tensor is iterable by type only: a CacheUsageError naming num_new_tokens, not a
    bare TypeError; nothing is reserved."""
    alloc = PageAllocator(4, 2)
    for bad in (torch.tensor(2), torch.tensor(2.0), object()):
        _refused(CacheUsageError, lambda b=bad: alloc.reserve([0], b), "num_new_tokens")
        _refused(CacheUsageError, lambda b=bad: alloc.reserve_pages([0], b), "num_new_tokens")
    assert alloc.num_free_pages == 4


# ---------------------------------------------------------------------- public entry points


def _entry_point_calls(tmp_path: Any) -> dict[str, Callable[[], Any]]:
    import kvquant
    from kvquant.testing.checkpoints import write_checkpoint

    src = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    geometry = kvquant.LayerGeometry(2, 4, 2, 16)
    return {
        "inspect_checkpoint(None)": lambda: kvquant.inspect_checkpoint(None),
        "discover_scales([path])": lambda: kvquant.discover_scales([src]),
        "discover_scales(revision=3)": lambda: kvquant.discover_scales("org/x", revision=3),
        "export_checkpoint(out=None)": lambda: kvquant.export_checkpoint(
            src, out=None, engine="vllm"
        ),
        "export_checkpoint(src=b'')": lambda: kvquant.export_checkpoint(
            b"x", out=tmp_path / "o", engine="vllm"
        ),
        "resolve_scales(geometry={})": lambda: kvquant.resolve_scales(
            [], geometry={"num_layers": 2}
        ),
        "resolve_scales(raw=mapping)": lambda: kvquant.resolve_scales(
            {"model.layers.0.self_attn.k_scale": torch.ones(())}, geometry
        ),
        "resolve_scales(options={})": lambda: kvquant.resolve_scales([], geometry, options={}),
    }


@pytest.mark.parametrize(
    "call",
    [
        "inspect_checkpoint(None)",
        "discover_scales([path])",
        "discover_scales(revision=3)",
        "export_checkpoint(out=None)",
        "export_checkpoint(src=b'')",
        "resolve_scales(geometry={})",
        "resolve_scales(raw=mapping)",
        "resolve_scales(options={})",
    ],
)
def test_public_entry_points_type_their_arguments(tmp_path: Any, call: str) -> None:
    """A wrong argument type is an OptionTypeError (a KVQuantError and a TypeError) naming the
    argument, never a bare TypeError or AttributeError from deep inside."""
    from kvquant.errors import OptionTypeError

    argument = call.split("(")[1].split("=")[0].rstrip(")")
    named = {"None": "path", "[path]": "path", "b''": "src", "raw": "raw_scales"}.get(
        argument, argument
    )
    with pytest.raises(OptionTypeError, match=named) as info:
        _entry_point_calls(tmp_path)[call]()
    assert isinstance(info.value, TypeError) and isinstance(info.value, KVQuantError)
    assert not (tmp_path / "o").exists()
