"""4-bit K in the k-transform's frame (``KTransformNvfp4Scales``, ``KTransformMxfp4Scales``):
Triton (interpreted on CPU) vs the torch reference over the same paged layout.

K is stored as the 4-bit codes of ``k @ R - c`` (V as given), the query is rotated alike, the
offset's term ``(q @ R)·c`` is added to every paged key's score, and the first tokens are
attended from a full-precision side buffer. The write must match the reference byte for byte
(K is rotated and offset in torch before either quantizes it). The attention (decode with split
KV, prefill with ragged queries, left padding, softcap, two first tokens) must match within
5e-3 over outputs pre-filled with NaN and pages whose unwritten slots hold random codes with NaN
block scales; the first tokens' own K slots hold NaN block scales too (the side buffer replaces
them). NVFP4's K global scale is per head and not 1, so that a unit error in the kernel's
``k_mult`` (the 4-bit tile is value / 64 without ``g``) shows. Queries are fp16 or fp32: the
interpreter's ``tl.dot`` on bf16 is garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from numerics import assert_close_rel
from paged_cases import shuffled_pages

from kvquant.errors import KernelInputError, ScaleFormatError
from kvquant.kernels import hadamard, paged_attention, write_kv
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.fp4 import dequantize_fp4, fp4_page_storage
from kvquant.kernels.write_fp4.naive import write_fp4_reference
from kvquant.schemes import (
    FirstTokens,
    Fp4Scales,
    KTransformMxfp4Scales,
    KTransformNvfp4Scales,
    Mask,
    Nvfp4Scales,
    Pages,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = 5e-3


def _scheme(kind: str, key: torch.Tensor, rotate: bool, nf: int) -> Fp4Scales:
    """The transform calibrated on ``key`` [B, L, Hkv, D] (first ``nf`` tokens left out)."""
    d = key.shape[-1]
    rot = hadamard(d) if rotate else None
    k = key[:, nf:].float() @ (rot if rot is not None else torch.eye(d))
    off = k.mean(dim=(0, 1))
    if kind == "nvfp4":
        g = (k - off).abs().amax(dim=(0, 1, 3)) / 2688
        return KTransformNvfp4Scales(d, g, g.flip(0) * 3, off, rot, first_tokens=nf)
    return KTransformMxfp4Scales(d, off, rot, first_tokens=nf)


def _tokens(bsz: int, seq: int, hkv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    key = torch.randn(bsz, seq, hkv, d, generator=gen)
    key[..., 3] += 12.0  # a near-constant channel: what the offset takes out
    # a first token outside the others' range (a sink), not so far that its weight hides the
    # paged keys' offset term (softmax is blind to a term common to every key of a row)
    key[:, 0] *= 2.0
    value = torch.randn(bsz, seq, hkv, d, generator=gen) * 2
    return key, value


def _pages(scheme: Fp4Scales, num_pages: int, page: int, hkv: int, d: int) -> Pages:
    """4-bit K and V pages of random bytes with NaN block-scale codes."""
    fmt = scheme.k_format
    assert fmt is not None
    out = []
    for _ in "kv":
        codes, scales = fp4_page_storage(num_pages, page, hkv, d, fmt)
        codes.copy_(torch.randint(0, 256, codes.shape, dtype=torch.uint8))
        scales.view(torch.uint8).fill_(fmt.nan_scale_code)
        out.append((codes, scales))
    return Pages(out[0][0], out[1][0], out[0][1], out[1][1])


def _parts(p: Pages) -> tuple[Any, ...]:
    return (p.k, p.v, p.k_scales, p.v_scales)


def _bytes(p: Pages) -> list[torch.Tensor]:
    return [x.view(torch.uint8).cpu() for x in _parts(p)]


KINDS = [("nvfp4", 32), ("mxfp4", 64)]


@pytest.mark.parametrize("rotate", [True, False], ids=["rotation-offset", "offset"])
@pytest.mark.parametrize(("kind", "d"), KINDS, ids=[k for k, _ in KINDS])
def test_write_matches_reference_byte_for_byte(kind: str, d: int, rotate: bool) -> None:
    gen = torch.Generator().manual_seed(int(rotate))
    bsz, seq, hkv, num_pages, page = 2, 6, 2, 4, 8
    key, value = _tokens(bsz, seq, hkv, d, gen)
    scheme = _scheme(kind, key, rotate, nf=1)
    key[1, 2, 1, 7] = float("nan")  # a NaN spreads over its rotated token's blocks
    slots = torch.randperm(num_pages * page, generator=gen)[: bsz * seq].reshape(bsz, seq)
    slots[0, 4] = -1
    want = _pages(scheme, num_pages, page, hkv, d)
    tri = Pages(*(x.clone().to(DEV) for x in _parts(want)))
    strided = key.transpose(1, 2).contiguous().transpose(1, 2).to(torch.float16)
    write_kv(strided.to(DEV), value.to(DEV), tri, slots.to(DEV), scheme.to(DEV), backend="triton")
    write_fp4_reference(strided, value, want, slots, scheme)
    for a, b in zip(_bytes(tri), _bytes(want), strict=True):
        assert torch.equal(a, b)
    # K is stored transformed: (dequant(codes) + c) @ R^T comes back near the model's K; the
    # biased channel (12) would be lost to 4-bit rounding without the offset
    view = scheme.kernel_view()
    assert view.k_fp4 is not None and view.k_offset is not None
    pg, off = slots[0, 1] // page, slots[0, 1] % page
    back = dequantize_fp4(want.k[pg, off], want.k_scales[pg, off], view.k_fp4, view.k_scale)  # type: ignore[index]
    back = back + view.k_offset
    if view.k_rotation is not None:
        back = back @ view.k_rotation.T
    assert_close_rel(back, strided[0, 1].float(), rel_tol=0.2)
    tok = slots[1, 2]
    nan_blocks = want.k_scales[tok // page, tok % page].view(torch.uint8)  # type: ignore[index]
    assert bool((nan_blocks == view.k_fp4.nan_scale_code).any())


@dataclass
class Case:
    query: torch.Tensor
    pages: Pages
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scheme: Fp4Scales
    mask: Mask
    first: FirstTokens
    key: torch.Tensor
    value: torch.Tensor


def build(kind: str, lens: list[int], *, hq: int, hkv: int, d: int, lq: int,
          kv_start: list[int], qdtype: torch.dtype = torch.float16, page: int = 8, nf: int = 1,
          rotate: bool = True, seed: int = 0, **mask: Any) -> Case:  # fmt: skip
    """Sequences written through the reference write; first tokens kept rotated at kv_start."""
    gen = torch.Generator().manual_seed(seed)
    bsz, lmax = len(lens), max(lens)
    block_tables, slots, num_pages = shuffled_pages(lens, page, gen)
    key, value = _tokens(bsz, lmax, hkv, d, gen)
    for b, s in enumerate(kv_start):  # the sink at each row's first visible token
        key[b, s] = key[b, 0]
    scheme = _scheme(kind, key, rotate, nf)
    pages = _pages(scheme, num_pages, page, hkv, d)
    write_kv(key, value, pages, slots, scheme, backend="torch")
    rot = scheme.kernel_view().k_rotation
    first_k = torch.stack([key[b, s : s + nf] for b, s in enumerate(kv_start)])
    if rot is not None:
        first_k = first_k @ rot
    first_v = torch.stack([value[b, s : s + nf] for b, s in enumerate(kv_start)])
    nan_code = scheme.kernel_view().k_fp4.nan_scale_code  # type: ignore[union-attr]
    for b, s in enumerate(kv_start):  # the first tokens' K slots are never read
        for p in range(s, s + nf):
            pages.k_scales[slots[b, p] // page, slots[b, p] % page].view(torch.uint8).fill_(  # type: ignore[index]
                nan_code
            )
    lens_first = torch.full((bsz,), nf, dtype=torch.int32)
    first = FirstTokens(
        first_k.to(qdtype).contiguous(), first_v.to(qdtype).contiguous(), lens_first
    )
    options = {k: torch.tensor(v, dtype=torch.int32) if isinstance(v, list) else v
               for k, v in mask.items()} | {"kv_start": torch.tensor(kv_start, dtype=torch.int32)}  # fmt: skip
    query = torch.randn(bsz, lq, hq, d, generator=gen).to(qdtype)
    return Case(
        query.to(DEV),
        Pages(*(x.to(DEV) for x in _parts(pages))),
        block_tables.to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
        scheme.to(DEV),
        Mask(**{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in options.items()}),
        FirstTokens(first.k.to(DEV), first.v.to(DEV), first.lens.to(DEV)),
        key,
        value,
    )


def run(case: Case, backend: str, **extra: Any) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    fn = paged_attention_triton if extra else paged_attention
    kw = extra if extra else {"backend": backend}
    return fn(  # type: ignore[operator]
        case.query, case.pages, case.block_tables, case.seq_lens, case.scheme,
        sm_scale=case.query.shape[-1] ** -0.5, mask=case.mask, first=case.first, out=out, **kw,
    )  # fmt: skip


CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("nvfp4-decode-gqa4-split2", "nvfp4",
     dict(lens=[37, 50], hq=8, hkv=2, d=32, lq=1, kv_start=[0, 9]), {"num_splits": 2}),
    ("nvfp4-decode-offset-only-two-first-tokens", "nvfp4",
     dict(lens=[21], hq=4, hkv=2, d=32, lq=1, kv_start=[3], nf=2, rotate=False), {}),
    ("nvfp4-prefill-ragged", "nvfp4", dict(lens=[30, 41], hq=4, hkv=2, d=32, lq=12,
     kv_start=[0, 5], q_lens=[12, 7]), {}),
    ("nvfp4-prefill-fp32-query-softcap", "nvfp4", dict(lens=[26], hq=4, hkv=1, d=32, lq=26,
     kv_start=[0], qdtype=torch.float32, softcap=4.0), {}),
    ("mxfp4-decode-split2-two-first-tokens", "mxfp4",
     dict(lens=[29, 40], hq=4, hkv=2, d=64, lq=1, kv_start=[0, 6], nf=2), {"num_splits": 2}),
    ("mxfp4-prefill-ragged", "mxfp4", dict(lens=[24], hq=2, hkv=1, d=64, lq=9, kv_start=[2],
     q_lens=[7]), {}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "kw", "extra"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triton_attention_matches_reference(
    kind: str, kw: dict[str, Any], extra: dict[str, Any]
) -> None:
    case = build(kind, seed=len(kw), **kw)
    ref = run(case, "torch")
    assert bool(torch.isfinite(ref).all())  # the first tokens' NaN slots are never read
    got = run(case, "triton", **extra)
    assert_close_rel(got, ref, rel_tol=REL_TOL)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_reference_is_attention_over_the_model_frame_tokens(kind: str) -> None:
    """Against SDPA over the original K/V: the 4-bit K and V error, not garbage.

    Measured ‖ref − sdpa‖ / ‖sdpa‖ 0.067 (NVFP4) and 0.10 (MXFP4); the reference without the
    offset's term (the paged keys' scores off by ``q'·c`` against the first token's) 0.35."""
    d = 32 if kind == "nvfp4" else 64
    case = build(kind, [40], hq=4, hkv=2, d=d, lq=40, kv_start=[0], qdtype=torch.float32, seed=3)
    ref = run(case, "torch").cpu().float()
    q = case.query.cpu().float().transpose(1, 2)
    k = case.key.repeat_interleave(2, dim=2).transpose(1, 2)
    v = case.value.repeat_interleave(2, dim=2).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rel = float((ref - sdpa.transpose(1, 2)).norm() / sdpa.norm())
    assert rel < 0.15, rel


def test_first_tokens_need_a_transform_of_4bit_k() -> None:
    """Plain NVFP4 K still refuses a side buffer; the transform's schemes take it."""
    case = build("nvfp4", [20], hq=2, hkv=1, d=32, lq=1, kv_start=[0])
    one = torch.tensor(1.0, device=DEV)
    args = (case.query, case.pages, case.block_tables, case.seq_lens)
    with pytest.raises(KernelInputError, match=r"with the 4-bit scheme 'nvfp4'.*Fix:"):
        paged_attention(*args, Nvfp4Scales(32, one, one), sm_scale=0.1, first=case.first)
    out = paged_attention(*args, case.scheme, sm_scale=0.1, first=case.first, backend="torch")
    assert bool(torch.isfinite(out).all())


def test_a_transform_that_does_not_fit_is_refused_when_built() -> None:
    g = torch.ones(2)
    with pytest.raises(ScaleFormatError, match=r"k-transform-nvfp4 scales.*k_offset has shape"):
        KTransformNvfp4Scales(32, g, g, torch.zeros(3, 32))
    with pytest.raises(ScaleFormatError, match="not orthonormal"):
        KTransformNvfp4Scales(32, g, g, torch.zeros(2, 32), torch.ones(32, 32))
    with pytest.raises(ScaleFormatError, match="for head_dim 16, the scheme's head_dim is 32"):
        KTransformNvfp4Scales(32, g, g, torch.zeros(2, 16))
    with pytest.raises(ScaleFormatError, match="first_tokens is -1"):
        KTransformMxfp4Scales(32, torch.zeros(2, 32), first_tokens=-1)
    with pytest.raises(ScaleFormatError, match=r"head_dim is 48; expected .* block size 32"):
        KTransformMxfp4Scales(48, torch.zeros(2, 48))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("lq", [1, 64], ids=["decode", "prefill"])
def test_gpu_matches_reference_at_model_sizes(kind: str, lq: int) -> None:
    """On CUDA: bf16 queries and first tokens, head_dim 128, GQA 4, a few hundred tokens."""
    case = build(kind, [300, 129], hq=16, hkv=4, d=128, lq=lq, kv_start=[0, 17],
                 qdtype=torch.bfloat16, page=16, q_lens=[lq, lq])  # fmt: skip
    ref = run(case, "torch")
    got = run(case, "triton")
    assert_close_rel(got.float(), ref.float(), rel_tol=2e-2)
