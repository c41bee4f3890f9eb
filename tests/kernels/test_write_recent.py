"""The cache write that also copies the new tokens into the ring of each sequence's newest
tokens (``write_kv(..., recent=, recent_start=)``): the FP8 Triton kernel does it in the same
launch, every other path after the pages' write. Against the ring's reference
(:func:`kvquant.kernels.write_recent_reference`) on fresh random data, with the ring
NaN-poisoned so that a slot written wrongly or not at all shows; the pages must be exactly what
the same write without a ring stores. On a CUDA machine the kernel runs on the GPU."""

from __future__ import annotations

import pytest
import torch
from test_write import DEV, _shuffled_slots

from kvquant.errors import KernelInputError
from kvquant.kernels import (
    group_scale_storage,
    hadamard,
    page_storage,
    write_kv,
    write_recent_reference,
)
from kvquant.kernels.fp4 import fp4_page_storage
from kvquant.schemes import (
    GroupScales,
    KTransformScales,
    Nvfp4Scales,
    Pages,
    PerHeadScales,
    PerTensorScales,
    RecentTokens,
    Scheme,
)

HKV, D = 2, 32
MODES = ["per-tensor", "per-head", "group16", "group32-rotated", "k-transform", "nvfp4"]


def _scheme(mode: str) -> Scheme:
    if mode == "per-tensor":
        return PerTensorScales(torch.tensor(0.02, device=DEV), torch.tensor(0.03, device=DEV))
    if mode == "per-head":
        return PerHeadScales(
            torch.tensor([0.02, 0.05], device=DEV), torch.full((HKV,), 0.03, device=DEV)
        )
    if mode == "group16":
        return GroupScales(D, 16)
    if mode == "group32-rotated":
        return GroupScales(D, 32, hadamard(D, device=DEV))
    if mode == "k-transform":
        off = torch.randn(HKV, D, device=DEV)
        scales = torch.full((HKV,), 0.05, device=DEV), torch.full((HKV,), 0.03, device=DEV)
        return KTransformScales(*scales, off, hadamard(D, device=DEV))
    return Nvfp4Scales(D, torch.tensor(0.004, device=DEV), torch.tensor(0.004, device=DEV))


def _pages(scheme: Scheme, num_pages: int, page: int) -> Pages:
    view = scheme.kernel_view()
    if view.k_fp4 is not None and view.v_fp4 is not None:
        kp, ks = fp4_page_storage(num_pages, page, HKV, D, view.k_fp4, device=DEV)
        vp, vs = fp4_page_storage(num_pages, page, HKV, D, view.v_fp4, device=DEV)
        return Pages(kp, vp, ks, vs)
    kp, vp = page_storage(num_pages, page, HKV, D, device=DEV)
    if view.group_size is None:
        return Pages(kp, vp)
    ng = D // view.group_size
    return Pages(kp, vp, *(group_scale_storage(num_pages, page, HKV, ng, device=DEV) for _ in "kv"))


def _clone(pages: Pages) -> Pages:
    tensors = (pages.k, pages.v, pages.k_scales, pages.v_scales)
    return Pages(*(None if t is None else t.clone() for t in tensors))


def _assert_pages_equal(got: Pages, want: Pages) -> None:
    for name in ("k", "v", "k_scales", "v_scales"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq, ring_len, start", [(1, 4, 9), (3, 4, 6), (1, 16, 0), (5, 8, 13)])
def test_write_keeps_the_newest_tokens(
    backend: str, mode: str, seq: int, ring_len: int, start: int
) -> None:
    """Each stored token lands in slot ``(start + l) % R`` of its row's ring (K rotated, before
    any offset; V as given); the other slots keep their NaN; the pages are the write's without
    a ring; a token with a negative slot (skipped by the pages) is in the ring all the same."""
    torch.manual_seed(hash((backend, mode, seq, ring_len, start)) % 2**31)
    bsz, num_pages, page = 3, 6, 16
    scheme = _scheme(mode)
    key = (torch.randn(bsz, seq, HKV, D, device=DEV) * 2).to(torch.bfloat16)
    value = (torch.randn(bsz, seq, HKV, D, device=DEV) * 3).to(torch.bfloat16)
    slots = _shuffled_slots(bsz, seq, num_pages * page, skip=1).to(DEV)
    pages, plain = _pages(scheme, num_pages, page), _pages(scheme, num_pages, page)
    ring = torch.full((bsz, 2, ring_len, HKV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    want = ring.clone()
    pos = torch.tensor([start], dtype=torch.int64, device=DEV)
    recent = RecentTokens(ring)

    write_kv(key, value, pages, slots, scheme, backend=backend, recent=recent, recent_start=pos)
    write_kv(key, value, plain, slots, scheme, backend=backend)
    write_recent_reference(key, value, scheme, RecentTokens(want), pos)

    _assert_pages_equal(pages, plain)
    assert torch.equal(ring.isnan(), want.isnan())
    written = ~want.isnan()
    assert int(written.sum()) == 2 * bsz * seq * HKV * D  # the reference's count
    rotated = mode in ("group32-rotated", "k-transform")
    # a rotation's fp32 sums run in another order in the kernel: one bf16 ulp apart at most
    tol = (
        {"rtol": 8e-3, "atol": 1e-2} if rotated and backend == "triton" else {"rtol": 0, "atol": 0}
    )
    torch.testing.assert_close(ring[written].float(), want[written].float(), **tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_into_a_full_ring_overwrites_only_the_oldest(backend: str) -> None:
    """Positions 0..R-1 filled, then position R: it replaces position 0's slot only."""
    torch.manual_seed(7)
    bsz, ring_len, num_pages, page = 2, 4, 4, 16
    scheme = _scheme("group16")
    pages = _pages(scheme, num_pages, page)
    ring = torch.zeros(bsz, 2, ring_len, HKV, D, dtype=torch.float32, device=DEV)
    key = torch.randn(bsz, ring_len + 1, HKV, D, device=DEV)
    value = torch.randn(bsz, ring_len + 1, HKV, D, device=DEV)
    table = torch.arange(bsz * 2, device=DEV).view(bsz, 2)
    for p in range(ring_len + 1):
        slots = (table[:, :1] * page + p).to(torch.int64)
        pos = torch.tensor([p], device=DEV)
        write_kv(key[:, p : p + 1], value[:, p : p + 1], pages, slots, scheme, backend=backend,
                 recent=RecentTokens(ring), recent_start=pos)  # fmt: skip
    assert torch.equal(ring[:, 0, 0], key[:, ring_len])
    assert torch.equal(ring[:, 0, 1:], key[:, 1:ring_len])
    assert torch.equal(ring[:, 1, 0], value[:, ring_len])
    assert torch.equal(ring[:, 1, 1:], value[:, 1:ring_len])


def _bad_calls() -> list[tuple[str, dict[str, object], str]]:
    ring = torch.zeros(2, 2, 4, HKV, D, device=DEV)
    pos = torch.zeros(1, dtype=torch.int64, device=DEV)
    return [
        ("no start", {"recent": RecentTokens(ring)}, "without recent_start"),
        ("no ring", {"recent_start": pos}, "without recent"),
        ("short ring", {"recent": RecentTokens(ring[:, :, :2].contiguous()), "recent_start": pos},
         "at most 2"),
        ("int32 start", {"recent": RecentTokens(ring), "recent_start": pos.int()}, "int64"),
        ("two starts", {"recent": RecentTokens(ring), "recent_start": pos.repeat(2)}, "[1]"),
        ("other batch", {"recent": RecentTokens(ring[:1].contiguous()), "recent_start": pos},
         "recent_kv"),
        ("not a ring", {"recent": ring, "recent_start": pos}, "RecentTokens"),
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_rings_are_refused_before_anything_is_written(
    backend: str, case: tuple[str, dict[str, object], str]
) -> None:
    _, kwargs, words = case
    scheme = _scheme("group16")
    pages = _pages(scheme, 4, 16)
    pages.k.view(torch.uint8).fill_(0x11)
    before = _clone(pages)
    key = torch.randn(2, 3, HKV, D, device=DEV)
    slots = torch.arange(6, device=DEV).view(2, 3)
    with pytest.raises(KernelInputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        write_kv(key, key, pages, slots, scheme, backend=backend, **kwargs)  # type: ignore[arg-type]
    _assert_pages_equal(pages, before)
