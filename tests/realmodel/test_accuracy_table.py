"""The accuracy table script (benchmarks/accuracy_table.py) end to end on SmolLM2-135M, tiny run.

One 64-token window per evaluation text and no ``kvquant calibrate`` rows; the full run
is ``python -m benchmarks.accuracy_table`` (docs/accuracy.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_accuracy_table_small_run(smollm2_dir: Path, tmp_path: Path) -> None:
    from benchmarks.accuracy_table import GROUPS, JITTER_FACTORS, STATIC, main
    from benchmarks.harness import texts as T

    out, png = tmp_path / "table.json", tmp_path / "plot.png"
    argv = ["--out", str(out), "--plot", str(png), "--model", str(smollm2_dir)]
    argv += ["--window", "64", "--windows-per-text", "1", "--calibration-tokens", "128"]
    assert main([*argv, "--resamples", "20", "--no-calibrated"]) == 0
    payload = json.loads(out.read_text(encoding="utf-8"))
    assert png.stat().st_size > 10_000
    n_texts = len(T.evaluation_texts())
    assert payload["evaluation"]["scored_positions"] == n_texts * 63
    runs = payload["runs"]
    assert len(runs) == len(STATIC) * len(JITTER_FACTORS) + len(GROUPS)
    for label, run in runs.items():
        pooled = run["pooled"]
        assert 0 < pooled["kl_mean"] < pooled["kl_p99"] < 1, label  # rounding is visible
        assert 0.8 < pooled["top1"] < 1 and math.isfinite(pooled["ppl_delta_pct"]), label
        assert len(run["per_text"]) == n_texts
    for mode in STATIC:
        assert payload["jitter"][mode]["factors"] == list(JITTER_FACTORS)
        assert payload["jitter"][mode]["kl_mean"]["range"] > 0
    assert len(payload["comparisons"]) == 6  # every pair of the 4 formats
    # measured on these 252 positions: G=32 0.0046 nats, every static run 0.0068-0.0092
    static = [r["pooled"]["kl_mean"] for r in runs.values() if r["format"] in STATIC]
    assert runs["fp32-group G=32"]["pooled"]["kl_mean"] < min(static)


def test_accuracy_table_calibration_free_sections(smollm2_dir: Path, tmp_path: Path) -> None:
    from benchmarks.accuracy_table import DYNAMIC, main

    text = tmp_path / "held-out.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    out = tmp_path / "table.json"
    argv = ["--out", str(out), "--model", str(smollm2_dir), "--eval-files", str(text)]
    argv += ["--window", "64", "--windows-per-text", "2", "--calibration-tokens", "128"]
    argv += ["--sections", "groups,group-jitter,dynamic", "--jitter-factors", "1.0,1.1"]
    assert main([*argv, "--resamples", "20"]) == 0
    payload = json.loads(out.read_text(encoding="utf-8"))
    assert payload["evaluation"]["scored_positions"] == 2 * 63
    (entry,) = payload["evaluation"]["texts"].values()
    assert entry["tokens"] >= 128 and len(entry["sha256"]) == 64
    runs = payload["runs"]
    assert len(runs) == 2 + 1 + len(DYNAMIC)  # G=64 and 32, G=64 x1.10, the dynamic formats
    assert payload["jitter"]["fp32-group"]["factors"] == [1.0, 1.1]
    assert set(payload["jitter"]) == {"fp32-group"}
    for fmt in DYNAMIC:
        run = runs[fmt.label]
        assert run["format"] == "dynamic" and run["dynamic"]["rotate_k"] == fmt.rotate_k
        assert 0 < run["pooled"]["kl_mean"] < 1, fmt.label
    assert len(payload["comparisons"]) == (2 + len(DYNAMIC)) * (1 + len(DYNAMIC)) // 2


def test_accuracy_table_fp4_sections(smollm2_dir: Path, tmp_path: Path) -> None:
    from benchmarks.accuracy_table import KT_LABEL, main

    out = tmp_path / "table.json"
    argv = ["--out", str(out), "--model", str(smollm2_dir), "--sections", "k-transform,fp4"]
    argv += ["--window", "64", "--windows-per-text", "1", "--calibration-tokens", "128"]
    # the k-transform's statistics on the first 256 tokens of each calibration text (every
    # token costs a forward with attention-weighted histograms: most of this test's time)
    assert main([*argv, "--statistics-tokens", "256", "--resamples", "20"]) == 0
    payload = json.loads(out.read_text(encoding="utf-8"))
    assert payload["calibration"]["statistics_tokens_per_text"] == 256
    runs = payload["runs"]
    fp4 = {k: r for k, r in runs.items() if r["format"] != "k-transform"}
    assert next(iter(runs)) == KT_LABEL and len(fp4) == 12
    assert {r["format"] for r in fp4.values()} == {"nvfp4", "mxfp4", "fp8-k-nvfp4-v"}
    assert "fp4" in payload["method"] and payload["jitter"] == {}
    assert runs["nvfp4 rot-KV"]["rotate_v"] and runs["nvfp4 (K k-transform)"]["k_transform"]
    # 4-bit values cost more than the k-transform's FP8 (measured on these 252 positions:
    # k-transform 0.0029 nats, the 4-bit rows 0.0115 to 0.21; with the statistics of every
    # calibration token, k-transform 0.0026 and the 4-bit rows from 0.0125)
    kt_kl = runs[KT_LABEL]["pooled"]["kl_mean"]
    recent = {k: r for k, r in fp4.items() if r["recent_tokens"]}
    assert sorted(recent) == [
        "fp8-k-nvfp4-v (K k-transform) recent-16",
        "nvfp4 (K k-transform) recent-16",
        "nvfp4 rot-KV recent-16",
    ]
    for label, run in fp4.items():
        if label in recent:  # the newest 16 of 64 positions exact: below the row without
            plain = runs[label.removesuffix(" recent-16")]["pooled"]["kl_mean"]
            assert 0 < run["pooled"]["kl_mean"] < plain, label
        else:
            assert kt_kl < run["pooled"]["kl_mean"] < 1, label
    # --fp4-rows: those rows only; an unknown label is refused before any work
    assert main([*argv, "--statistics-tokens", "64", "--resamples", "5",
                 "--fp4-rows", "nvfp4;mxfp4 rot-KV"]) == 0  # fmt: skip
    rows = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert [k for k, r in rows.items() if r["format"] != "k-transform"] == ["nvfp4", "mxfp4 rot-KV"]
    with pytest.raises(SystemExit):
        main([*argv, "--fp4-rows", "nvfp4 rot-V"])


def _pooled(kl: float, top1: float) -> dict[str, object]:
    return {"pooled": {"kl_mean": kl, "top1": top1, "ppl_delta_pct": 10 * kl, "kl_p99": 5 * kl}}


def test_rejudge_keeps_fp32_group_scaling_out_of_the_band() -> None:
    from benchmarks.accuracy_table import rejudge

    runs = {
        "per-tensor": {"format": "per-tensor", "scale_factor": 1.0, **_pooled(0.010, 0.95)},
        "per-tensor x1.10": {"format": "per-tensor", "scale_factor": 1.1, **_pooled(0.011, 0.94)},
        "fp32-group G=64": {"format": "fp32-group", "scale_factor": 1.0, **_pooled(0.005, 0.96)},
        "fp32-group x1.10": {"format": "fp32-group", "scale_factor": 1.1, **_pooled(0.009, 0.93)},
        "dynamic rot-K G=64": {"format": "dynamic", **_pooled(0.0045, 0.965)},
    }
    old = [{"a": "per-tensor", "b": "fp32-group G=64", "kl_mean": {"paired_se": 0.0004}}]
    payload = {"runs": runs, "comparisons": old, "command": "x"}
    out = rejudge(payload, None, "cmd")
    assert out["jitter"]["fp32-group"]["in_band"] is False
    assert out["jitter"]["per-tensor"]["in_band"] is True
    assert out["jitter_band"]["kl_mean"] == pytest.approx(0.001)  # per-tensor's range only
    rows = {(c["a"], c["b"]): c for c in out["comparisons"]}
    assert len(rows) == 3 and out["rejudged_by"] == "cmd"
    assert rows[("per-tensor", "fp32-group G=64")]["kl_mean"]["paired_se"] == 0.0004
    assert rows[("per-tensor", "fp32-group G=64")]["kl_mean"]["exceeds_jitter"]
    assert not rows[("fp32-group G=64", "dynamic rot-K G=64")]["kl_mean"]["exceeds_jitter"]
    wider = rejudge(
        payload, {"jitter_band": {m: 1.0 for m in out["jitter_band"]}, "command": "y"}, "c"
    )
    assert wider["jitter_band"]["kl_mean"] == 1.0 and wider["jitter_band_from"][-1] == "band of y"
