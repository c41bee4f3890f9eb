"""Paged attention over 4-bit K and/or V pages: Triton (interpreted on CPU) vs the reference.

NVFP4 and MXFP4 K may be stored rotated (``k_rotation``, the Hadamard matrix): both backends
rotate the query alike.

Each case writes fresh random K/V through ``write_kv`` (the torch reference write) into
shuffled pages whose unwritten slots hold random bytes and NaN block-scale codes (a read past a
sequence's end or through an unused block-table entry gives NaN), with -1 in unused
block-table entries, and attends into an output pre-filled with NaN (an unwritten element
fails). The reference is ``paged_attention`` with ``backend="torch"``, the same paged layout
dequantized by ``dequantize_fp4``. Tolerance: ‖out − ref‖ / ‖ref‖ <= 5e-3, as for FP8: the
kernel's only roundings beyond the reference are fp16 queries and probabilities (an NVFP4 tile
without its global scale, ``e2m1 * e4m3``, is exact in fp16). The queries are fp16 or fp32:
the interpreter's ``tl.dot`` on bf16 is garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from numerics import assert_close_rel
from paged_cases import shuffled_pages

from kvquant.errors import KernelInputError
from kvquant.kernels import hadamard, page_storage, paged_attention, write_kv
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.fp4 import dequantize_fp4, fp4_page_storage
from kvquant.schemes import (
    FirstTokens,
    Fp4Format,
    Fp4Scales,
    Fp8KNvfp4VScales,
    Mask,
    Mxfp4Scales,
    Nvfp4Scales,
    Pages,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = 5e-3


@dataclass
class Case:
    query: torch.Tensor
    pages: Pages
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scheme: Fp4Scales
    mask: Mask
    key: torch.Tensor
    value: torch.Tensor


def _scheme(kind: str, hkv: int, d: int, amax: tuple[torch.Tensor, torch.Tensor]) -> Fp4Scales:
    k_amax, v_amax = amax
    if kind == "nvfp4":
        return Nvfp4Scales(d, k_amax / 2688, v_amax / 2688)
    if kind == "nvfp4-unit":  # the calibration-free global scale
        one = torch.tensor(1.0)
        return Nvfp4Scales(d, one, one)
    if kind == "mxfp4":
        return Mxfp4Scales(d)
    if kind == "nvfp4-rotated":  # K stored as the 4-bit codes of k @ H, the query rotated alike
        one = torch.tensor(1.0)
        return Nvfp4Scales(d, one, one, hadamard(d))
    if kind == "mxfp4-rotated":
        return Mxfp4Scales(d, hadamard(d))
    if kind == "fp8-k-nvfp4-v":
        return Fp8KNvfp4VScales(d, k_amax / 448, v_amax / 2688)
    raise ValueError(kind)


def _side(fmt: Fp4Format | None, num_pages: int, page: int, hkv: int, d: int) -> tuple[Any, Any]:
    """Poisoned pages: random bytes and NaN block-scale codes (FP8: NaN codes)."""
    if fmt is None:
        pages = page_storage(num_pages, page, hkv, d)[0]
        pages.view(torch.uint8).fill_(0x7F)
        return pages, None
    pages, scales = fp4_page_storage(num_pages, page, hkv, d, fmt)
    pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
    scales.view(torch.uint8).fill_(fmt.nan_scale_code)
    return pages, scales


def build(
    kind: str,
    lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    page: int = 16,
    lq: int = 1,
    per_head: bool = False,
    qdtype: torch.dtype = torch.float16,
    seed: int = 0,
    **mask: Any,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    lmax = max(lens)
    block_tables, slots, num_pages = shuffled_pages(lens, page, gen)
    gain = torch.linspace(0.5, 3.0, hkv).view(1, 1, hkv, 1)
    key = torch.randn(bsz, lmax, hkv, d, generator=gen) * gain
    value = torch.randn(bsz, lmax, hkv, d, generator=gen) * gain.flip(2)
    dims = (0, 1, 3) if per_head else (0, 1, 2, 3)
    scheme = _scheme(kind, hkv, d, (key.abs().amax(dim=dims), value.abs().amax(dim=dims)))
    kp, ks = _side(scheme.k_format, num_pages, page, hkv, d)
    vp, vs = _side(scheme.v_format, num_pages, page, hkv, d)
    pages = Pages(kp, vp, ks, vs)
    write_kv(key, value, pages, slots, scheme, backend="torch")
    options = {k: torch.tensor(v, dtype=torch.int32) if isinstance(v, list) else v
               for k, v in mask.items()}  # fmt: skip
    query = torch.randn(bsz, lq, hq, d, generator=gen).to(qdtype)
    return Case(
        query.to(DEV),
        Pages(*(None if x is None else x.to(DEV) for x in (kp, vp, ks, vs))),
        block_tables.to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
        scheme.to(DEV),
        Mask(**{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in options.items()}),
        key,
        value,
    )


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def run(case: Case, backend: str, **extra: Any) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    fn = paged_attention_triton if extra else paged_attention
    kw = extra if extra else {"backend": backend}
    return fn(  # type: ignore[operator]
        case.query, case.pages, case.block_tables, case.seq_lens, case.scheme,
        sm_scale=case.query.shape[-1] ** -0.5, mask=case.mask, out=out, **kw,
    )  # fmt: skip


# (id, kind, build kwargs, launcher extras: num_splits forces the split-KV decode path)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("decode-nvfp4-gqa4-split2", "nvfp4", dict(lens=[37, 70], hq=8, hkv=2, d=64),
     {"num_splits": 2}),
    ("decode-nvfp4-per-head-page8", "nvfp4",
     dict(lens=[1, 23, 50], hq=4, hkv=2, d=32, page=8, per_head=True), {}),
    ("decode-nvfp4-unit-global-scale", "nvfp4-unit", dict(lens=[45], hq=4, hkv=1, d=64), {}),
    ("decode-mxfp4-gqa4", "mxfp4", dict(lens=[40, 9], hq=8, hkv=2, d=64), {"num_splits": 2}),
    ("decode-fp8-k-nvfp4-v", "fp8-k-nvfp4-v", dict(lens=[33, 64], hq=8, hkv=2, d=64),
     {"num_splits": 3}),
    ("decode-fp8-k-nvfp4-v-per-head-left-padding", "fp8-k-nvfp4-v",
     dict(lens=[50, 50], hq=4, hkv=2, d=64, per_head=True, kv_start=[0, 19]), {}),
    ("prefill-nvfp4-causal", "nvfp4", dict(lens=[40, 25], hq=4, hkv=2, d=64, lq=25,
     q_lens=[25, 25]), {}),
    ("prefill-nvfp4-fp32-query-window", "nvfp4",
     dict(lens=[48], hq=4, hkv=2, d=32, lq=20, qdtype=torch.float32, window=16), {}),
    ("prefill-mxfp4-ragged", "mxfp4", dict(lens=[30, 41], hq=4, hkv=1, d=64, lq=12,
     q_lens=[12, 5]), {}),
    ("prefill-fp8-k-nvfp4-v-softcap", "fp8-k-nvfp4-v",
     dict(lens=[35], hq=8, hkv=2, d=64, lq=35, softcap=5.0), {}),
    ("decode-nvfp4-head-dim-16-split2", "nvfp4", dict(lens=[37, 70], hq=4, hkv=2, d=16),
     {"num_splits": 2}),
    ("decode-nvfp4-head-dim-16-left-padding", "nvfp4",
     dict(lens=[50, 41], hq=4, hkv=2, d=16, kv_start=[0, 11]), {}),
    ("prefill-nvfp4-head-dim-16", "nvfp4", dict(lens=[40, 25], hq=4, hkv=2, d=16, lq=25,
     q_lens=[25, 25]), {}),
    ("decode-nvfp4-rotated-split2", "nvfp4-rotated", dict(lens=[37, 70], hq=8, hkv=2, d=64),
     {"num_splits": 2}),
    ("decode-mxfp4-rotated-left-padding", "mxfp4-rotated",
     dict(lens=[50, 41], hq=4, hkv=2, d=64, kv_start=[0, 11]), {}),
    ("prefill-nvfp4-rotated-fp32-query-ragged", "nvfp4-rotated",
     dict(lens=[30, 41], hq=4, hkv=1, d=32, lq=12, qdtype=torch.float32, q_lens=[12, 5]), {}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "kw", "extra"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triton_matches_reference(kind: str, kw: dict[str, Any], extra: dict[str, Any]) -> None:
    case = build(kind, seed=len(kw) * 7 + len(kind), **kw)
    ref = run(case, "torch")
    got = run(case, "triton", **extra)
    assert_close_rel(got, ref, rel_tol=REL_TOL)


@pytest.mark.parametrize(
    "kind", ["nvfp4", "mxfp4", "fp8-k-nvfp4-v", "nvfp4-rotated", "mxfp4-rotated"]
)
def test_reference_is_attention_over_the_dequantized_tokens(kind: str) -> None:
    """The 4-bit reference against SDPA over the original K/V: 4-bit error, not garbage.

    Measured ‖ref − sdpa‖ / ‖sdpa‖: about 0.09 (nvfp4), 0.10 (mxfp4), 0.07 (fp8-k-nvfp4-v)
    on this problem; the bound 0.2 leaves a margin and fails for a swapped nibble order, a
    missing block scale or a rotated K attended by an unrotated query (errors of order 1).
    """
    case = build(kind, [40], hq=4, hkv=2, d=64, lq=40, qdtype=torch.float32, seed=3)
    ref = run(case, "torch").cpu().float()
    q = case.query.cpu().float().transpose(1, 2)
    k = case.key.repeat_interleave(2, dim=2).transpose(1, 2)
    v = case.value.repeat_interleave(2, dim=2).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rel = float((ref - sdpa.transpose(1, 2)).norm() / sdpa.norm())
    assert rel < 0.2, rel


@pytest.mark.parametrize("kind", ["nvfp4-rotated", "mxfp4-rotated"])
def test_rotated_scores_are_the_unrotated_scores_of_the_stored_keys(kind: str) -> None:
    """With a K rotation the scores are ``(q H)·(k H) = q·k``: the reference over rotated pages
    equals SDPA over the same pages read back in the model's frame (``K H^T``), with no
    rounding between them; an unrotated query gives another output."""
    case = build(kind, [33], hq=4, hkv=2, d=64, lq=33, qdtype=torch.float32, seed=5)
    p, h = case.pages, hadamard(64)
    fmt = case.scheme.k_format
    assert fmt is not None and p.k_scales is not None and p.v_scales is not None
    assert case.scheme.kernel_view().k_rotation is not None
    ids = case.block_tables[0, :3].long().cpu()  # 33 tokens: three pages of 16
    view = case.scheme.kernel_view()
    k_rot = dequantize_fp4(p.k[ids].cpu(), p.k_scales[ids].cpu(), fmt, _cpu(view.k_scale))
    v = dequantize_fp4(p.v[ids].cpu(), p.v_scales[ids].cpu(), fmt, _cpu(view.v_scale))
    k_model, v = (x.flatten(0, 1)[:33].repeat_interleave(2, dim=1).transpose(0, 1)
                  for x in (k_rot @ h.T, v))  # fmt: skip
    q = case.query.cpu().float()[0].transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k_model, v, is_causal=True)
    ref = run(case, "torch").cpu().float()[0].transpose(0, 1)
    assert_close_rel(ref, sdpa, rel_tol=1e-5)
    k_as_is = k_rot.flatten(0, 1)[:33].repeat_interleave(2, dim=1).transpose(0, 1)
    unrotated = torch.nn.functional.scaled_dot_product_attention(q, k_as_is, v, is_causal=True)
    assert float((unrotated - ref).norm() / ref.norm()) > 0.1


def test_a_nan_block_reaches_only_the_rows_that_see_it() -> None:
    """A V block written from a non-finite value dequantizes to NaN: rows that attend over it
    get NaN, as with FP8 (the model's NaN is never hidden); other sequences stay finite."""
    case = build("nvfp4", [20, 20], hq=2, hkv=1, d=32)
    pg = int(case.block_tables[0, 0])
    assert case.pages.v_scales is not None
    case.pages.v_scales.view(torch.uint8)[pg, 3, 0, 1] = 0x7F
    for backend in ("torch", "triton"):
        out = run(case, backend)
        assert out[0].isnan().any() and not out[1].isnan().any(), backend


def test_tiles_of_16_keys_are_refused_with_4bit_pages() -> None:
    """A ``BLOCK_N`` override under 32 with a 4-bit side is refused (16-key tiles of 4-bit
    pages gave wrong attention on an H200); FP8 pages keep taking it."""
    case = build("fp8-k-nvfp4-v", [20], hq=2, hkv=1, d=64)
    with pytest.raises(KernelInputError, match="BLOCK_N=16 with 4-bit pages") as info:
        run(case, "triton", config={"BLOCK_N": 16})
    assert "Fix:" in str(info.value)
    got = run(case, "triton", config={"BLOCK_N": 32})
    assert_close_rel(got, run(case, "torch"), rel_tol=REL_TOL)


def test_4bit_pages_are_checked_against_the_scheme() -> None:
    case = build("mxfp4", [20], hq=2, hkv=1, d=64)
    p = case.pages
    args = (case.query, p, case.block_tables, case.seq_lens)
    bad_pages = Pages(p.k[..., :16], p.v, p.k_scales, p.v_scales)
    with pytest.raises(KernelInputError, match=r"k_pages has shape \(4, 16, 1, 16\)"):
        paged_attention(case.query, bad_pages, *args[2:], case.scheme, sm_scale=0.1)
    strided = Pages(p.k, p.v, p.k_scales, p.v_scales.expand(-1, -1, -1, 2)[..., :1].expand(
        -1, -1, -1, 2))  # fmt: skip
    with pytest.raises(KernelInputError, match="v_block_scales has strides"):
        paged_attention(case.query, strided, *args[2:], case.scheme, sm_scale=0.1)
    # rows at an odd byte offset: the attention kernel reads int32 words
    odd = torch.zeros(p.k.numel() + 1, dtype=torch.uint8, device=p.k.device)[1:].view(p.k.shape)
    with pytest.raises(KernelInputError, match="reads its rows as int32 words"):
        paged_attention(case.query, Pages(odd, p.v, p.k_scales, p.v_scales), *args[2:],
                        case.scheme, sm_scale=0.1, backend="triton")  # fmt: skip
    first = FirstTokens(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64),
                        torch.zeros(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(KernelInputError, match="with the 4-bit scheme 'mxfp4'"):
        paged_attention(*args, case.scheme, sm_scale=0.1, first=first)
    with pytest.raises(KernelInputError, match=r"Pages\.k_scales is None"):
        paged_attention(case.query, Pages(p.k, p.v, None, p.v_scales), *args[2:], case.scheme,
                        sm_scale=0.1)  # fmt: skip


def _shifted_block_scales(p: Pages) -> Pages:
    """The same pages with V's block scales moved one byte off their alignment."""
    assert p.v_scales is not None
    raw = torch.zeros(p.v_scales.numel() + 1, dtype=torch.uint8, device=p.v.device)
    shifted = raw[1:].view(p.v_scales.shape)
    shifted.copy_(p.v_scales.view(torch.uint8))
    return Pages(p.k, p.v, p.k_scales, shifted.view(p.v_scales.dtype))


def test_misaligned_nvfp4_block_scales_are_refused_by_triton_only() -> None:
    """The Triton kernel reads each token's NVFP4 block scales as one load: scales at an offset
    that is not a multiple of a token's row are refused there, taken by the reference."""
    case = build("nvfp4", [20], hq=2, hkv=1, d=64)
    args = (case.query, _shifted_block_scales(case.pages), case.block_tables, case.seq_lens,
            case.scheme)  # fmt: skip
    with pytest.raises(KernelInputError, match="reads each token's 4 block scales as one load"):
        paged_attention(*args, sm_scale=0.1, backend="triton")
    ref = paged_attention(case.query, case.pages, *args[2:], sm_scale=0.1, backend="torch")
    assert torch.equal(paged_attention(*args, sm_scale=0.1, backend="torch"), ref)


def test_misaligned_mxfp4_block_scales_are_taken() -> None:
    """MXFP4's block-scale rows are read without an alignment assumption."""
    case = build("mxfp4", [20], hq=2, hkv=1, d=64)
    args = (case.query, _shifted_block_scales(case.pages), case.block_tables, case.seq_lens,
            case.scheme)  # fmt: skip
    got = paged_attention(*args, sm_scale=0.1, backend="triton")
    assert_close_rel(got, paged_attention(*args, sm_scale=0.1, backend="torch"), rel_tol=REL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "fp8-k-nvfp4-v"])
@pytest.mark.parametrize("lq", [1, 64], ids=["decode", "prefill"])
def test_gpu_matches_reference_at_model_sizes(kind: str, lq: int) -> None:
    """On CUDA: bf16 queries, head_dim 128, GQA 4, sequences of a few hundred tokens."""
    case = build(kind, [300, 129], hq=16, hkv=4, d=128, lq=lq, qdtype=torch.bfloat16,
                 q_lens=[lq, lq])  # fmt: skip
    ref = run(case, "torch")
    got = run(case, "triton")
    assert_close_rel(got.float(), ref.float(), rel_tol=2e-2)
