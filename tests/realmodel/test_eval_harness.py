"""Fast tests of the accuracy harness (benchmarks.harness), the pinned texts and the scaled-copy writer.

Tiny random Llama models only; the real SmolLM2 runs are in test_smollm2_accuracy.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import benchmarks.harness.accuracy as E
import benchmarks.harness.texts as T
from kvquant.errors import KVQuantError
from kvquant.kernels.fp8 import quantize_fp8

transformers = pytest.importorskip("transformers")


def _tiny_llama(num_layers: int = 3, seed: int = 0) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # larger K/V spread than the default init, so FP8 rounding is visible
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(3.0)
    return model


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (1, n), generator=g)


# ---------------------------------------------------------------- fake quantization


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_fake_quantize_static_equals_reference_quantizer(granularity: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 17, 32, generator=g) * 5
    x[0, 1, 2, 3] = 1e4  # saturates
    if granularity == "per-tensor":
        scale = torch.tensor(0.02)
        bcast = scale
    else:
        scale = torch.tensor([0.01, 0.02, 0.05])
        bcast = scale.view(1, 3, 1, 1)
    expect = quantize_fp8(x, bcast, torch.float8_e4m3fn).float() * bcast
    got = E.fake_quantize_kv(x, scale)
    assert torch.equal(got, expect)
    assert got[0, 1, 2, 3] == pytest.approx(
        448 * float(bcast.reshape(-1)[0 if bcast.dim() == 0 else 1])
    )


def test_fake_quantize_group_is_per_token_head_group_and_keeps_nan() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 5, 32, generator=g)
    x[0, 0, 0, :16] *= 1000.0  # a loud group must not affect its neighbour group
    x[0, 1, 4, 7] = float("nan")
    got = E.fake_quantize_kv(x, None, group_size=16)
    for h in range(2):
        for t in range(5):
            for grp in range(2):
                seg = x[0, h, t, grp * 16 : (grp + 1) * 16]
                if not torch.isfinite(seg).all():
                    continue
                s = seg.abs().amax() / 448.0
                ref = (seg / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
                assert torch.equal(got[0, h, t, grp * 16 : (grp + 1) * 16], ref)
    assert torch.isnan(got[0, 1, 4, 7])
    rel = (got - x).abs() / x.abs().clamp_min(1e-6)
    assert float(rel[torch.isfinite(rel)].max()) <= 2.0**-4 + 1e-6  # e4m3: 3 mantissa bits


def test_fake_quantize_rejects_bad_group_and_head_count() -> None:
    x = torch.randn(1, 2, 3, 24)
    with pytest.raises(KVQuantError, match="does not divide head_dim 24"):
        E.fake_quantize_kv(x, None, group_size=16)
    with pytest.raises(KVQuantError, match="3 entries but K/V have 2 heads"):
        E.fake_quantize_kv(x, torch.ones(3))


# ---------------------------------------------------------------- simulation on a tiny model


def test_simulation_none_is_sdpa_and_is_restored() -> None:
    model = _tiny_llama()
    ids = _ids(40)
    base = E.teacher_forced(model, ids)
    with E.simulate_fp8_kv(model, "none"):
        assert model.config._attn_implementation == E.SIMULATED_ATTENTION
        sim = E.teacher_forced(model, ids)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(sim.argmax, base.argmax)
    assert torch.allclose(sim.nll, base.nll, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="boom"), E.simulate_fp8_kv(model, "fp32-group"):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_kvquant_sim") for m in model.modules())


def test_teacher_forced_matches_cross_entropy_of_full_logits() -> None:
    model = _tiny_llama()
    ids = _ids(33)
    stats = E.teacher_forced(model, ids, chunk=7)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    assert torch.allclose(stats.nll, nll, atol=1e-5, rtol=1e-5)
    assert torch.equal(stats.argmax, logits.argmax(-1))
    assert stats.perplexity == pytest.approx(float(nll.mean().exp()), rel=1e-5)


def test_calibrate_measures_post_rope_cache_contents() -> None:
    from kvquant.integrations.hf.compat import cache_keyword

    model = _tiny_llama()
    ids = _ids(50)
    scales = E.calibrate(model, ids)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_keyword(model): cache})
    for i, layer in enumerate(cache.layers):
        assert torch.allclose(scales.k_amax[i], layer.keys.abs().amax(dim=(0, 2, 3)), rtol=1e-6)
        assert torch.allclose(scales.v_amax[i], layer.values.abs().amax(dim=(0, 2, 3)), rtol=1e-6)
    k_t, v_t = scales.per_tensor()
    k_h, v_h = scales.per_head()
    assert k_t.shape == (3,) and k_h.shape == (3, 2)
    assert torch.equal(k_t, k_h.amax(dim=1)) and torch.equal(v_t, v_h.amax(dim=1))
    assert torch.allclose(k_h * 448.0, scales.k_amax)
    k0, v0 = scales.layer(0, "per-head")
    assert torch.equal(k0, k_h[0]) and torch.equal(v0, v_h[0])
    with pytest.raises(KVQuantError, match="has no static scales"):
        scales.layer(0, "fp32-group")
    with pytest.raises(KVQuantError, match="layer 3 requested"):
        scales.layer(3, "per-tensor")


def test_simulated_rounding_costs_something_and_wrong_scales_cost_more() -> None:
    model = _tiny_llama()
    ids = _ids(60)
    scales = E.calibrate(model, _ids(60, seed=9))
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    rows = {}
    for mode in ("per-tensor", "per-head", "fp32-group"):
        with E.simulate_fp8_kv(model, mode, scales):
            rows[mode] = E.evaluate(mode, E.teacher_forced(model, ids), ref)
    for row in rows.values():
        assert row.delta_pct != 0.0  # the rounding reached the output
        assert abs(row.delta_pct) < 5.0
        assert row.top1_agreement > 0.8
    # scales 100x too small clamp almost everything: a visible loss
    tiny = E.CalibratedScales(scales.k_amax / 100, scales.v_amax / 100, scales.num_tokens)
    with E.simulate_fp8_kv(model, "per-tensor", tiny):
        bad = E.evaluate("bad", E.teacher_forced(model, ids), ref)
    assert bad.top1_agreement < min(r.top1_agreement for r in rows.values())


def test_simulate_rejects_unknown_mode_and_missing_scales() -> None:
    model = _tiny_llama(num_layers=1)
    with (
        pytest.raises(KVQuantError, match="mode 'int8' is unknown"),
        E.simulate_fp8_kv(model, "int8"),
    ):
        pass
    with (
        pytest.raises(KVQuantError, match="needs static scales"),
        E.simulate_fp8_kv(model, "per-head"),
    ):
        pass
    assert model.config._attn_implementation == "sdpa"


def test_teacher_forced_and_evaluate_reject_bad_input() -> None:
    model = _tiny_llama(num_layers=1)
    with pytest.raises(KVQuantError, match=r"expected \[B, T\]"):
        E.teacher_forced(model, _ids(1))
    a = E.TokenStats(nll=torch.zeros(4), argmax=torch.zeros(4, dtype=torch.long))
    b = E.TokenStats(nll=torch.zeros(5), argmax=torch.zeros(5, dtype=torch.long))
    with pytest.raises(KVQuantError, match="same evaluation tokens"):
        E.evaluate("x", a, b)


def test_teacher_forced_pools_windows() -> None:
    model = _tiny_llama()
    ids = torch.cat([_ids(20, seed=5), _ids(20, seed=6)])
    both = E.teacher_forced(model, ids)
    one = E.teacher_forced(model, ids[:1])
    two = E.teacher_forced(model, ids[1:])
    assert torch.allclose(both.nll, torch.cat([one.nll, two.nll]), atol=1e-5, rtol=1e-5)
    assert torch.equal(both.argmax, torch.cat([one.argmax, two.argmax]))


class _FakeTokenizer:
    def __call__(self, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(len(text.split()))[None]}


def test_tokenize_windows_and_short_texts() -> None:
    tok = _FakeTokenizer()
    ids = E.tokenize(tok, "w " * 100, 30, windows=3)
    assert ids.shape == (3, 30) and torch.equal(ids.flatten(), torch.arange(90))
    assert E.tokenize(tok, "w " * 10, 30).shape == (1, 10)
    with pytest.raises(KVQuantError, match="at least 120 for 4 windows"):
        E.tokenize(tok, "w " * 100, 30, windows=4)
    with pytest.raises(KVQuantError, match="expected at least 20"):
        E.tokenize(tok, "w " * 10, 30, min_tokens=20)


def test_format_table() -> None:
    row = E.EvalResult("x", 10.0, 1.234, 0.95, 100, 1.5)
    table = E.format_table([row])
    assert "| x | 10.0000 | +1.23% | 95.0% | 100 | 1.5 |" in table


# ---------------------------------------------------------------- texts


def test_pinned_texts_are_two_disjoint_sets_of_several_kinds() -> None:
    calibration, evaluation = T.calibration_texts(), T.evaluation_texts()
    assert {t.name for t in evaluation} == {
        "evaluation/code",
        "evaluation/dialogue",
        "evaluation/reference",
        "evaluation/story",
    }
    assert {t.name for t in calibration} == {
        "calibration/code",
        "calibration/prose",
        "calibration/reference",
    }
    # no document, and no paragraph of one, is in both sets
    assert not {t.digest for t in calibration} & {t.digest for t in evaluation}
    paragraphs = [
        {p.strip() for p in t.text.split("\n\n") if len(p.strip()) > 80} for t in calibration
    ]
    for t in evaluation:
        seen = {p.strip() for p in t.text.split("\n\n") if len(p.strip()) > 80}
        assert not any(seen & c for c in paragraphs), t.name
    # >= 8k SmolLM2 tokens of evaluation text (measured 12588; ~4 characters per token)
    assert sum(len(t.text) for t in evaluation) >= 40_000
    assert all(len(t.text) >= 2_400 for t in calibration + evaluation)


def test_every_pinned_text_has_its_source_and_licence_documented() -> None:
    readme = (T.TEXTS_DIR / "README.md").read_text(encoding="utf-8")
    for t in T.calibration_texts() + T.evaluation_texts():
        assert f"`{t.path.relative_to(T.TEXTS_DIR).as_posix()}`" in readme, t.name


def test_text_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _FakeTokenizer()
    n_eval = len(T.evaluation_texts())
    ids = T.evaluation_ids(tok, 300)
    assert ids.shape == (n_eval, 300) and ids.dtype == torch.int64
    assert torch.equal(ids[0], torch.arange(300))  # the first tokens of each text
    calib = T.calibration_ids(tok, 200)
    assert calib.shape == (1, 200 * len(T.calibration_texts()))
    with pytest.raises(ValueError, match=r"expected at least 10000000\. Fix"):
        T.evaluation_ids(tok, 10_000_000)


def test_missing_texts_raise_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "TEXTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="no evaluation texts in"):
        T.evaluation_texts()


# ---------------------------------------------------------------- scaled checkpoint copies


@pytest.mark.parametrize(
    "variant",
    ["compressed-tensors", "compressed-tensors-attn_head", "modelopt", "quark", "legacy-kv_scale"],
)
def test_write_scaled_copy_round_trips_through_kvquant(tmp_path: Path, variant: str) -> None:
    from benchmarks.harness.smollm2 import write_scaled_copy
    from kvquant.testing.checkpoints import write_checkpoint

    hf = pytest.importorskip("kvquant.integrations.hf")
    src = write_checkpoint(tmp_path / "src", convention="none", num_layers=2)
    k = torch.tensor([[0.011, 0.023], [0.031, 0.047]])
    v = torch.tensor([[0.005, 0.007], [0.013, 0.017]])
    out = write_scaled_copy(src, tmp_path / "copy", variant, k, v)
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert (out / shard1).resolve() == (src / "model.safetensors").resolve()
    assert not (out / "model.safetensors").exists()  # else transformers ignores the index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {shard1, shard2}
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    handle = hf.patch(model, scales=out, backend="torch")
    loaded = hf.from_pretrained(out)  # the load-time route reads the same scales
    try:
        layers = list(handle.scales.layers)
        assert [ls.granularity for ls in loaded._kvquant_state.model_scales.layers] == [
            ls.granularity for ls in layers
        ]
        for i, ls in enumerate(layers):
            if variant == "compressed-tensors-attn_head":
                exp_k, exp_v = k[i], v[i]
            elif variant == "legacy-kv_scale":
                exp_k = exp_v = torch.maximum(k[i].amax(), v[i].amax())
            else:
                exp_k, exp_v = k[i].amax(), v[i].amax()
            # bf16 producers round the stored value (<= 0.4 %)
            assert torch.allclose(ls.k.float(), exp_k, rtol=4e-3, atol=0)
            assert torch.allclose(ls.v.float(), exp_v, rtol=4e-3, atol=0)
    finally:
        handle.remove()


def test_write_scaled_copy_rejects_mismatched_scales(tmp_path: Path) -> None:
    from benchmarks.harness.smollm2 import write_scaled_copy
    from kvquant.errors import CheckpointError
    from kvquant.testing.checkpoints import write_checkpoint

    src = write_checkpoint(tmp_path / "src", convention="none", num_layers=2, weights="none")
    with pytest.raises(CheckpointError, match="do not fit"):
        write_scaled_copy(src, tmp_path / "c", "modelopt", torch.ones(3), torch.ones(3))
    with pytest.raises(CheckpointError, match="variant 'awq' is unknown"):
        write_scaled_copy(src, tmp_path / "c", "awq", torch.ones(2), torch.ones(2))
