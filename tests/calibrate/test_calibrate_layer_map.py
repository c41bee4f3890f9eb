"""Per-layer K/V format maps for a byte budget (kvquant.calibrate.layer_map, calibrate(kv_budget=))."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvquant.calibrate.layer_map import (
    LAYER_FORMATS,
    format_bytes,
    lowest_budget,
    propose_layer_formats,
)
from kvquant.choices import layer_kv_formats
from kvquant.errors import CalibrationError, KVQuantError

SIZES = {f: format_bytes(f, 2, 64) for f in LAYER_FORMATS}


def _errors(num_layers: int, seed: int) -> dict[str, list[float]]:
    """Synthetic per-layer errors: FP8 small, the 4-bit formats larger, layers unlike."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {f: [] for f in LAYER_FORMATS}
    for _ in range(num_layers):
        base = rng.uniform(0.5, 4.0)
        out["fp8"].append(0.01 * base * rng.uniform(0.5, 1.5))
        out["fp8-k-nvfp4-v"].append(0.03 * base * rng.uniform(0.5, 1.5))
        out["nvfp4"].append(0.06 * base * rng.uniform(0.5, 1.5))
        out["mxfp4"].append(0.08 * base * rng.uniform(0.5, 1.5))
    return out


def test_bytes_come_from_the_schemes() -> None:
    d, h = 64, 2
    assert SIZES == {
        "fp8": 2 * h * d,
        "fp8-k-nvfp4-v": h * (d + d // 2 + d // 16),
        "nvfp4": 2 * h * (d // 2 + d // 16),
        "mxfp4": 2 * h * (d // 2 + d // 32),
    }
    assert lowest_budget(64) == SIZES["mxfp4"] / SIZES["fp8"]
    assert lowest_budget(16) == format_bytes("nvfp4", 1, 16) / format_bytes("fp8", 1, 16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_map_is_the_least_error_within_the_budget(seed: int) -> None:
    """Against every assignment of 4 formats to 5 layers: within budget and exactly the least."""
    errors = _errors(5, seed)
    combos = list(itertools.product(LAYER_FORMATS, repeat=5))
    fp8_total = 5 * SIZES["fp8"]
    for budget in (1.0, 0.9, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.54):
        proposal = propose_layer_formats(errors, SIZES, budget)
        assert proposal.used_bytes <= budget * fp8_total
        assert proposal.fraction <= budget
        feasible = [
            sum(errors[f][i] for i, f in enumerate(c))
            for c in combos
            if sum(SIZES[f] for f in c) <= budget * fp8_total
        ]
        assert proposal.total_error == pytest.approx(min(feasible), rel=1e-12, abs=0)
        assert [lay.bytes_per_token for lay in proposal.layers] == [
            SIZES[lay.kv_format] for lay in proposal.layers
        ]


def test_a_larger_budget_never_has_more_error() -> None:
    errors = _errors(12, 7)
    budgets = [round(0.54 + 0.01 * i, 2) for i in range(47)]
    totals = [propose_layer_formats(errors, SIZES, b).total_error for b in budgets]
    assert all(a >= b for a, b in itertools.pairwise(totals)), totals
    assert totals[-1] == sum(errors["fp8"])  # budget 1: FP8 everywhere
    # deterministic: the same map again
    first = propose_layer_formats(errors, SIZES, 0.7)
    again = propose_layer_formats(errors, SIZES, 0.7)
    assert [lay.kv_format for lay in first.layers] == [lay.kv_format for lay in again.layers]


def test_the_highest_error_layers_keep_the_wider_format() -> None:
    """FP8 and NVFP4 only, FP8 equally good everywhere: the budget for k FP8 layers keeps the
    k layers NVFP4 hurts most in FP8, and says so."""
    num_layers = 8
    nvfp4 = [0.02, 0.30, 0.05, 0.11, 0.07, 0.25, 0.03, 0.09]
    errors = {"fp8": [0.01] * num_layers, "nvfp4": nvfp4}
    sizes = {"fp8": SIZES["fp8"], "nvfp4": SIZES["nvfp4"]}
    by_harm = sorted(range(num_layers), key=lambda i: -nvfp4[i])
    for k in range(num_layers + 1):
        budget = (k * sizes["fp8"] + (num_layers - k) * sizes["nvfp4"]) / (
            num_layers * sizes["fp8"]
        )
        proposal = propose_layer_formats(errors, sizes, budget)
        kept = sorted(lay.layer for lay in proposal.layers if lay.kv_format == "fp8")
        assert kept == sorted(by_harm[:k])
    one = (sizes["fp8"] + 7 * sizes["nvfp4"]) / (num_layers * sizes["fp8"])
    proposal = propose_layer_formats(errors, sizes, one)
    why = proposal.layers[1].reason
    assert why.startswith("kept FP8: NVFP4 would err 30.00%") and "the highest of 8" in why
    assert proposal.layers[0].reason.startswith("NVFP4: errs 2.00% (FP8 1.00%)")


def test_k_and_v_are_chosen_apart_where_the_split_format_pays() -> None:
    """A layer whose K suffers in 4 bits but V does not gets FP8 K + NVFP4 V."""
    errors = {
        "fp8": [0.01, 0.01, 0.01],
        "fp8-k-nvfp4-v": [0.012, 0.04, 0.04],
        "nvfp4": [0.50, 0.05, 0.05],
    }
    sizes = {f: SIZES[f] for f in errors}
    total = 3 * sizes["fp8"]
    budget = (sizes["fp8-k-nvfp4-v"] + 2 * sizes["nvfp4"]) / total
    proposal = propose_layer_formats(errors, sizes, budget)
    assert [lay.kv_format for lay in proposal.layers] == ["fp8-k-nvfp4-v", "nvfp4", "nvfp4"]
    assert proposal.layers[0].reason.startswith("K kept FP8, V in NVFP4")
    assert "NVFP4 K too would err 50.00%" in proposal.layers[0].reason


def test_the_printed_map_round_trips_into_kv_format() -> None:
    errors = _errors(6, 3)
    proposal = propose_layer_formats(errors, SIZES, 0.7)
    wanted = tuple(lay.kv_format for lay in proposal.layers)
    assert len(set(wanted)) > 1  # a mixed map
    assert layer_kv_formats(proposal.kv_format, 6, "test") == wanted
    assert layer_kv_formats(json.loads(json.dumps(proposal.kv_format_json)), 6, "test") == wanted
    text = proposal.render(width=200)
    literal = text.split("kvquant.patch(model, kv_format=", 1)[1].split(")\n", 1)[0]
    assert layer_kv_formats(eval(literal), 6, "test") == wanted
    as_json = json.loads(text.split("as JSON: ", 1)[1].splitlines()[0])
    assert as_json == proposal.kv_format_json
    data = proposal.to_dict()
    assert data["kv_format"] == proposal.kv_format_json
    assert data["bytes_per_token"] <= 0.7 * data["fp8_bytes_per_token"]
    assert [lay["kv_format"] for lay in data["layers"]] == list(wanted)
    json.dumps(data, allow_nan=False)


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        (0.0, r"kv_budget=0\.0; expected a number in \(0, 1\].*Fix: pass e\.g\. 0\.6"),
        (-0.5, r"kv_budget=-0\.5; expected a number in \(0, 1\]"),
        (1.5, r"kv_budget=1\.5; expected .*FP8 in every layer is the widest map"),
        (math.nan, r"kv_budget=nan; expected a number in \(0, 1\]"),
        (True, r"kv_budget=True; expected a number"),
        ("0.6", r"kv_budget='0\.6'; expected a number"),
        (0.5, r"kv_budget=0\.5 asks for 256 bytes a token, but the narrowest format measured "
         r"here, mxfp4 in every layer, takes 272 \(0\.5312 of FP8's 512\); expected a budget "
         r"from 0\.5313 to 1\. Fix: pass kv_budget \(--kv-budget\) 0\.5313 or more"),
    ],
)  # fmt: skip
def test_bad_budgets_are_refused(budget: Any, match: str) -> None:
    with pytest.raises(CalibrationError, match=match) as err:
        propose_layer_formats(_errors(2, 0), SIZES, budget)
    assert isinstance(err.value, KVQuantError)


def test_bad_errors_are_refused() -> None:
    with pytest.raises(CalibrationError, match=r"expected 'fp8' and any of"):
        propose_layer_formats({"nvfp4": [0.1]}, SIZES, 0.8)
    with pytest.raises(CalibrationError, match=r"one finite error per layer"):
        propose_layer_formats({"fp8": [0.1, 0.2], "nvfp4": [0.1]}, SIZES, 0.8)
    with pytest.raises(CalibrationError, match=r"one finite error per layer"):
        propose_layer_formats({"fp8": [0.1], "nvfp4": [math.inf]}, SIZES, 0.8)
    with pytest.raises(CalibrationError, match=r"no bytes per token for \['nvfp4'\]"):
        propose_layer_formats({"fp8": [0.1], "nvfp4": [0.2]}, {"fp8": 256}, 0.8)


def test_calibrate_proposes_a_map_that_kvquant_patch_takes(tiny_kt: Any, tmp_path: Path) -> None:
    """On a tiny random llama: the 4-bit formats measured, a map within the budget, written
    beside the scales in kvquant-calibration.json, and the written copy patched with it."""
    import kvquant
    from kvquant.calibrate import calibrate, write_calibrated_checkpoint

    model, folder = tiny_kt
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 64))
    res = calibrate(model, ids, window=64, held_out_tokens=64, progress=False, kv_budget=0.8)
    assert res.report is not None and res.layer_map is not None
    assert {"nvfp4", "mxfp4", "fp8-k-nvfp4-v"} <= set(res.report.candidates)
    assert res.report.chosen == "per-tensor"  # the FP8 recommendation is about FP8 only
    assert "NVFP4" not in res.report.recommendation
    proposal = res.layer_map
    assert proposal.fraction <= 0.8 and len(proposal.layers) == 2
    assert proposal.errors["fp8"] == tuple(float(x) for x in res.report.error[0].mean(dim=1))
    assert "Per-layer K/V formats for a budget of 0.8" in res.render()
    assert res.to_dict()["kv_format_map"]["kv_format"] == proposal.kv_format_json
    out = write_calibrated_checkpoint(folder, res, tmp_path / "out")
    written = json.loads((out / "kvquant-calibration.json").read_text())
    assert written["kv_format_map"]["kv_format"] == proposal.kv_format_json
    handle = kvquant.patch(model, scales=out, kv_format=proposal.kv_format_json, backend="torch")
    try:
        grans = [s.granularity for s in handle.state.layer_specs]
    finally:
        handle.remove()
    wanted = ["per-tensor" if lay.kv_format == "fp8" else lay.kv_format for lay in proposal.layers]
    assert grans == wanted


def test_calibrate_refuses_a_budget_before_the_model_runs(tiny_kt: Any) -> None:
    from kvquant.calibrate import calibrate

    model, _ = tiny_kt
    ids = torch.randint(0, 128, (4, 64))
    with pytest.raises(CalibrationError, match=r"narrowest format for this model's head_dim 64 "
                       r"takes 0\.5312 of FP8's KV bytes"):  # fmt: skip
        calibrate(model, ids, window=64, progress=False, kv_budget=0.5)
    with pytest.raises(CalibrationError, match=r"kv_budget=0\.7 with held_out_tokens=0"):
        calibrate(model, ids, window=64, progress=False, kv_budget=0.7, held_out_tokens=0)
    with pytest.raises(CalibrationError, match=r"none of which could be held out"):
        calibrate(model, ids[:1], window=64, progress=False, kv_budget=0.7)


def test_a_k_transform_calibration_measures_fp8_k_beside_nvfp4_v_in_its_frame(
    tiny_kt: Any, tmp_path: Path
) -> None:
    """With a k-transform calibration, ``fp8-k-nvfp4-v`` is measured with K in the transform's
    frame (query rotated, first tokens exact), and a map that names it patches the written
    checkpoint into FP8 k-transform keys beside NVFP4 values."""
    import kvquant
    from kvquant.calibrate import calibrate, write_calibrated_checkpoint
    from kvquant.calibrate.evaluate import four_bit_candidates
    from kvquant.calibrate.fp8 import fake_quantize_fp4, k_transform_keys

    model, folder = tiny_kt
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 64))
    res = calibrate(
        model, ids, window=64, held_out_tokens=64, granularity="k-transform", progress=False,
        kv_budget=0.8,
    )  # fmt: skip
    assert res.report is not None and "fp8-k-nvfp4-v" in res.report.candidates
    cands, notes = four_bit_candidates(res, 64)
    assert not any("fp8-k-nvfp4-v" in n for n in notes)
    cand = next(c for c in cands if c.kv_format == "fp8-k-nvfp4-v")
    assert cand.k_offset is not None and cand.rotation is not None and cand.first_tokens == 1
    q, k, v = (torch.randn(1, 2, 9, 64) for _ in range(3))
    sq, sk, sv = cand.simulate(0, q, k, v)
    assert torch.allclose(sq, q @ cand.rotation)  # scores: q R . (k R - c) / s
    kt = k_transform_keys(k, res.k_scales[0], res.k_offset[0], cand.rotation, 1)
    assert torch.equal(sk, kt)
    assert torch.equal(sv[:, :, :1], v[:, :, :1])  # the first token read exact
    assert torch.equal(sv[:, :, 1:], fake_quantize_fp4(v, "nvfp4")[:, :, 1:])  # V per token
    out = write_calibrated_checkpoint(folder, res, tmp_path / "out", "kvquant")
    handle = kvquant.patch(
        model, scales=out, kv_format={0: "fp8-k-nvfp4-v", 1: "fp8"}, backend="torch"
    )
    try:
        grans = [s.granularity for s in handle.state.layer_specs]
    finally:
        handle.remove()
    assert grans == ["k-transform-k-nvfp4-v", "k-transform"]


@pytest.mark.parametrize("word", ["nvfp4", "mxfp4"])
def test_a_k_transform_calibration_measures_4bit_k_in_its_frame(
    tiny_kt: Any, tmp_path: Path, word: str
) -> None:
    """With a k-transform calibration, ``nvfp4`` / ``mxfp4`` are measured with K in the
    transform's frame (``round_4bit(k R - c) + c``, query rotated, first tokens exact), as a
    map that names them patches the written checkpoint."""
    import kvquant
    from kvquant.calibrate import calibrate, write_calibrated_checkpoint
    from kvquant.calibrate.evaluate import four_bit_candidates
    from kvquant.calibrate.fp8 import fake_quantize_fp4

    model, folder = tiny_kt
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 64))
    res = calibrate(
        model, ids, window=64, held_out_tokens=64, granularity="k-transform", progress=False,
    )  # fmt: skip
    cands, _ = four_bit_candidates(res, 64)
    cand = next(c for c in cands if c.kv_format == word)
    assert cand.k_offset is not None and cand.rotation is not None and cand.first_tokens == 1
    assert cand.k_scale is None and not cand.static
    q, k, v = (torch.randn(1, 2, 9, 64) for _ in range(3))
    sq, sk, sv = cand.simulate(0, q, k, v)
    assert torch.allclose(sq, q @ cand.rotation)
    kr, c = k @ cand.rotation, res.k_offset[0][None, :, None, :]  # type: ignore[index]
    assert torch.equal(sk[:, :, :1], kr[:, :, :1])  # the first token read exact
    assert torch.allclose(sk[:, :, 1:], (fake_quantize_fp4(kr - c, word) + c)[:, :, 1:])
    assert torch.equal(sv[:, :, :1], v[:, :, :1])
    assert torch.equal(sv[:, :, 1:], fake_quantize_fp4(v, word)[:, :, 1:])
    out = write_calibrated_checkpoint(folder, res, tmp_path / "out", "kvquant")
    handle = kvquant.patch(model, scales=out, kv_format={0: word, 1: "fp8"}, backend="torch")
    try:
        grans = [s.granularity for s in handle.state.layer_specs]
    finally:
        handle.remove()
    assert grans == [f"k-transform-{word}", "k-transform"]
