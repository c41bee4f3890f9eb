"""kvquant.calibrate.evaluate and fp8: the simulated formats against the kernels, the measured report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from calibration_models import planted

from kvquant.calibrate import (
    ChannelStatistics,
    calibrate,
    write_calibrated_checkpoint,
)
from kvquant.calibrate.evaluate import Candidate, FormatEvaluator
from kvquant.calibrate.fp8 import fake_quantize_static, hadamard_matrix, k_transform_keys
from kvquant.errors import CalibrationError
from kvquant.kernels import paged_attention_reference, write_kv_reference
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.schemes import FirstTokens, KTransformScales, Pages

pytest.importorskip("transformers")

E4M3_MAX = 448.0


def _paged(key: torch.Tensor, value: torch.Tensor, page: int) -> tuple[Any, ...]:
    """Page slots for [1, T, H, D] tokens written in order, and a shuffled block table."""
    t = key.shape[1]
    pages = -(-t // page)
    order = torch.randperm(pages + 2)[:pages]
    slots = (order.repeat_interleave(page) * page + torch.arange(page).repeat(pages))[:t]
    k_pages = torch.zeros(pages + 2, page, key.shape[2], key.shape[3], dtype=torch.float8_e4m3fn)
    return k_pages, k_pages.clone(), slots.view(1, -1), order.to(torch.int32).view(1, -1)


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("first", [0, 2])
def test_simulation_equals_the_reference_kernels(rotate: bool, first: int) -> None:
    """Codes bit for bit, attention within fp32 rounding (another summation order)."""
    torch.manual_seed(7)
    t, hkv, hq, d = 37, 2, 4, 16
    key = torch.randn(1, hkv, t, d) * 3 + torch.randn(1, hkv, 1, d) * 10
    value = torch.randn(1, hkv, t, d)
    query = torch.randn(1, hq, t, d)
    k_scale = torch.rand(hkv) * 0.02 + 0.01
    v_scale = torch.rand(hkv) * 0.01 + 0.005
    offset = torch.randn(hkv, d) * 10
    rot = hadamard_matrix(d) if rotate else None
    cand = Candidate(
        "kt", True, k_scale[None], v_scale[None], k_offset=offset[None], rotation=rot,
        first_tokens=first,
    )  # fmt: skip
    q_sim, k_sim, v_sim = cand.simulate(0, query, key, value)

    k_pages, v_pages, slots, table = _paged(key.transpose(1, 2), value.transpose(1, 2), 8)
    scheme = KTransformScales(k_scale, v_scale, k_offset=offset, k_rotation=rot, first_tokens=first)
    pages = Pages(k_pages, v_pages)
    write_kv_reference(key.transpose(1, 2), value.transpose(1, 2), pages, slots, scheme)
    stored = k_pages.view(-1, hkv, d)[slots[0]].float() * k_scale[None, :, None]
    expect_k = (stored + offset).transpose(0, 1)[None]
    if first:
        kr = key @ rot if rot is not None else key
        expect_k[:, :, :first] = kr[:, :, :first]
    assert torch.equal(k_sim, expect_k)  # the same codes: stored K equal bit for bit
    v_stored = v_pages.view(-1, hkv, d)[slots[0]].float() * v_scale[None, :, None]
    assert torch.equal(v_sim[:, :, first:], v_stored.transpose(0, 1)[None][:, :, first:])
    # dense(): the model frame again
    dense = dequantize_pages(k_pages, k_scale, None, k_offset=offset, k_rotation=rot)
    model_frame = dense.view(-1, hkv, d)[slots[0]].transpose(0, 1)[None]
    back = (expect_k @ rot.T) if rot is not None else expect_k
    assert torch.allclose(model_frame[:, :, first:], back[:, :, first:], atol=1e-5)

    scaling = d**-0.5
    group = hq // hkv
    sim = torch.nn.functional.scaled_dot_product_attention(
        q_sim, k_sim.repeat_interleave(group, 1), v_sim.repeat_interleave(group, 1),
        is_causal=True, scale=scaling,
    )  # fmt: skip
    firsts = None
    if first:
        kr = (key @ rot) if rot is not None else key
        firsts = FirstTokens(
            kr[:, :, :first].transpose(1, 2).contiguous(),
            value[:, :, :first].transpose(1, 2).contiguous(),
            torch.tensor([first], dtype=torch.int32),
        )
    ref = paged_attention_reference(
        query.transpose(1, 2), pages, table, torch.tensor([t], dtype=torch.int32), scheme,
        sm_scale=scaling, first=firsts,
    )  # fmt: skip
    out = ref.transpose(1, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(sim, out, rtol=1e-5, atol=1e-5)
    # and it is not the exact attention: rounding is visible
    exact = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
        is_causal=True, scale=scaling,
    )  # fmt: skip
    assert float((exact - out).abs().max()) > 1e-4


def test_k_transform_keys_keep_nan_and_clamp() -> None:
    key = torch.full((1, 1, 3, 4), 1e6)
    key[0, 0, 2, 1] = float("nan")
    out = k_transform_keys(key, torch.tensor([1.0]), torch.zeros(1, 4), None, 0)
    assert torch.all(out[0, 0, :2] == E4M3_MAX)
    assert torch.isnan(out[0, 0, 2, 1])
    v = fake_quantize_static(torch.tensor([[[[float("nan"), 2.0]]]]), torch.tensor(1.0))
    assert torch.isnan(v[0, 0, 0, 0]) and float(v[0, 0, 0, 1]) == 2.0


def test_evaluator_ranks_the_offset_above_per_head_on_offset_keys() -> None:
    """Keys riding on a large per-channel constant: the k-transform's error is far lower."""
    torch.manual_seed(0)
    t, hkv, hq, d = 64, 2, 4, 16
    key, _ = planted(1, hkv, t, d, seed=5)
    value = torch.randn(1, hkv, t, d)
    query = torch.randn(1, hq, t, d)
    ch = ChannelStatistics(1, hkv, d, first_tokens=1)
    ch.update(0, key)
    c, k_s = ch.k_transform(rotate=False, apart=True)
    head_k = key.abs().amax(dim=(0, 2, 3))[None] / E4M3_MAX
    v_s = value.abs().amax(dim=(0, 2, 3))[None] / E4M3_MAX
    cands = (
        Candidate("per-head", True, head_k, v_s),
        Candidate("fp32-group G=32", False, group_size=16),
        Candidate("kt", True, k_s, v_s, k_offset=c, first_tokens=1),
    )
    ev = FormatEvaluator(cands, 2, 1, hkv)
    ev.observe(0, query, key, value, d**-0.5)
    ev.num_tokens = t
    rep = ev.report(ch.near_constant_share(), "kt", held_out_windows=1)
    err = rep.scores
    assert all(math.isfinite(e) and e > 0 for e in err.values())
    assert err["kt"] < 0.5 * err["per-head"]
    assert rep.best_static == "kt" and rep.dynamic_g32_beats_best_static is not None
    # the written format's fractions: nothing clips at amax, the sink is not counted
    assert float(rep.k_clip.max()) == 0.0 and float(rep.v_clip.max()) == 0.0
    assert 0.0 <= float(rep.k_subnormal.min()) <= float(rep.k_subnormal.max()) < 0.05
    assert float(rep.near_constant.min()) > 0.9  # sd 1 against |offset| ~ 20
    # a layer that never ran is a clear error
    with pytest.raises(CalibrationError, match="never ran"):
        FormatEvaluator(cands, 2, 2, hkv).report(torch.zeros(2, hkv), "kt")


def test_report_fields_on_a_tiny_model(tiny_kt: Any) -> None:
    model, _ = tiny_kt
    ids = torch.randint(0, 128, (1, 4 * 96))
    res = calibrate(model, ids, window=96, granularity="k-transform", progress=False)
    assert res.granularity == "k-transform" and res.rotation == "hadamard"
    assert res.first_tokens == 1 and res.k_offset is not None
    assert res.k_offset.shape == (2, 2, 64) and res.k_scales.shape == (2, 2)
    assert res.num_tokens == 3 * 96  # one window of four held out
    rep = res.report
    assert rep is not None and rep.held_out_tokens == 96 and rep.held_out_windows == 1
    assert rep.candidates == (
        "per-tensor",
        "per-head",
        "fp32-group G=64",
        "fp32-group G=32",
        "k-transform (hadamard, first tokens)",
        "k-transform (offset only, first tokens)",
        "k-transform (hadamard, no first tokens)",
    )
    assert rep.static == (True, True, False, False, True, True, True)
    assert rep.dynamic_g32_beats_best_static is not None and not rep.notes
    assert rep.chosen == "k-transform (hadamard, first tokens)"
    assert rep.error.shape == (len(rep.candidates), 2, 2)
    assert torch.isfinite(rep.error).all() and float(rep.error.min()) > 0
    for t in (rep.k_clip, rep.k_subnormal, rep.v_clip, rep.v_subnormal, rep.near_constant):
        assert t.shape == (2, 2) and float(t.min()) >= 0 and float(t.max()) <= 1
    assert rep.best_static in rep.candidates
    d = json.loads(json.dumps(res.to_dict()))
    assert d["report"]["best_static"] == rep.best_static
    assert d["rotation"] == "hadamard" and d["first_tokens"] == 1
    assert len(d["report"]["layers"]) == 2
    text = res.render()
    assert "Written: k-transform scales" in text and "read by kvquant" in text
    assert "k-transform, no exact first token" in text and "kt-nofirst" not in text
    assert "K near-const" not in text and len(text.splitlines()) < 45  # no per-layer tables
    full = res.render(full=True, width=80)
    assert "kt-nofirst: k-transform, no exact first token" in " ".join(full.split())
    assert max(len(line) for line in full.splitlines()) <= 80
    # one window: nothing to hold out, no measured report
    assert calibrate(model, ids[:, :96], window=96, progress=False).report is None
    with pytest.raises(CalibrationError, match="held_out_tokens=-1"):
        calibrate(model, ids, window=96, held_out_tokens=-1, progress=False)


def test_harness_simulation_matches_kvquant_on_the_written_checkpoint(
    tiny_kt: Any, tmp_path: Path
) -> None:
    """simulate_fp8_kv('k-transform') == kvquant.patch on the calibrated checkpoint, fp32 rounding."""
    from transformers import DynamicCache

    import kvquant
    from benchmarks.harness import accuracy as A

    model, src = tiny_kt
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 2 * 96))
    res = calibrate(model, ids, window=96, granularity="k-transform", progress=False)
    out = write_calibrated_checkpoint(src, res, tmp_path / "kt", "kvquant")
    kt = A.KTransformScales.from_result(res)
    evaluation = torch.randint(0, 128, (1, 50))
    with A.simulate_fp8_kv(model, "k-transform", kt, exact_prompt=True):
        sim = A.teacher_forced(model, evaluation, cache_factory=DynamicCache)
    with A.simulate_fp8_kv(model, "none"):
        exact = A.teacher_forced(model, evaluation)
    handle = kvquant.patch(model, scales=out, backend="torch", recent_tokens=0)
    try:
        real = A.teacher_forced(
            model, evaluation, cache_factory=lambda: handle.new_cache(max_cache_tokens=128)
        )
    finally:
        handle.remove()
    assert torch.isfinite(sim.nll).all() and torch.isfinite(real.nll).all()
    torch.testing.assert_close(sim.nll, real.nll, rtol=1e-4, atol=1e-4)
    assert float((sim.nll - exact.nll).abs().max()) > 1e-5  # FP8 rounding is visible
    # the harness and the report simulate the same numbers
    q, k, v = torch.randn(1, 4, 20, 64), torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    spec = A._SimSpec(mode="k-transform", scales=kt)
    from kvquant.calibrate.evaluate import candidate_of

    for a, b in zip(
        A._k_transform(spec, 1, q, k, v), candidate_of(res).simulate(1, q, k, v), strict=True
    ):
        assert torch.equal(a, b)
    with pytest.raises(CalibrationError, match="k-transform one"):
        A.KTransformScales.from_result(calibrate(model, ids, window=96, progress=False))
