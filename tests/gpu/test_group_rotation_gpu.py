"""fp32-group scales of Hadamard-rotated keys ("rot-K") on a CUDA GPU at realistic sizes.

The write against the torch reference (codes at most one FP8 step apart where the rotated
value rounds differently, group scales within fp32 rounding, V bit for bit); decode and
prefill against the fp32 reference within 5e-3. Run through the device tool:
``PYTHONPATH=. pytest -m gpu tests/gpu/test_group_rotation_gpu.py``.
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

from kvquant.kernels import (
    group_scale_storage,
    hadamard,
    page_storage,
    write_kv,
    write_kv_reference,
)
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.schemes import GroupScales, Pages

pytestmark = pytest.mark.gpu
REL_TOL = 5e-3


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("hkv, d", [(8, 128), (3, 64), (2, 256), (1, 16)])
def test_write_matches_reference(g: int, hkv: int, d: int) -> None:
    if g > d:
        pytest.skip("group size larger than head_dim")
    gen = torch.Generator().manual_seed(hkv * d + g)
    bsz, seq, num_pages, page = 4, 300, 120, 16
    key = torch.randn(bsz, seq, hkv, d, generator=gen) * 2
    key[..., 3] += 25.0
    key = key.to("cuda", torch.bfloat16)
    value = torch.randn(bsz, seq, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randperm(num_pages * page, generator=gen)[: bsz * seq].view(bsz, seq).cuda()
    kp, vp = page_storage(num_pages, page, hkv, d, device="cuda")
    groups = [group_scale_storage(num_pages, page, hkv, d // g, device="cuda") for _ in "kv"]
    pages = Pages(kp, vp, *groups)
    ref = Pages(kp.clone(), vp.clone(), *(x.clone() for x in groups))
    scheme = GroupScales(d, g, hadamard(d, device="cuda"))
    write_kv(key, value, pages, slots, scheme, backend="triton")
    write_kv_reference(key, value, ref, slots, scheme)
    torch.cuda.synchronize()
    assert torch.equal(vp.view(torch.uint8), ref.v.view(torch.uint8))
    assert torch.equal(groups[1], ref.v_scales)
    torch.testing.assert_close(groups[0], ref.k_scales, rtol=1e-6, atol=0)
    gb, wb = kp.view(torch.uint8).int(), ref.k.view(torch.uint8).int()
    steps = torch.where((gb & 0x80) == (wb & 0x80), ((gb & 0x7F) - (wb & 0x7F)).abs(), 255)
    assert int(steps.max()) <= 1
    assert int((steps > 0).sum()) <= 1e-3 * steps.numel()


def _run(case_kw: dict[str, Any], **extra: Any) -> None:
    case = build_case(
        **case_kw, granularity="fp32-group", k_transform="rotation", device="cuda",
        seed=sum(case_kw["lens"]) % 1000,
    )  # fmt: skip
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")
    case.attend(paged_attention_triton, out=out, **extra)
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=f"{case_kw} {extra}")


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (64, 8, 128), (9, 3, 64), (16, 2, 256)])
def test_decode_shapes(g: int, hq: int, hkv: int, d: int) -> None:
    _run(dict(lens=[1, 333, 4096, 2500, 17], hq=hq, hkv=hkv, d=d, group_size=g))


@pytest.mark.parametrize("g", [32, 64])
def test_decode_options(g: int) -> None:
    base = dict(hq=32, hkv=8, d=128, group_size=g, qdtype=torch.bfloat16)
    _run(dict(lens=[3000, 70], lq=4, q_lens=[4, 3], **base))
    _run(dict(lens=[3000, 700], kv_start=[0, 300], **base), num_splits=7)
    _run(dict(lens=[3000, 700], softcap=30.0, window=512, **base))
    _run(dict(lens=[3000, 700], **base), config={"FOLD": 0})


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (9, 3, 64), (16, 2, 256)])
def test_prefill_shapes(g: int, hq: int, hkv: int, d: int) -> None:
    _run(
        dict(lens=[1200, 300, 2000], lq=300, q_lens=[300, 300, 171], hq=hq, hkv=hkv, d=d,
             group_size=g, qdtype=torch.bfloat16)
    )  # fmt: skip


def test_prefill_left_padding_and_window() -> None:
    base = dict(hq=32, hkv=8, d=128, group_size=32, qdtype=torch.float16, lq=256)
    _run(dict(lens=[1500, 256], kv_start=[100, 17], **base))
    _run(dict(lens=[1500, 256], softcap=20.0, window=200, **base))
