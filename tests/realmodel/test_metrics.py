"""Fast tests of the distribution metrics and block bootstrap (benchmarks.harness.metrics).

Synthetic logits and a tiny random Llama only; the SmolLM2 table is
``python -m benchmarks.accuracy_table``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import benchmarks.harness.metrics as M
from kvquant.errors import KVQuantError

transformers = pytest.importorskip("transformers")


def _logits(n: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def _stats(kl: list[float], agree: list[bool], dnll: list[float]) -> M.PositionStats:
    ref = torch.full((len(kl),), 2.0, dtype=torch.float64)
    return M.PositionStats(
        kl=torch.tensor(kl, dtype=torch.float64),
        nll=ref + torch.tensor(dnll, dtype=torch.float64),
        ref_nll=ref,
        agree=torch.tensor(agree),
    )


# ---------------------------------------------------------------- per-position comparison


def test_compare_logits_matches_torch_definitions() -> None:
    ref, run = _logits(37, 50, 1), _logits(37, 50, 2)
    targets = torch.randint(0, 50, (37,), generator=torch.Generator().manual_seed(3))
    s = M.compare_logits(ref, run, targets)
    ref_logp = torch.log_softmax(ref.double(), -1)
    run_logp = torch.log_softmax(run.double(), -1)
    kl = torch.nn.functional.kl_div(run_logp, ref_logp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(s.kl, kl)
    torch.testing.assert_close(
        s.nll, torch.nn.functional.cross_entropy(run.double(), targets, reduction="none")
    )
    torch.testing.assert_close(
        s.ref_nll, torch.nn.functional.cross_entropy(ref.double(), targets, reduction="none")
    )
    assert torch.equal(s.agree, ref.argmax(-1) == run.argmax(-1))
    assert bool((s.kl > 0).all()) and not bool(s.agree.all())


def test_compare_logits_identical_runs_are_zero() -> None:
    ref = _logits(20, 30, 4)
    s = M.compare_logits(ref, ref.clone(), torch.zeros(20, dtype=torch.long))
    assert float(s.kl.abs().max()) < 1e-12
    assert bool(s.agree.all())
    torch.testing.assert_close(s.nll, s.ref_nll)


def test_compare_logits_nan_run_is_not_hidden() -> None:
    ref, run = _logits(8, 16, 5), _logits(8, 16, 6)
    run[3] = float("nan")
    s = M.compare_logits(ref, run, torch.zeros(8, dtype=torch.long))
    assert math.isnan(float(s.kl[3])) and math.isnan(float(s.nll[3]))
    assert bool(torch.isfinite(s.kl[torch.arange(8) != 3]).all())


@pytest.mark.parametrize(
    ("ref_shape", "run_shape", "targets"),
    [((4, 8), (4, 9), 4), ((4, 8), (4, 8), 3), ((2, 4, 8), (2, 4, 8), 8)],
)
def test_compare_logits_rejects_mismatched_shapes(
    ref_shape: tuple[int, ...], run_shape: tuple[int, ...], targets: int
) -> None:
    with pytest.raises(KVQuantError, match="compare_logits") as info:
        M.compare_logits(torch.zeros(ref_shape), torch.zeros(run_shape), torch.zeros(targets))
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------- blocks and bootstrap


def test_block_layout_never_straddles_windows() -> None:
    layout = M.BlockLayout(("a", "a", "b"), positions_per_window=10, block=4)
    ids = layout.block_ids()
    assert (
        ids.tolist()
        == [0] * 4 + [1] * 4 + [2] * 2 + [3] * 4 + [4] * 4 + [5] * 2 + [6] * 4 + [7] * 4 + [8] * 2
    )
    assert layout.block_texts() == ["a"] * 6 + ["b"] * 3
    assert layout.texts == ("a", "b") and layout.num_positions == 30
    assert layout.text_mask("b").tolist() == [False] * 20 + [True] * 10


def test_block_layout_rejects_bad_sizes() -> None:
    with pytest.raises(KVQuantError, match="BlockLayout"):
        M.BlockLayout(("a",), positions_per_window=10, block=0)


def test_bootstrap_draws_stay_within_each_text_and_are_seeded() -> None:
    layout = M.BlockLayout(("a", "b", "a", "c"), positions_per_window=64, block=16)
    texts = layout.block_texts()
    d = M.bootstrap_draws(layout, 200, seed=7)
    assert d.shape == (200, 16)
    for slot, name in enumerate(texts):
        assert all(texts[i] == name for i in d[:, slot].tolist())
    assert torch.equal(d, M.bootstrap_draws(layout, 200, seed=7))
    assert not torch.equal(d, M.bootstrap_draws(layout, 200, seed=8))
    with pytest.raises(KVQuantError, match="resamples"):
        M.bootstrap_draws(layout, 1)


def test_summarize_pooled_and_per_text_values() -> None:
    # text a: KL 0.1, all agree, dnll 0.01; text b: KL 0.3, half agree, dnll 0.03
    n = 32
    stats = _stats(
        kl=[0.1] * n + [0.3] * n,
        agree=[True] * n + [True, False] * (n // 2),
        dnll=[0.01] * n + [0.03] * n,
    )
    layout = M.BlockLayout(("a", "b"), positions_per_window=n, block=8)
    r = M.summarize(stats, layout, resamples=50)
    assert r.pooled.positions == 2 * n
    assert r.pooled.kl_mean == pytest.approx(0.2)
    assert r.pooled.top1 == pytest.approx(0.75)
    assert r.pooled.ppl_delta_pct == pytest.approx(100 * math.expm1(0.02))
    assert r.per_text["a"].kl_mean == pytest.approx(0.1)
    assert r.per_text["b"].top1 == pytest.approx(0.5)
    assert r.per_text["b"].ppl_delta_pct == pytest.approx(100 * math.expm1(0.03))
    assert r.per_text["a"].kl_p99 == pytest.approx(0.1)
    # constant within each text and stratified resampling: no bootstrap spread at all
    assert r.pooled.se["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert r.per_text["a"].se["top1"] == pytest.approx(0.0, abs=1e-12)
    # blocks of 8 alternate True/False evenly: the block means are all 0.5
    assert r.per_text["b"].se["top1"] == pytest.approx(0.0, abs=1e-12)


def test_bootstrap_se_matches_iid_theory() -> None:
    g = torch.Generator().manual_seed(11)
    n = 4000
    kl = torch.rand(n, generator=g, dtype=torch.float64)
    stats = M.PositionStats(
        kl=kl, nll=torch.zeros(n, dtype=torch.float64),
        ref_nll=torch.zeros(n, dtype=torch.float64), agree=torch.rand(n, generator=g) < 0.9,
    )  # fmt: skip
    layout = M.BlockLayout(("a",), positions_per_window=n, block=1)
    r = M.summarize(stats, layout, resamples=800, seed=3)
    expected = float(kl.std()) / math.sqrt(n)
    assert r.pooled.se["kl_mean"] == pytest.approx(expected, rel=0.15)
    assert r.pooled.kl_p99 == pytest.approx(float(torch.quantile(kl, 0.99)))


def test_block_bootstrap_sees_correlated_positions() -> None:
    # each block of 16 positions shares one value: per-position resampling would
    # understate the error by sqrt(16); the block bootstrap must not
    g = torch.Generator().manual_seed(12)
    blocks = torch.rand(100, generator=g, dtype=torch.float64)
    kl = blocks.repeat_interleave(16)
    stats = M.PositionStats(
        kl=kl, nll=torch.zeros_like(kl), ref_nll=torch.zeros_like(kl),
        agree=torch.ones(kl.shape[0], dtype=torch.bool),
    )  # fmt: skip
    layout = M.BlockLayout(("a",), positions_per_window=kl.shape[0], block=16)
    se = M.summarize(stats, layout, resamples=800).pooled.se["kl_mean"]
    assert se == pytest.approx(float(blocks.std()) / math.sqrt(100), rel=0.15)


def test_paired_draws_cancel_for_identical_runs() -> None:
    g = torch.Generator().manual_seed(13)
    kl = torch.rand(256, generator=g, dtype=torch.float64)
    s = M.PositionStats(kl=kl, nll=kl, ref_nll=kl * 0, agree=kl > 0.5)
    layout = M.BlockLayout(("a", "b"), positions_per_window=128, block=32)
    d = M.bootstrap_draws(layout, 100)
    a, b = M.metric_draws(s, layout, d), M.metric_draws(s, layout, d)
    for m in M.METRICS:
        assert float((a[m] - b[m]).abs().max()) == 0.0
        assert float(a[m].std()) > 0


def test_summarize_rejects_wrong_layout() -> None:
    s = _stats([0.1] * 10, [True] * 10, [0.0] * 10)
    with pytest.raises(KVQuantError, match="scored positions") as info:
        M.summarize(s, M.BlockLayout(("a",), positions_per_window=12), resamples=10)
    assert isinstance(info.value, ValueError)


def test_spread() -> None:
    s = M.spread([1.0, 3.0, 2.0])
    assert s == {"min": 1.0, "max": 3.0, "range": 2.0, "sd": pytest.approx(1.0)}
    with pytest.raises(KVQuantError, match="spread"):
        M.spread([1.0])


# ---------------------------------------------------------------- on a model


def _tiny_llama() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_decoder_hidden_and_compare_hidden_match_the_model_logits() -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    hidden = M.decoder_hidden(model, ids)
    assert hidden.shape == (2 * 23, 64)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].flatten(0, 1)
    noisy = hidden + 0.05 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        noisy_logits = model.lm_head(noisy)
    s = M.compare_hidden(model, hidden, noisy, ids, chunk=7)
    expected = M.compare_logits(logits, noisy_logits, ids[:, 1:].flatten())
    torch.testing.assert_close(s.kl, expected.kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s.nll, expected.nll, rtol=1e-4, atol=1e-5)
    assert float(s.kl.mean()) > 0
    same = M.compare_hidden(model, hidden, hidden.clone(), ids)
    assert float(same.kl.abs().max()) < 1e-9 and bool(same.agree.all())
    with pytest.raises(KVQuantError, match="compare_hidden"):
        M.compare_hidden(model, hidden, hidden[:-1], ids)


# ---------------------------------------------------------------- the jitter control


def test_jitter_control_marks_only_gaps_wider_than_both_families() -> None:
    from benchmarks.accuracy_table import JITTER_FACTORS, jitter_control

    def run(kl: float, top1: float, **extra: Any) -> dict[str, Any]:
        pooled = {"kl_mean": kl, "top1": top1, "ppl_delta_pct": 1.0, "kl_p99": 10 * kl}
        return {**extra, "pooled": pooled}

    runs: dict[str, dict[str, Any]] = {}
    for mode, base, step in (("per-tensor", 0.010, 0.001), ("per-head", 0.011, 0.0005)):
        for i, f in enumerate(JITTER_FACTORS):
            label = mode if f == 1.0 else f"{mode} x{f}"
            runs[label] = run(base + step * i, 0.95, format=mode, scale_factor=f)
    runs["calibrated"] = run(0.0105, 0.96, format="per-head")
    runs["group"] = run(0.002, 0.97, format="fp32-group")
    g = torch.Generator().manual_seed(0)
    boots = {k: {m: torch.rand(20, generator=g) for m in M.METRICS} for k in runs}
    jitter, band, comparisons = jitter_control(runs, boots)
    assert jitter["per-tensor"]["factors"] == list(JITTER_FACTORS)
    assert jitter["per-tensor"]["kl_mean"]["range"] == pytest.approx(0.004)
    assert jitter["per-head"]["kl_mean"]["range"] == pytest.approx(0.002)
    assert band["kl_mean"] == pytest.approx(0.004) and band["top1"] == 0.0
    pairs = {(c["a"], c["b"]): c for c in comparisons}
    assert set(pairs) == {
        (a, b)
        for i, a in enumerate(["per-tensor", "per-head", "calibrated", "group"])
        for b in ["per-tensor", "per-head", "calibrated", "group"][i + 1 :]
    }
    assert not pairs[("per-tensor", "calibrated")]["kl_mean"]["exceeds_jitter"]
    assert pairs[("per-head", "group")]["kl_mean"]["exceeds_jitter"]
    assert pairs[("per-head", "group")]["kl_mean"]["gap"] == pytest.approx(0.009)
    assert pairs[("per-head", "calibrated")]["top1"]["exceeds_jitter"]
    assert not pairs[("per-tensor", "per-head")]["ppl_delta_pct"]["exceeds_jitter"]
    se = pairs[("per-head", "group")]["kl_mean"]["paired_se"]
    assert se == pytest.approx(
        float((boots["per-head"]["kl_mean"] - boots["group"]["kl_mean"]).std())
    )
