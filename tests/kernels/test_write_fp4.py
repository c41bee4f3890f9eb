"""The 4-bit cache write: Triton (interpreted on CPU) and torch backends against the reference.

The kernel computes every code with integer and compare operations, so it must match the
reference byte for byte (pages and block scales; an FP8 K side too) on every backend: fresh
random data with values past the calibrated range and non-finite values, shuffled and skipped
slots, strided inputs; each block's choice between its two candidate scales on hand-built
blocks whose choice is known. Slots that are not written must keep their poison (random bytes, NaN
scale codes); a refused call must leave every written tensor as it was. ``write_kv`` routes a
4-bit scheme to the same write.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.errors import BackendError, KernelInputError, ScaleFormatError
from kvquant.kernels import hadamard, page_storage, write_kv
from kvquant.kernels.fp4 import (
    Fp4Format,
    dequantize_fp4,
    fp4_page_storage,
    quantize_fp4,
)
from kvquant.kernels.write_fp4 import write_fp4
from kvquant.kernels.write_fp4.naive import write_fp4_reference
from kvquant.schemes import (
    Fp4Scales,
    Fp8KNvfp4VScales,
    Mxfp4Scales,
    Nvfp4Scales,
    Pages,
    PerTensorScales,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _scheme(kind: str, hkv: int, d: int, per_head: bool) -> Fp4Scales:
    if per_head:
        k = torch.rand(hkv, device=DEV) * 0.004 + 0.001
        v = torch.rand(hkv, device=DEV) * 0.004 + 0.001
    else:
        k, v = torch.tensor(4.0 / 2688, device=DEV), torch.tensor(9.0 / 2688, device=DEV)
    if kind == "nvfp4":
        return Nvfp4Scales(d, k, v)
    if kind == "mxfp4":
        return Mxfp4Scales(d)
    return Fp8KNvfp4VScales(d, k * 6, v)  # FP8 K: amax / 448 for |K| up to ~10


def _side(fmt: Fp4Format | None, num_pages: int, page: int, hkv: int, d: int) -> tuple[Any, Any]:
    """Pages of random bytes and block scales of the NaN code (untouched slots are detectable)."""
    if fmt is None:  # FP8 K, the cache's layout
        pages = page_storage(num_pages, page, hkv, d, device=DEV)[0]
        pages.view(torch.uint8).copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
        return pages, None
    pages, scales = fp4_page_storage(num_pages, page, hkv, d, fmt, device=DEV)
    pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
    scales.view(torch.uint8).fill_(fmt.nan_scale_code)
    return pages, scales


def _pages(scheme: Fp4Scales, num_pages: int, page: int, hkv: int) -> Pages:
    d = scheme.head_dim
    kp, ks = _side(scheme.k_format, num_pages, page, hkv, d)
    vp, vs = _side(scheme.v_format, num_pages, page, hkv, d)
    return Pages(kp, vp, ks, vs)


def _clone(p: Pages) -> Pages:
    return Pages(*(None if x is None else x.clone() for x in (p.k, p.v, p.k_scales, p.v_scales)))


def _bytes(p: Pages) -> dict[str, torch.Tensor]:
    named = {"k": p.k, "v": p.v, "k_scales": p.k_scales, "v_scales": p.v_scales}
    return {n: x.view(torch.uint8).clone() for n, x in named.items() if x is not None}


def _new_tokens(bsz: int, seq: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(bsz, seq, hkv, d, generator=g) * 3
    key = key.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous
    value = (torch.randn(bsz, seq, hkv, d, generator=g) * 5).to(torch.bfloat16)
    key[0, 0, 0, :3] = torch.tensor([1e3, -1e5, 7.0])  # past the calibrated range
    key[0, 1, 0, 5] = -1e-9  # rounds to -0.0 in FP8
    key[0, 1, 0, 6] = -0.0  # stays -0.0 in FP8 (the sign bit, not a comparison)
    key[1, 1, 1, 20 % d] = float("nan")
    value[0, 1, 0, 33 % d] = float("inf")
    key[1, 2, 0] = 0.0  # an all-zero token
    return key.to(DEV), value.to(DEV)


def _slots(bsz: int, seq: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[: bsz * seq].reshape(bsz, seq).clone()
    slots.view(-1)[torch.randperm(bsz * seq, generator=g)[:2]] = -1
    return slots.to(DEV)


KINDS = [
    ("nvfp4", False),
    ("nvfp4", True),
    ("mxfp4", False),
    ("fp8-k-nvfp4-v", False),
    ("fp8-k-nvfp4-v", True),
]


def _written_like_the_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    scheme: Fp4Scales,
    geometry: tuple[int, int, int],
    backend: str,
) -> Pages:
    """Poisoned pages written by ``write_kv`` on ``backend``, checked byte for byte against the
    reference's write of the same tokens; returns them."""
    got = _pages(scheme, *geometry)
    want = _clone(got)
    write_kv(key, value, got, slots, scheme, backend=backend)
    write_fp4_reference(key, value, want, slots, scheme)
    for name, x in _bytes(want).items():
        assert torch.equal(_bytes(got)[name], x), name
    return got


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("kind", "per_head"), KINDS, ids=[f"{k}-{'per-head' if p else 'per-tensor'}" for k, p in KINDS]
)
def test_write_matches_reference_byte_for_byte(kind: str, per_head: bool, backend: str) -> None:
    bsz, seq, hkv, d, num_pages, page = 2, 5, 2, 64, 4, 8
    seed = hash((kind, per_head, backend)) % 2**31
    key, value = _new_tokens(bsz, seq, hkv, d, seed)
    slots = _slots(bsz, seq, num_pages * page, seed)
    scheme = _scheme(kind, hkv, d, per_head)
    got = _written_like_the_reference(key, value, slots, scheme, (num_pages, page, hkv), backend)
    # slots never written keep their poison: NaN scale codes
    written = torch.zeros(num_pages * page, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = (~written).reshape(num_pages, page)
    fmt = scheme.v_format
    assert fmt is not None and got.v_scales is not None
    assert (got.v_scales.view(torch.uint8)[untouched.to(DEV)] == fmt.nan_scale_code).all()
    # NaN exactly where a block of the written V held a non-finite value
    flat = slots.reshape(-1)
    keep = flat >= 0
    pg, off = flat[keep] // page, flat[keep] % page
    back = dequantize_fp4(got.v[pg, off], got.v_scales[pg, off], fmt, scheme.kernel_view().v_scale)
    v = value.reshape(-1, hkv, d)[keep].float()
    nan_blocks = ~torch.isfinite(v).unflatten(-1, (-1, fmt.block_size)).all(-1)
    assert torch.equal(back.isnan(), nan_blocks.repeat_interleave(fmt.block_size, dim=-1))


# blocks whose two candidate scales differ in a known way (NVFP4 with g = 1: the scale of the
# maximum at 6 or at 4; MXFP4: the OCP exponent or the next), each padded with zeros, and the
# scale code each format stores for them (None: not pinned)
HARD_BLOCKS: list[tuple[list[float], int | None, int | None]] = [
    ([4, 3, -2, 1.5, 1, 0.5, -4], 0x38, None),  # on e2m1's grid below 4: NVFP4 maps 4 to 4 (1.0)
    ([7.5] * 16, None, 128),  # in (6, 8): MXFP4 takes E + 1
    ([6, -3, 1.5], 0x38, 127),  # exact under both NVFP4 scales: a tie keeps the classic one
    ([2.8 * 2.0**-9, 1e-5], 0x01, None),  # NVFP4's classic scale rounds to 0, 2^-9 does not
    ([4.2 * 448, 4 * 448, 3 * 448, 2 * 448, 448], 0x7E, None),  # the other clamps at 448
    ([7.0, 0.5, 0.25], None, 127),  # MXFP4: E + 1 would zero the small values
    ([], 0x00, 1),  # all zero
    ([1.0, float("nan")], 0x7F, 255),  # non-finite: the NaN scale code
    ([float("-inf"), 2.0], 0x7F, 255),
]


def _hard_tokens(hkv: int, d: int, seed: int) -> torch.Tensor:
    """``[1, L, Hkv, D]`` fp32: token ``t``'s first block (head 0) is ``HARD_BLOCKS[t]``, every
    other block random with a magnitude from e4m3's subnormal scales to past the 448 clamp."""
    gen = torch.Generator().manual_seed(seed)
    n = len(HARD_BLOCKS) + 23
    x = torch.randn(1, n, hkv, d // 16, 16, generator=gen)
    x = (x * 2.0 ** (torch.rand(1, n, hkv, d // 16, 1, generator=gen) * 30 - 18)).flatten(-2)
    for t, (values, _, _) in enumerate(HARD_BLOCKS):
        x[0, t, 0, :32] = 0.0
        x[0, t, 0, : len(values)] = torch.tensor(values)
    return x.to(DEV)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("kind", "per_head"), KINDS, ids=[f"{k}-{'per-head' if p else 'per-tensor'}" for k, p in KINDS]
)
def test_block_scale_choice_matches_reference_on_hard_blocks(
    kind: str, per_head: bool, backend: str
) -> None:
    """Each 4-bit block keeps the better of its two candidate scales, byte for byte with the
    reference on both backends: hand-built blocks with known choices (ties, a classic scale
    of 0, the 448 clamp, zero and non-finite blocks) beside random ones."""
    hkv, d, num_pages, page = 2, 64, 4, 8
    seed = hash((kind, per_head, backend, "hard")) % 2**31
    key = _hard_tokens(hkv, d, seed)
    value = _hard_tokens(hkv, d, seed + 1)
    n = key.shape[1]
    g = torch.tensor([1.0, 2.0**-7] if per_head else 1.0, device=DEV)
    scheme: Fp4Scales
    if kind == "nvfp4":
        scheme = Nvfp4Scales(d, g, g)
    elif kind == "mxfp4":
        scheme = Mxfp4Scales(d)
    else:
        scheme = Fp8KNvfp4VScales(d, g * 4, g)
    slots = torch.randperm(num_pages * page, generator=torch.Generator().manual_seed(seed))
    slots = slots[:n].reshape(1, n).to(DEV)
    got = _written_like_the_reference(key, value, slots, scheme, (num_pages, page, hkv), backend)
    fmt = scheme.v_format
    assert fmt is not None and got.v_scales is not None
    flat = slots.reshape(-1)
    first = got.v_scales.view(torch.uint8)[flat // page, flat % page, 0, 0]  # head 0, block 0
    for t, (_, nvfp4_code, mxfp4_code) in enumerate(HARD_BLOCKS):
        code = nvfp4_code if fmt.global_scale else mxfp4_code
        if code is not None:
            assert int(first[t]) == code, (t, int(first[t]), code)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_rotated_k_is_stored_as_the_codes_of_the_rotated_keys(kind: str, backend: str) -> None:
    """``k_rotation``: K's pages and block scales are those of ``k @ H`` quantized as usual
    (byte for byte on both backends, values past the range and a NaN, which spreads over its
    rotated token, included), V's those of the unrotated scheme; untouched slots keep their
    poison."""
    bsz, seq, hkv, d, num_pages, page = 2, 5, 2, 64, 4, 8
    key, value = _new_tokens(bsz, seq, hkv, d, seed=11)
    slots = _slots(bsz, seq, num_pages * page, seed=11)
    plain = _scheme(kind, hkv, d, per_head=False)
    view = plain.kernel_view()
    h = hadamard(d).to(DEV)
    scheme = (Nvfp4Scales(d, view.k_scale, view.v_scale, h) if kind == "nvfp4"
              else Mxfp4Scales(d, h))  # fmt: skip
    got = _pages(scheme, num_pages, page, hkv)
    unrotated = _clone(got)
    write_kv(key, value, got, slots, scheme, backend=backend)
    write_fp4_reference(key, value, unrotated, slots, plain)
    flat = slots.reshape(-1)
    keep = flat >= 0
    pg, off = flat[keep] // page, flat[keep] % page
    fmt = scheme.k_format
    assert fmt is not None and got.k_scales is not None
    packed, codes = quantize_fp4(key.reshape(-1, hkv, d)[keep].float() @ h, fmt, view.k_scale)
    assert torch.equal(got.k[pg, off], packed)
    assert torch.equal(got.k_scales[pg, off].view(torch.uint8), codes.view(torch.uint8))
    for name in ("v", "v_scales"):  # V as the unrotated scheme stores it; the rest untouched
        assert torch.equal(_bytes(got)[name], _bytes(unrotated)[name]), name
    written = torch.zeros(num_pages * page, dtype=torch.bool, device=DEV)
    written[flat[keep]] = True
    assert torch.equal(_bytes(got)["k"].flatten(0, 1)[~written],
                       _bytes(unrotated)["k"].flatten(0, 1)[~written])  # fmt: skip


def test_a_rotation_that_does_not_fit_is_refused_when_built() -> None:
    one = torch.tensor(1.0)
    with pytest.raises(ScaleFormatError, match="power-of-two head_dim >= 16"):
        Nvfp4Scales(48, one, one, torch.eye(48))
    with pytest.raises(ScaleFormatError, match=r"k_rotation has shape \(32, 32\); expected"):
        Mxfp4Scales(64, hadamard(32))
    with pytest.raises(ScaleFormatError, match="not orthonormal"):
        Nvfp4Scales(32, one, one, torch.ones(32, 32))
    assert Mxfp4Scales(64).kernel_view().k_rotation is None
    assert Mxfp4Scales(64, hadamard(64)).kernel_view().k_rotation is not None


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "fp8-k-nvfp4-v"])
def test_odd_geometry_and_large_pages(kind: str) -> None:
    """Three KV heads, a head_dim of three blocks (rows padded to powers of two), one token."""
    hkv = 3
    d = 3 * (32 if kind == "mxfp4" else 16)
    scheme = _scheme(kind, hkv, d, per_head=True)
    key, value = (torch.randn(1, 1, hkv, d, device=DEV) * 2 for _ in range(2))
    slots = torch.tensor([[37]], device=DEV)
    got = _pages(scheme, 2, 32, hkv)
    want = _clone(got)
    write_fp4(key, value, got, slots, scheme, backend="triton")
    write_fp4_reference(key, value, want, slots, scheme)
    for name, x in _bytes(want).items():
        assert torch.equal(_bytes(got)[name], x), name


@pytest.mark.parametrize("kind", ["nvfp4", "fp8-k-nvfp4-v"])
def test_head_dim_of_one_block(kind: str) -> None:
    """head_dim 16: one NVFP4 block (and one scale) per row, several tokens and pages."""
    bsz, seq, hkv, d, num_pages, page = 2, 7, 2, 16, 4, 8
    key, value = _new_tokens(bsz, seq, hkv, d, seed=21)
    slots = _slots(bsz, seq, num_pages * page, seed=21)
    scheme = _scheme(kind, hkv, d, per_head=True)
    _written_like_the_reference(key, value, slots, scheme, (num_pages, page, hkv), "triton")


def _valid(kind: str = "nvfp4") -> tuple[dict[str, Any], Fp4Scales]:
    scheme = _scheme(kind, 2, 32, per_head=False)
    key, value = (torch.randn(1, 2, 2, 32, device=DEV) for _ in range(2))
    args = {"key": key, "value": value, "pages": _pages(scheme, 2, 4, 2)}
    args["slot_mapping"] = torch.tensor([[0, 5]], device=DEV)
    return args, scheme


def _broken(change: str) -> tuple[dict[str, Any], Any]:
    a, scheme = _valid()
    p: Pages = a["pages"]
    if change == "slot-out-of-range":
        a["slot_mapping"] = torch.tensor([[0, 8]], device=DEV)
    elif change == "int32-slots":
        a["slot_mapping"] = a["slot_mapping"].int()
    elif change == "fp8-pages":
        a["pages"] = Pages(p.k.view(torch.float8_e4m3fn), p.v, p.k_scales, p.v_scales)
    elif change == "fp32-block-scales":
        a["pages"] = Pages(p.k, p.v, p.k_scales, torch.ones(2, 4, 2, 2, device=DEV))
    elif change == "missing-block-scales":
        a["pages"] = Pages(p.k, p.v, p.k_scales, None)
    elif change == "wrong-head-dim":
        a["key"] = torch.randn(1, 2, 2, 48, device=DEV)
    elif change == "scheme-head-dim":
        scheme = Nvfp4Scales(64, torch.tensor(1.0, device=DEV), torch.tensor(1.0, device=DEV))
    elif change == "per-head-scale-for-three-heads":
        g = torch.ones(3, device=DEV)
        scheme = Nvfp4Scales(32, g, g)
    elif change == "strided-pages":
        k = torch.zeros(2, 4, 2, 32, dtype=torch.uint8, device=DEV)[..., ::2]
        a["pages"] = Pages(k, p.v, p.k_scales, p.v_scales)
    elif change == "shared-memory":
        a["pages"] = Pages(p.k, p.k, p.k_scales, p.v_scales)
    elif change == "fp8-scheme":
        scheme = PerTensorScales(torch.tensor(1.0, device=DEV), torch.tensor(1.0, device=DEV))
    return a, scheme


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("slot-out-of-range", "slot 8"),
        ("int32-slots", "slot_mapping has dtype torch.int32"),
        ("fp8-pages", "k_pages has dtype torch.float8_e4m3fn"),
        ("fp32-block-scales", "v_block_scales has dtype torch.float32"),
        ("missing-block-scales", "Pages.v_scales is None"),
        ("wrong-head-dim", r"key has shape \(1, 2, 2, 48\)"),
        ("scheme-head-dim", r"k_pages has shape \(2, 4, 2, 16\); expected \(2, 4, 2, 32\)"),
        ("per-head-scale-for-three-heads", r"k_global_scale has shape \(3,\)"),
        ("strided-pages", "k_pages is written in place but has strides"),
        ("shared-memory", "share memory"),
        ("fp8-scheme", "expected a 4-bit scheme"),
    ],
)
def test_a_refused_write_leaves_every_tensor_untouched(
    change: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVQUANT_CHECK_VALUES", "1")  # the slot check on a GPU too
    a, scheme = _broken(change)
    before = _bytes(a["pages"])
    with pytest.raises(KernelInputError, match=match):
        write_fp4(**a, scheme=scheme, backend="torch")
    for name, old in before.items():
        assert torch.equal(_bytes(a["pages"])[name], old), name


def test_write_kv_routes_4bit_schemes_and_refuses_their_pages_for_fp8() -> None:
    a, scheme = _valid("mxfp4")
    before = _bytes(a["pages"])
    write_kv(a["key"], a["value"], a["pages"], a["slot_mapping"], scheme, backend="torch")
    assert not torch.equal(_bytes(a["pages"])["v"], before["v"])
    fp8 = PerTensorScales(torch.tensor(1.0, device=DEV), torch.tensor(1.0, device=DEV))
    with pytest.raises(KernelInputError, match="both static scales and group scales"):
        write_kv(a["key"], a["value"], a["pages"], a["slot_mapping"], fp8, backend="torch")


def test_unknown_backend_is_refused_before_writing() -> None:
    a, scheme = _valid()
    before = _bytes(a["pages"])
    with pytest.raises(BackendError, match="backend='cuda' is not a backend"):
        write_fp4(**a, scheme=scheme, backend="cuda")
    for name, old in before.items():
        assert torch.equal(_bytes(a["pages"])[name], old), name


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "fp8-k-nvfp4-v"])
def test_gpu_write_matches_reference_at_model_sizes(kind: str) -> None:
    """Model-sized write on CUDA (8 KV heads, head_dim 128, a 256-token prefill)."""
    hkv, d = 8, 128
    scheme = _scheme(kind, hkv, d, per_head=False)
    key, value = _new_tokens(2, 128, hkv, d, seed=7)
    slots = _slots(2, 128, 64 * 16, seed=7)
    got = _pages(scheme, 64, 16, hkv)
    want = _clone(got)
    write_fp4(key, value, got, slots, scheme, backend="triton")
    write_fp4_reference(key, value, want, slots, scheme)
    for name, x in _bytes(want).items():
        assert torch.equal(_bytes(got)[name], x), name


@pytest.mark.parametrize(("kind", "per_head"), [("nvfp4", False), ("fp8-k-nvfp4-v", True)])
def test_write_with_one_token_per_program_matches_reference(
    kind: str, per_head: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 4-bit write with one token per program (a decode step's on a GPU) stores what the
    reference stores, byte for byte."""
    from kvquant.kernels.write_fp4 import launch

    monkeypatch.setattr(launch, "tokens_per_program", lambda t, n, device, least=1: least)
    bsz, seq, hkv, d, num_pages, page = 2, 3, 2, 64, 4, 8
    seed = hash((kind, per_head, "one-token")) % 2**31
    key, value = _new_tokens(bsz, seq, hkv, d, seed)
    slots = _slots(bsz, seq, num_pages * page, seed)
    scheme = _scheme(kind, hkv, d, per_head)
    _written_like_the_reference(key, value, slots, scheme, (num_pages, page, hkv), "triton")
