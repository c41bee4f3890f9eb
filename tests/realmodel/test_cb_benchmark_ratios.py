"""The continuous-batching benchmark's ratios against a reference arm cut by its time limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "continuous_batching.py"


def _load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvquant_bench_continuous_batching", SCRIPT)
    assert spec is not None and spec.loader is not None  # the file ships with the repo
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mode(tok_s: float, in_flight: int, ttft: float, at_most: float | None = None) -> dict:
    out = {
        "mode": "burst",
        "output_tokens_per_s": tok_s,
        "max_in_flight": in_flight,
        "ttft_median_s": ttft,
    }
    if at_most is not None:
        out["output_tokens_per_s_at_most"] = at_most
    return out


def test_a_cut_reference_bounds_the_tokens_per_second_ratio_from_below() -> None:
    bench = _load_script()
    rows = [
        {"arm": "sdpa", "modes": [_mode(60.0, 100, 10.0, at_most=400.0)]},
        {"arm": "kvquant", "modes": [_mode(1600.0, 190, 12.0)]},
    ]
    got = bench.ratios(rows)["kvquant/burst"]
    assert got["tokens_per_s_x"] == pytest.approx(1600.0 / 60.0)
    assert got["tokens_per_s_x_at_least"] == pytest.approx(4.0)


def test_a_complete_reference_gives_no_bound() -> None:
    bench = _load_script()
    rows = [
        {"arm": "sdpa", "modes": [_mode(600.0, 100, 1.0)]},
        {"arm": "kvquant", "modes": [_mode(900.0, 190, 1.0)]},
    ]
    assert "tokens_per_s_x_at_least" not in bench.ratios(rows)["kvquant/burst"]
