"""Triton paged attention vs the fp32 reference on a CUDA GPU at realistic sizes.

Run through the device tool: ``PYTHONPATH=. pytest -m gpu tests/gpu``.
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

from kvquant.kernels.attention.launch import paged_attention_triton

pytestmark = pytest.mark.gpu
REL_TOL = 5e-3
GRANULARITIES = [
    ("per-tensor", 64),
    ("per-head", 64),
    ("fp32-group", 64),
    ("fp32-group", 128),
    ("fp32-group", 32),
]


def _run(case_kw: dict[str, Any], **extra: Any) -> None:
    case = build_case(**case_kw, device="cuda", seed=sum(case_kw["lens"]) % 1000)
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")
    case.attend(paged_attention_triton, out=out, **extra)
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=f"{case_kw} {extra}")


@pytest.mark.parametrize("gran, g", GRANULARITIES, ids=[f"{a}-{b}" for a, b in GRANULARITIES])
@pytest.mark.parametrize(
    "hq, hkv, d", [(32, 8, 128), (64, 8, 128), (9, 3, 64), (16, 16, 64), (16, 2, 256)]
)
def test_decode_shapes(gran: str, g: int, hq: int, hkv: int, d: int) -> None:
    if g > d:
        pytest.skip("group size larger than head_dim")
    lens = [1, 333, 4096, 2500, 17]
    _run(dict(lens=lens, hq=hq, hkv=hkv, d=d, granularity=gran, group_size=g))


@pytest.mark.parametrize("contiguous", [False, True], ids=["cache-layout", "contiguous-pages"])
@pytest.mark.parametrize("page", [16, 32, 64, 128, 24])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_pages_splits(page: int, splits: int | None, contiguous: bool) -> None:
    _run(
        dict(lens=[8000, 1, 999], hq=32, hkv=8, d=128, page=page, qdtype=torch.bfloat16,
             hf_layout=True, kv_start=[0, 0, 37], contiguous_pages=contiguous),
        num_splits=splits,
    )  # fmt: skip


@pytest.mark.parametrize("gran", ["per-tensor", "fp32-group"])
def test_decode_speculative_and_options(gran: str) -> None:
    base = dict(hq=32, hkv=8, d=128, granularity=gran, qdtype=torch.bfloat16)
    _run(dict(lens=[3000, 70], lq=4, q_lens=[4, 3], **base))
    _run(dict(lens=[3000, 700], kv_start=[0, 300], **base))
    _run(dict(lens=[3000, 700], softcap=30.0, window=512, **base))
    _run(dict(lens=[3000, 700], fp8=torch.float8_e5m2, **base))


@pytest.mark.parametrize(
    "gran, g", GRANULARITIES[:4], ids=[f"{a}-{b}" for a, b in GRANULARITIES[:4]]
)
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (9, 3, 64), (16, 2, 256), (8, 8, 64)])
def test_prefill_shapes(gran: str, g: int, hq: int, hkv: int, d: int) -> None:
    if g > d:
        pytest.skip("group size larger than head_dim")
    _run(
        dict(lens=[1200, 300, 2000], lq=300, q_lens=[300, 300, 171], hq=hq, hkv=hkv, d=d,
             granularity=gran, group_size=g, qdtype=torch.bfloat16)
    )  # fmt: skip


def test_prefill_options() -> None:
    base = dict(hq=32, hkv=8, d=128, qdtype=torch.float16, lq=256)
    _run(dict(lens=[1500, 256], kv_start=[100, 17], **base))
    _run(dict(lens=[1500, 256], softcap=20.0, window=200, **base))
    _run(dict(lens=[1500, 256], causal=False, page=64, **base))
    _run(dict(lens=[1500, 256], kv_start=[100, 17], contiguous_pages=True, page=8, **base))


@pytest.mark.parametrize("contiguous", [False, True], ids=["cache-layout", "contiguous-pages"])
@pytest.mark.parametrize("page", [16, 24, 256])
def test_prefill_group_scale_layouts(page: int, contiguous: bool) -> None:
    """Dequantized tiles: runs of whole pages (dense V and scale runs), partial pages, and
    token-major V pages and scales, behind a left-padded start."""
    _run(
        dict(lens=[1500, 256], lq=256, kv_start=[100, 17], hq=32, hkv=8, d=128, page=page,
             granularity="fp32-group", group_size=64, qdtype=torch.bfloat16,
             contiguous_pages=contiguous)
    )  # fmt: skip


@pytest.mark.parametrize("gran, g", [("per-tensor", 64), ("fp32-group", 64), ("fp32-group", 32)])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("splits", [1, 3])
def test_nan_code_in_a_visible_slot_reaches_the_output(
    gran: str, g: int, which: str, splits: int
) -> None:
    """A NaN FP8 code that a row attends to makes that row NaN, exactly as in the reference."""
    case = build_case([300, 300], hq=8, hkv=2, d=64, granularity=gran, group_size=g,
                      device="cuda", seed=11)  # fmt: skip
    pages = case.pages.k if which == "k" else case.pages.v
    page = int(case.block_tables[1, 5])  # sequence 1, position 5 * 16 + 3
    pages[page, 3, 0, 7] = float("nan")
    ref = case.reference()
    # a NaN key spoils whole rows; a NaN value only its column
    assert bool(torch.isnan(ref[1, :, :4]).any(-1).all()) and not bool(torch.isnan(ref[0]).any())
    out = torch.zeros(case.query.shape, dtype=case.query.dtype, device="cuda")
    case.attend(paged_attention_triton, out=out, num_splits=splits)
    torch.cuda.synchronize()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close_rel(out[0], ref[0], rel_tol=REL_TOL)


@pytest.mark.parametrize("value_gain", [1e4, 1e-4])
@pytest.mark.parametrize("d, g", [(64, 64), (128, 128), (128, 64), (128, 32), (64, 16)])
def test_folded_decode_has_no_range_limit(value_gain: float, d: int, g: int) -> None:
    """Decode folds group scales (one row copy per group): huge and tiny K/V are exact."""
    _run(dict(lens=[500, 77], hq=8, hkv=2, d=d, granularity="fp32-group", group_size=g,
              value_gain=value_gain, qdtype=torch.float32))  # fmt: skip


@pytest.mark.parametrize(
    "lq, config",
    [(1, {"FOLD": 0}), (300, None)],
    ids=["decode-unfolded", "prefill"],
)
def test_dequantized_tiles_beyond_fp16_range_give_non_finite_output(
    lq: int, config: dict[str, int] | None
) -> None:
    """Tiles dequantized in fp16 with |K/V| above ~4094: non-finite output, never a wrong number."""
    case = build_case([300], hq=4, hkv=1, d=64, lq=lq, granularity="fp32-group", group_size=32,
                      value_gain=1e4, device="cuda", seed=3)  # fmt: skip
    out = torch.zeros(case.query.shape, dtype=case.query.dtype, device="cuda")
    case.attend(paged_attention_triton, out=out, config=config)
    assert not bool(torch.isfinite(out).all())


@pytest.mark.parametrize("pdl", [0, 1])
@pytest.mark.parametrize("splits", [1, 5])
def test_programmatic_dependent_launch_on_and_off(pdl: int, splits: int) -> None:
    """Split and unsplit decode agree with the reference with and without PDL launches."""
    _run(dict(lens=[3000, 17, 900], hq=32, hkv=8, d=128, qdtype=torch.bfloat16),
         num_splits=splits, config={"PDL": pdl})  # fmt: skip


def test_pdl_launches_inside_a_cuda_graph() -> None:
    """A split decode (attention + reduction, both PDL launches) captured and replayed."""
    case = build_case([5000, 300], hq=32, hkv=8, d=128, qdtype=torch.bfloat16, device="cuda",
                      seed=2)  # fmt: skip
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device="cuda")

    def call() -> None:  # the case's objects are built: nothing read on the host
        case.attend(paged_attention_triton, out=out, num_splits=4)

    call()  # compile outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, ref, rel_tol=REL_TOL)
