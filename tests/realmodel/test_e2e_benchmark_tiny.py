"""The end-to-end generate benchmark runs at tiny size on CPU and writes complete JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_generate.py"


def _load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvquant_bench_e2e_generate", SCRIPT)
    assert spec is not None and spec.loader is not None  # the file ships with the repo
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_generate_tiny_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_script()
    out = tmp_path / "e2e.json"
    assert bench.main(["--tiny", "--device", "cpu", "--backend", "torch", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    arms = data["arms"]
    assert set(arms) == {"sdpa", "quantized-fp8", "kvquant", "kvquant-fp32-group", "kvquant-eager"}
    assert arms["sdpa"]["status"] == "ok"
    for arm in ("kvquant", "kvquant-fp32-group", "kvquant-eager"):
        assert arms[arm]["status"] in ("ok", "unavailable"), arms[arm]
    assert arms["quantized-fp8"]["status"] in ("ok", "unavailable")
    for name, row in arms.items():
        if row["status"] != "ok":
            assert row.get("reason"), name
            continue
        assert row["prefill_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["kv_bytes_after_prefill_measured"] > 0
        assert 0.0 <= row["greedy_token_agreement_vs_sdpa"] <= 1.0
    cfg = data["config"]
    per_token_fp32 = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * 4
    assert arms["sdpa"]["kv_bytes_per_token_analytic"] == per_token_fp32
    if arms["kvquant"]["status"] == "ok":
        g = cfg["group_size"]
        group = arms["kvquant-fp32-group"]
        expect = per_token_fp32 / 4 * (1 + 4 / g)  # fp8 codes + one fp32 scale per group
        assert group["kv_bytes_per_token_analytic"] == pytest.approx(expect)
        assert arms["kvquant"]["kv_bytes_per_token_analytic"] == per_token_fp32 / 4
        # the fp8 pool (prompt + new tokens + slack) is well under the fp32 cache
        assert (
            group["kv_bytes_after_prefill_measured"]
            < 0.6 * arms["sdpa"]["kv_bytes_after_generate_measured"]
        )
        assert "kvquant" in data["longest_context"]["tokens_per_sequence"]
        # on CPU the graph arms run their decode steps through the static buffers
        stats = arms["kvquant"]["graph_stats"]
        assert stats["static_eager"] > 0 and stats["captures"] == 0
        assert "graph_stats" not in arms["kvquant-eager"]
        # same scales, same kernels: the static step changes no token
        agree = [arms[a]["greedy_token_agreement_vs_sdpa"] for a in ("kvquant", "kvquant-eager")]
        assert agree[0] == agree[1]
    assert data["ratios_vs_sdpa"]["sdpa"]["decode_tokens_per_s"] == 1.0
