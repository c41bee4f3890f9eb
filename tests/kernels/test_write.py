"""The FP8 cache write: torch and Triton backends against the reference and exact oracles.

On CPU the Triton kernel runs in the interpreter, whose fp32 -> fp8 cast has a
known bug (triton 3.6): when rounding up carries into the next power of two it
keeps the old exponent, so the stored value is half the right one. CPU
comparisons allow exactly that pattern (and count it); everything else must be
bit-exact. Inputs that need no rounding (fp8 values times the scale) must
match exactly on every backend. The GPU tests compare bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.kernels import (
    compute_slot_mapping,
    group_scale_storage,
    hadamard,
    page_storage,
    write_kv,
    write_kv_reference,
)
from kvquant.kernels.fp8 import fp8_max
from kvquant.schemes import (
    GroupScales,
    KTransformScales,
    Pages,
    PerHeadScales,
    PerTensorScales,
    Scheme,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def _poisoned_pages(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Pages filled with random finite FP8 bytes (so untouched slots are detectable)."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8)
    pages = raw.view(dtype).float()
    pages = torch.where(pages.isfinite(), pages, torch.zeros_like(pages)).to(dtype)
    return pages.to(device)


def _poisoned_cache_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pages in the cache's layout (V keys-fastest), filled with random finite codes."""
    kp, vp = page_storage(*shape, dtype=dtype, device=device)
    kp.copy_(_poisoned_pages(shape, dtype, device))
    vp.copy_(_poisoned_pages(shape, dtype, device))
    return kp, vp


def _shuffled_slots(bsz: int, seq: int, num_slots: int, skip: int = 2) -> torch.Tensor:
    slots = torch.randperm(num_slots)[: bsz * seq].reshape(bsz, seq).clone()
    flat = slots.view(-1)
    flat[torch.randperm(flat.numel())[:skip]] = -1
    return slots


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x [B, L, H, D]`` in a non-contiguous layout ([B, H, L, D] transposed)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def assert_codes_match(got: torch.Tensor, want: torch.Tensor, *, exact: bool, what: str) -> int:
    """Compare FP8 tensors code by code; NaN must match NaN (any sign).

    With ``exact=False`` (Triton interpreter) a code may be half the wanted
    value when the wanted value is a power of two, or 0 instead of the smallest
    subnormal (the interpreter's carry bug), or one code (ulp) off (it breaks
    ties wrongly).
    Returns how many such codes were allowed.
    """
    g, w = got.float(), want.float()
    nan_g, nan_w = g.isnan(), w.isnan()
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ ({(nan_g != nan_w).sum()})"
    bad = (got.view(torch.uint8) != want.view(torch.uint8)) & ~nan_w
    allowed = torch.zeros_like(bad)
    if not exact:
        mant, _ = torch.frexp(w)
        tiny = torch.tensor(1, dtype=torch.uint8).view(want.dtype).float().item()  # min subnormal
        halved = (g * 2 == w) & (w != 0) & (mant.abs() == 0.5)
        lost_tiny = (g == 0) & (w.abs() == tiny)
        gb, wb = got.view(torch.uint8).int(), want.view(torch.uint8).int()
        one_ulp = ((gb & 0x80) == (wb & 0x80)) & (((gb & 0x7F) - (wb & 0x7F)).abs() == 1)
        allowed = bad & (halved | lost_tiny | one_ulp)
        bad = bad & ~allowed
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        pairs = [(g[tuple(i)].item(), w[tuple(i)].item()) for i in idx]
        raise AssertionError(
            f"{what}: {int(bad.sum())} codes differ; first (got, want): {pairs} at {idx}"
        )
    return int(allowed.sum())


def _make_scales(
    mode: str, hkv: int, d: int, num_pages: int, page: int, device: str, layout: str = "head-major"
) -> tuple[Scheme, tuple[torch.Tensor, ...]]:
    """The scheme of ``mode`` and its group scales (NaN-filled; none for static scales)."""
    if mode == "per-tensor":
        scales = torch.tensor(0.013, device=device), torch.tensor(0.029, device=device)
        return PerTensorScales(*scales), ()
    if mode == "per-head":
        ks = torch.rand(hkv, device=device) * 0.02 + 0.005
        return PerHeadScales(ks, ks.flip(0) * 1.7), ()
    g = int(mode.removeprefix("group"))
    groups = tuple(
        _group_scales_in(layout, num_pages, page, hkv, d // g, device).fill_(float("nan"))
        for _ in "kv"
    )
    return GroupScales(head_dim=d, group_size=g), groups


def _group_scales_in(
    layout: str, num_pages: int, page: int, hkv: int, ng: int, device: str
) -> torch.Tensor:
    """Group scales ``[num_pages, page, Hkv, NG]`` stored in one of three memory orders."""
    if layout == "head-major":  # the cache's own
        return group_scale_storage(num_pages, page, hkv, ng, device=device)
    if layout == "slot-major":
        return torch.empty(num_pages, page, hkv, ng, device=device)
    # heads outermost, then pages
    return torch.empty(hkv, num_pages, page, ng, device=device).permute(1, 2, 0, 3)


def _clone(pages: Pages) -> Pages:
    """A copy of the pages and their group scales (same strides)."""
    tensors = (pages.k, pages.v, pages.k_scales, pages.v_scales)
    return Pages(*(None if t is None else t.clone() for t in tensors))


def _assert_same_group_scales(got: Pages, want: Pages) -> None:
    for name in ("k_scales", "v_scales"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


MODES = ["per-tensor", "per-head", "group16", "group32"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("dtype", FP8)
def test_write_matches_reference(backend: str, mode: str, page: int, dtype: torch.dtype) -> None:
    """Random data (incl. values past ±fp8_max·scale), shuffled and skipped slots, mixed dtypes."""
    torch.manual_seed(hash((backend, mode, page, str(dtype))) % 2**31)
    bsz, seq, hkv, d, num_pages = 2, 5, 2, 64, 4
    key = _strided(torch.randn(bsz, seq, hkv, d, device=DEV) * 4)  # fp32, non-contiguous
    value = (torch.randn(bsz, seq, hkv, d, device=DEV) * 6).to(torch.bfloat16)
    key[0, 0, 0, :4] = torch.tensor([1e3, -1e3, 5e4, -1e6])  # beyond ±448·scale
    kp = _poisoned_pages((num_pages, page, hkv, d), dtype, DEV)
    vp = _poisoned_pages((num_pages, page, hkv, d), dtype, DEV)
    slots = _shuffled_slots(bsz, seq, num_pages * page).to(DEV)
    scheme, groups = _make_scales(mode, hkv, d, num_pages, page, DEV)
    pages = Pages(kp, vp, *groups)
    ref = _clone(pages)
    write_kv(key, value, pages, slots, scheme, backend=backend)
    write_kv_reference(key, value, ref, slots, scheme)
    exact = backend == "torch" or HAS_CUDA
    n_k = assert_codes_match(kp, ref.k, exact=exact, what="k_pages")
    n_v = assert_codes_match(vp, ref.v, exact=exact, what="v_pages")
    written = int((slots >= 0).sum()) * hkv * d
    assert n_k + n_v <= 0.1 * 2 * written  # the interpreter bug is rare; wholesale errors are not
    _assert_same_group_scales(pages, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["head-major", "slot-major", "heads-outer"])
def test_write_group_scale_layouts(backend: str, layout: str) -> None:
    """Group scales in any memory order are written where their logical index says."""
    torch.manual_seed(7)
    bsz, seq, hkv, d, num_pages, page = 2, 5, 3, 32, 4, 16
    key = torch.randn(bsz, seq, hkv, d, device=DEV)
    value = torch.randn(bsz, seq, hkv, d, device=DEV) * 3
    kp = _poisoned_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    vp = _poisoned_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    slots = _shuffled_slots(bsz, seq, num_pages * page).to(DEV)
    scheme, groups = _make_scales("group16", hkv, d, num_pages, page, DEV, layout=layout)
    pages = Pages(kp, vp, *groups)
    ref_groups = (torch.full(g.shape, float("nan"), device=DEV) for g in groups)  # contiguous
    ref = Pages(kp.clone(), vp.clone(), *ref_groups)
    write_kv(key, value, pages, slots, scheme, backend=backend)
    write_kv_reference(key, value, ref, slots, scheme)
    exact = backend == "torch" or HAS_CUDA
    assert_codes_match(kp, ref.k, exact=exact, what="k_pages")
    assert_codes_match(vp, ref.v, exact=exact, what="v_pages")
    for g in groups:
        assert int(g.isfinite().sum()) == int((slots >= 0).sum()) * hkv * 2
    _assert_same_group_scales(pages, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["per-head", "group32"])
def test_write_into_cache_layout(backend: str, mode: str) -> None:
    """Pages in the cache's layout (V keys-fastest) get the codes of contiguous pages."""
    torch.manual_seed(11)
    bsz, seq, hkv, d, num_pages, page = 2, 7, 2, 64, 4, 16
    key = torch.randn(bsz, seq, hkv, d, device=DEV) * 3
    value = (torch.randn(bsz, seq, hkv, d, device=DEV) * 5).to(torch.float16)
    kp, vp = _poisoned_cache_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    kp_ref, vp_ref = kp.contiguous(), vp.contiguous()
    assert vp.stride(1) == 1 and not vp.is_contiguous()
    slots = _shuffled_slots(bsz, seq, num_pages * page).to(DEV)
    scheme, groups = _make_scales(mode, hkv, d, num_pages, page, DEV)
    pages = Pages(kp, vp, *groups)
    ref = Pages(kp_ref, vp_ref, *(g.clone() for g in groups))
    write_kv(key, value, pages, slots, scheme, backend=backend)
    write_kv_reference(key, value, ref, slots, scheme)
    exact = backend == "torch" or HAS_CUDA
    assert_codes_match(kp, kp_ref, exact=exact, what="k_pages")
    assert_codes_match(vp, vp_ref, exact=exact, what="v_pages")
    _assert_same_group_scales(pages, ref)


def _exact_inputs(
    bsz: int,
    seq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    group: int | None,
    in_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values ``code * scale`` that quantize with no rounding.

    Returns (x [B, L, Hkv, D] in ``in_dtype``, codes FP8, group scales or None). With
    ``group``, each group holds one ±fp8_max code so that amax / fp8_max is exactly its
    power-of-two scale.
    """
    raw = torch.randint(0, 256, (bsz, seq, hkv, d), dtype=torch.uint8).view(dtype).float()
    codes_f = torch.where(raw.isfinite(), raw, torch.zeros_like(raw))
    if group is None:
        return codes_f.to(in_dtype), codes_f.to(dtype), None
    ng = d // group
    gv = codes_f.unflatten(-1, (ng, group))
    gv[..., 0] = fp8_max(dtype) * torch.sign(torch.randn(bsz, seq, hkv, ng)).clamp(min=0).mul(
        2
    ).sub(1)
    gv[0, 0, 0, 0] = 0.0  # one all-zero group: scale 1.0
    codes_f = gv.flatten(-2)
    gscale = 2.0 ** torch.randint(-4, 1, (bsz, seq, hkv, ng)).float()
    gscale[0, 0, 0, 0] = 1.0
    x = codes_f * gscale.repeat_interleave(group, dim=-1)
    return x.to(in_dtype), codes_f.to(dtype), gscale


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FP8)
def test_write_exact_values(backend: str, mode: str, dtype: torch.dtype) -> None:
    """Values that are fp8 codes times the scale are stored exactly (an oracle independent of the reference)."""
    torch.manual_seed(7)
    bsz, seq, hkv, d, num_pages, page = 2, 3, 2, 64, 3, 16
    group = int(mode.removeprefix("group")) if mode.startswith("group") else None
    in_dtypes = (
        (torch.float32, torch.bfloat16)
        if dtype == torch.float8_e4m3fn
        else (torch.float16, torch.float32)
    )
    k_in, k_codes, k_gs = _exact_inputs(bsz, seq, hkv, d, dtype, group, in_dtypes[0])
    v_in, v_codes, v_gs = _exact_inputs(bsz, seq, hkv, d, dtype, group, in_dtypes[1])
    scheme, groups = _make_scales(mode, hkv, d, num_pages, page, "cpu")
    if mode == "per-tensor":  # power-of-two static scales keep code * scale exact
        scheme = PerTensorScales(torch.tensor(0.25), torch.tensor(2.0))
    elif mode == "per-head":
        scheme = PerHeadScales(torch.tensor([0.25, 0.25]), torch.tensor([0.5, 0.125]))
    if isinstance(scheme, PerTensorScales | PerHeadScales):
        k_in = (k_in.float() * scheme.k_scale.reshape(-1, 1)).to(k_in.dtype)
        v_in = (v_in.float() * scheme.v_scale.reshape(-1, 1)).to(v_in.dtype)
    kp = _poisoned_pages((num_pages, page, hkv, d), dtype, DEV)
    vp = _poisoned_pages((num_pages, page, hkv, d), dtype, DEV)
    pages = Pages(kp, vp, *(g.to(DEV) for g in groups))
    before_k = kp.clone()
    slots = torch.tensor([[5, 40, 17], [0, -1, 33]], device=DEV)
    write_kv(k_in.to(DEV), v_in.to(DEV), pages, slots, scheme.to(DEV), backend=backend)
    for b in range(bsz):
        for t in range(seq):
            s = int(slots[b, t])
            if s < 0:
                continue
            pg, off = divmod(s, page)
            assert_codes_match(kp[pg, off].cpu(), k_codes[b, t], exact=True, what=f"k slot {s}")
            assert_codes_match(vp[pg, off].cpu(), v_codes[b, t], exact=True, what=f"v slot {s}")
            if pages.k_scales is not None and pages.v_scales is not None:
                assert torch.equal(pages.k_scales[pg, off].cpu(), k_gs[b, t])
                assert torch.equal(pages.v_scales[pg, off].cpu(), v_gs[b, t])
    untouched = torch.ones(num_pages * page, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat_now = kp.view(torch.uint8).reshape(num_pages * page, -1).cpu()
    flat_before = before_k.view(torch.uint8).reshape(num_pages * page, -1).cpu()
    assert torch.equal(flat_now[untouched], flat_before[untouched])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", FP8)
def test_saturation_and_non_finite(backend: str, dtype: torch.dtype) -> None:
    """Values past ±fp8_max·scale saturate; inf/NaN inputs are stored as NaN (group: whole group NaN)."""
    hkv, d, page = 1, 32, 16
    top = fp8_max(dtype)
    x = torch.zeros(1, 2, hkv, d)
    x[0, 0, 0, :6] = torch.tensor(
        [3 * top, -3 * top, float("inf"), float("-inf"), float("nan"), 1.0]
    )
    x[0, 1, 0, :] = 2.0  # finite token
    # static scale 1.0: saturation and NaNs per element
    kp = torch.zeros(2, page, hkv, d, dtype=dtype, device=DEV)
    vp = torch.zeros_like(kp)
    one = torch.tensor(1.0, device=DEV)
    slots = torch.tensor([[3, 4]], device=DEV)
    write_kv(x.to(DEV), x.to(DEV), Pages(kp, vp), slots, PerTensorScales(one, one), backend=backend)
    got = kp[0, 3, 0, :6].float().cpu()
    assert got[:2].tolist() == [top, -top]
    assert got[2:5].isnan().all()
    assert got[5].item() == 1.0
    assert torch.equal(kp[0, 4].float().cpu(), torch.full((hkv, d), 2.0))
    # group scales (G=16): the group with non-finite values is all NaN and its scale NaN;
    # the other group of the token and the other token are finite.
    gshape = (2, page, hkv, d // 16)
    kg, vg = torch.zeros(gshape, device=DEV), torch.zeros(gshape, device=DEV)
    groups = GroupScales(head_dim=d, group_size=16)
    write_kv(x.to(DEV), x.to(DEV), Pages(kp, vp, kg, vg), slots, groups, backend=backend)
    assert kg[0, 3, 0, 0].isnan() and kp[0, 3, 0, :16].float().isnan().all()
    assert kg[0, 3, 0, 1].item() == 1.0  # all-zero group
    assert (kp[0, 3, 0, 16:].float() == 0).all()
    expect = (torch.tensor(2.0) / top).item()  # fp32 amax / fp8_max
    assert kg[0, 4, 0].tolist() == [expect, expect]
    assert (kp[0, 4].float().cpu() == top).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_tokens_and_all_skipped(backend: str) -> None:
    kp = _poisoned_pages((2, 16, 2, 32), torch.float8_e4m3fn, DEV)
    vp = kp.clone()
    before = kp.clone()
    s = torch.tensor(0.1, device=DEV)
    pages, scheme = Pages(kp, vp), PerTensorScales(s, s)
    write_kv(
        torch.randn(2, 0, 2, 32, device=DEV),
        torch.randn(2, 0, 2, 32, device=DEV),
        pages,
        torch.zeros(2, 0, dtype=torch.int64, device=DEV),
        scheme,
        backend=backend,
    )
    write_kv(
        torch.randn(1, 3, 2, 32, device=DEV),
        torch.randn(1, 3, 2, 32, device=DEV),
        pages,
        torch.full((1, 3), -1, dtype=torch.int64, device=DEV),
        scheme,
        backend=backend,
    )
    assert torch.equal(kp.view(torch.uint8), before.view(torch.uint8))


def test_compute_slot_mapping() -> None:
    bt = torch.tensor([[4, 2, 7], [1, 0, 0]], dtype=torch.int32)
    pos = torch.tensor([[0, 15, 16, 40], [3, -1, -1, -1]])
    got = compute_slot_mapping(bt, pos, 16)
    assert got.dtype == torch.int64
    assert got.tolist() == [[64, 79, 32, 7 * 16 + 8], [19, -1, -1, -1]]


# ------------------------------------------------------------------- GPU (H200)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", ["per-tensor", "per-head", "group16", "group32", "group64", "group128"]
)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(
    "in_dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]
)
def test_write_triton_bitexact_gpu(mode: str, dtype: torch.dtype, in_dtypes: tuple) -> None:
    """The Triton write equals the torch reference bit for bit on CUDA (random data, big values)."""
    torch.manual_seed(0)
    bsz, seq, hkv, d, num_pages, page = 3, 97, 8, 128, 64, 16
    # wide dynamic range: values up to ~1e3 x the static scale's fp8 range
    key = _strided(
        torch.randn(bsz, seq, hkv, d, device="cuda") * torch.logspace(-3, 3, d, device="cuda")
    )
    key = key.to(in_dtypes[0])
    value = (torch.randn(bsz, seq, hkv, d, device="cuda") * 10).to(in_dtypes[1])
    value[0, 3, 1, 7] = float("inf")
    value[1, 5, 2, 9] = float("nan")
    kp, vp = _poisoned_cache_pages((num_pages, page, hkv, d), dtype, "cuda")
    slots = _shuffled_slots(bsz, seq, num_pages * page, skip=11).cuda()
    scheme, groups = _make_scales(mode, hkv, d, num_pages, page, "cuda")
    pages = Pages(kp, vp, *groups)
    ref = _clone(pages)
    write_kv(key, value, pages, slots, scheme, backend="auto")  # auto -> triton on CUDA
    write_kv_reference(key, value, ref, slots, scheme)
    torch.cuda.synchronize()
    assert_codes_match(kp, ref.k, exact=True, what="k_pages")
    assert_codes_match(vp, ref.v, exact=True, what="v_pages")
    _assert_same_group_scales(pages, ref)


@pytest.mark.gpu
def test_write_triton_skips_out_of_range_slots_gpu() -> None:
    """On CUDA slot values are not checked (no sync); the kernel never stores outside the pages."""
    n = 2 * 16 * 2 * 64
    big = torch.zeros(2 * n, dtype=torch.float8_e4m3fn, device="cuda")
    kp = big[:n].view(2, 16, 2, 64)
    vp = big[n:].view(2, 16, 2, 64)  # V right after K: a K store past the end would land in V
    s = torch.tensor(1.0, device="cuda")
    x = torch.ones(1, 2, 2, 64, device="cuda")
    slots = torch.tensor([[31, 32]], device="cuda")
    write_kv(x, x, Pages(kp, vp), slots, PerTensorScales(s, s))
    torch.cuda.synchronize()
    assert (kp[1, 15].float() == 1).all() and (vp[1, 15].float() == 1).all()
    assert int((big.float() != 0).sum()) == 2 * 2 * 64


KT_SHAPES = [(2, 64), (3, 16), (1, 128), (8, 32)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("transform", ["offset", "rotation", "both"])
@pytest.mark.parametrize("hkv, d", KT_SHAPES, ids=[f"hkv{h}-d{d}" for h, d in KT_SHAPES])
def test_write_k_transform_matches_reference(
    backend: str, transform: str, hkv: int, d: int
) -> None:
    """K stored as fp8((k @ R - c) / s), V untouched: shuffled and skipped slots, NaN/inf K."""
    torch.manual_seed(hash((backend, transform, hkv, d)) % 2**31)
    bsz, seq, num_pages, page = 2, 5, 4, 16
    key = _strided(torch.randn(bsz, seq, hkv, d, device=DEV) * 2)
    key[..., 1] += 30.0  # a near-constant channel (what the offset removes)
    key[1, 2, 0, 3] = float("nan")  # a non-finite K: its (token, head) row turns NaN rotated
    value = (torch.randn(bsz, seq, hkv, d, device=DEV) * 3).to(torch.bfloat16)
    rot = hadamard(d, device=DEV) if transform != "offset" else None
    off = torch.randn(hkv, d, device=DEV) * 4 if transform != "rotation" else None
    if off is not None:
        off = off.t().contiguous().t()  # any strides
    kp = _poisoned_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    vp = _poisoned_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    slots = _shuffled_slots(bsz, seq, num_pages * page).to(DEV)
    k_scale = torch.rand(hkv, device=DEV) * 0.05 + 0.02
    v_scale = torch.full((hkv,), 0.02, device=DEV)
    scheme = KTransformScales(k_scale, v_scale, off, rot)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    write_kv(key, value, Pages(kp, vp), slots, scheme, backend=backend)
    write_kv_reference(key, value, Pages(kp_ref, vp_ref), slots, scheme)
    # CPU interpreter: its fp8-cast bug; a rotation may also round one ulp apart where numpy's
    # and torch's fp32 matmuls sum in different orders
    exact = backend == "torch" or (HAS_CUDA and rot is None)
    n_k = assert_codes_match(kp, kp_ref, exact=exact, what="k_pages")
    n_v = assert_codes_match(vp, vp_ref, exact=backend == "torch" or HAS_CUDA, what="v_pages")
    written = int((slots >= 0).sum()) * hkv * d
    assert n_k + n_v <= 0.1 * 2 * written
    nan_row = int(slots[1, 2])
    if nan_row >= 0:
        stored = kp[nan_row // page, nan_row % page, 0].float()
        assert bool(stored.isnan().all() if rot is not None else stored[3].isnan())


def test_tokens_per_program_fills_the_gpu_for_small_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step's write (one token per sequence) gets one token per program on a GPU of
    132 multiprocessors; a long prompt keeps the tile's count; a CPU keeps it always."""
    from kvquant.kernels.write import launch

    monkeypatch.setattr(launch, "device_sm_count", lambda device: 132)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert launch.tokens_per_program(8, 16, gpu) == 1
    assert launch.tokens_per_program(8, 64, gpu) == 1
    assert launch.tokens_per_program(8, 1056, gpu) == 4
    assert launch.tokens_per_program(8, 8192, gpu) == 8
    assert launch.tokens_per_program(8, 16, gpu, least=2) == 2  # a rotation's 16 dot rows
    assert launch.tokens_per_program(8, 16, cpu) == 8


@pytest.mark.parametrize("mode", ["per-tensor", "group32", "k-transform"])
def test_write_with_one_token_per_program_matches_reference(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton write with the fewest tokens per program (a decode step's on a GPU) stores
    what the reference stores."""
    from kvquant.kernels.write import launch

    monkeypatch.setattr(launch, "tokens_per_program", lambda t, n, device, least=1: least)
    torch.manual_seed(hash(mode) % 2**31)
    bsz, seq, hkv, d, num_pages, page = 3, 1, 2, 64, 4, 16
    key = torch.randn(bsz, seq, hkv, d, device=DEV) * 4
    value = (torch.randn(bsz, seq, hkv, d, device=DEV) * 6).to(torch.bfloat16)
    kp, vp = _poisoned_cache_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    slots = _shuffled_slots(bsz, seq, num_pages * page, skip=1).to(DEV)
    if mode == "k-transform":
        scheme: Scheme = KTransformScales(
            torch.full((hkv,), 0.03, device=DEV),
            torch.full((hkv,), 0.02, device=DEV),
            torch.randn(hkv, d, device=DEV),
            hadamard(d, device=DEV),
        )
        groups: tuple[torch.Tensor, ...] = ()
    else:
        scheme, groups = _make_scales(mode, hkv, d, num_pages, page, DEV)
    pages = Pages(kp, vp, *groups)
    ref = _clone(pages)
    write_kv(key, value, pages, slots, scheme, backend="triton")
    write_kv_reference(key, value, ref, slots, scheme)
    exact = HAS_CUDA and mode != "k-transform"
    n_k = assert_codes_match(pages.k, ref.k, exact=exact, what="k_pages")
    n_v = assert_codes_match(pages.v, ref.v, exact=HAS_CUDA, what="v_pages")
    assert n_k + n_v <= 0.1 * 2 * int((slots >= 0).sum()) * hkv * d
    _assert_same_group_scales(pages, ref)
