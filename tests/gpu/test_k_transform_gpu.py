"""The K transform (offset, Hadamard rotation, first tokens) on a CUDA GPU at realistic sizes.

Run through the device tool: ``PYTHONPATH=. pytest -m gpu tests/gpu``. The write kernel's
codes equal the reference's bit for bit with an offset alone; with a rotation its fp32
``tl.dot`` sums in another order than torch's matmul, so a code may sit one step away where
the rotated value lies within an fp32 rounding of a rounding boundary (counted: at most
0.1 % of the codes, never more than one step). Attention is compared with the fp32
reference within 5e-3 over NaN-poisoned outputs, pages and first-token slots.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numerics import assert_close_rel
from paged_cases import build_case

from kvquant.kernels import hadamard, page_storage, write_kv, write_kv_reference
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.schemes import KTransformScales, Pages

pytestmark = pytest.mark.gpu
REL_TOL = 5e-3


def _code_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Signed distance in FP8 codes (same-sign codes are ordered like their bytes)."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    same_sign = (g & 0x80) == (w & 0x80)
    steps = ((g & 0x7F) - (w & 0x7F)).abs()
    return torch.where(same_sign, steps, 255)


@pytest.mark.parametrize("transform", ["offset", "rotation", "both"])
@pytest.mark.parametrize("hkv, d", [(8, 128), (3, 64), (2, 256), (1, 16)])
def test_write_codes_match_reference(transform: str, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hkv * d)
    bsz, seq, num_pages, page = 4, 300, 120, 16
    key = torch.randn(bsz, seq, hkv, d, generator=gen) * 2
    key[..., 3] += 25.0
    key = key.to("cuda", torch.bfloat16)
    value = torch.randn(bsz, seq, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    rot = hadamard(d, device="cuda") if transform != "offset" else None
    rotated = key.float() if rot is None else key.float() @ rot
    off = rotated.mean(dim=(0, 1)) if transform != "rotation" else None
    stored = rotated if off is None else rotated - off
    ks = (stored.abs().amax(dim=(0, 1, 3)) / 448).contiguous()
    vs = (value.float().abs().amax(dim=(0, 1, 3)) / 448).contiguous()
    slots = torch.randperm(num_pages * page, generator=gen)[: bsz * seq].view(bsz, seq).cuda()
    kp, vp = page_storage(num_pages, page, hkv, d, device="cuda")
    kp_ref, vp_ref = kp.clone(), vp.clone()
    scheme = KTransformScales(ks, vs, off, rot)
    write_kv(key, value, Pages(kp, vp), slots, scheme, backend="triton")
    write_kv_reference(key, value, Pages(kp_ref, vp_ref), slots, scheme)
    torch.cuda.synchronize()
    assert torch.equal(vp.view(torch.uint8), vp_ref.view(torch.uint8))
    steps = _code_steps(kp, kp_ref)
    if rot is None:
        assert int(steps.max()) == 0
    else:
        assert int(steps.max()) <= 1
        assert int((steps > 0).sum()) <= 1e-3 * steps.numel()


# (build_case kwargs, launcher extras): per-head scales, biased K, Hadamard + offset
KT_GPU: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (dict(lens=[1, 333, 4096, 2500, 17], hq=32, hkv=8, d=128, first_lens=[1, 1, 1, 1, 1]), {}),
    (dict(lens=[1, 333, 4096, 2500, 17], hq=9, hkv=3, d=64, first_lens=[1, 0, 2, 1, 1]), {}),
    (dict(lens=[8000, 1, 999], hq=32, hkv=8, d=128, kv_start=[0, 0, 37],
          first_lens=[1, 1, 1], hf_layout=True), {"num_splits": 7}),
    (dict(lens=[3000, 70], hq=32, hkv=8, d=128, lq=4, q_lens=[4, 3], first_lens=[1, 1]), {}),
    (dict(lens=[3000, 700], hq=32, hkv=8, d=128, softcap=30.0, window=512,
          first_lens=[1, 1]), {}),
    (dict(lens=[1200, 300, 2000], hq=32, hkv=8, d=128, lq=300, q_lens=[300, 300, 171],
          first_lens=[1, 1, 1]), {}),
    (dict(lens=[1500, 256], hq=32, hkv=8, d=128, lq=256, kv_start=[100, 17],
          first_lens=[1, 0]), {}),
    (dict(lens=[1200, 300], hq=16, hkv=2, d=256, lq=300, first_lens=[2, 1]), {}),
]  # fmt: skip


@pytest.mark.parametrize("transform", ["offset", "rotation", "both"])
@pytest.mark.parametrize("case_kw, extra", KT_GPU, ids=[f"case{i}" for i in range(len(KT_GPU))])
def test_attention_matches_reference(
    transform: str, case_kw: dict[str, Any], extra: dict[str, Any]
) -> None:
    n_first = max(case_kw["first_lens"])
    case = build_case(
        **case_kw, granularity="per-head", k_transform=transform, n_first=n_first,
        first_dtype=torch.bfloat16, qdtype=torch.bfloat16, device="cuda",
        seed=sum(case_kw["lens"]) % 1000,
    )  # fmt: skip
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")
    case.attend(paged_attention_triton, out=out, **extra)
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=f"{transform} {case_kw} {extra}")


# the query rotation in its one form (TF32 tensor-core dots in the kernel; the launcher's other
# rotation and latency choices were retired: docs/dev/kernels.md); TF32 runs on tensor cores
# only here (the interpreter computes every dot in fp32)
ROT_VARIANTS: list[dict[str, Any]] = [{}]
ROT_IDS = ["kernel-tf32"]


@pytest.mark.parametrize("rot", ROT_VARIANTS, ids=ROT_IDS)
@pytest.mark.parametrize("case_i", [0, 1, 3, 5], ids=lambda i: f"case{i}")
def test_rotation_variants_match_reference(rot: dict[str, Any], case_i: int) -> None:
    """Each rotation choice over decode (both geometries, speculative) and chunked prefill."""
    case_kw, extra = KT_GPU[case_i]
    case = build_case(
        **case_kw, granularity="per-head", k_transform="both",
        n_first=max(case_kw["first_lens"]), first_dtype=torch.bfloat16, qdtype=torch.bfloat16,
        device="cuda", seed=sum(case_kw["lens"]) % 1000 + 1,
    )  # fmt: skip
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")
    config = {**extra.get("config", {}), **rot}
    case.attend(paged_attention_triton, out=out, **{**extra, "config": config})
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=f"{rot} {case_kw}")


@pytest.mark.parametrize("rot", ROT_VARIANTS, ids=ROT_IDS)
def test_rotation_variants_inside_a_cuda_graph(rot: dict[str, Any]) -> None:
    """Split decode with the transform and first tokens, captured and replayed."""
    case = build_case(
        [5000, 300], hq=32, hkv=8, d=128, granularity="per-head", k_transform="both",
        first_lens=[1, 1], n_first=1, qdtype=torch.bfloat16, device="cuda", seed=3,
    )  # fmt: skip
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")

    def call() -> None:  # the case's objects are built: nothing read on the host
        case.attend(paged_attention_triton, out=out, num_splits=4, config=rot)

    call()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=str(rot))
