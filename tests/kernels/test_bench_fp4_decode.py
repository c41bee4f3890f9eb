"""The 4-bit decode benchmark runs at tiny size (CPU interpreter, no timing) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fp4_decode.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvquant_bench_fp4_decode", SCRIPT)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU interpreter's")
def test_smoke_run_checks_every_format_and_writes_the_bytes(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "fp4.json"
    assert bench.main(["--out", str(out), "--smoke", "--configs", "32,1,3"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for name in bench.FORMATS:
        assert 0.0 <= row[name]["rel_err"] <= bench.REL_TOL
    # a tile override, checked against the reference for every 4-bit format
    for name in bench.FORMATS[1:]:
        assert 0.0 <= row[name]["configs"]["32,1,3"]["rel_err"] <= bench.REL_TOL
    # 4-bit sides: half a byte per element plus a scale byte per block (16 or 32 channels)
    assert row["nvfp4"]["bytes_x_fp8"] == pytest.approx((16 + 2) / 32, rel=0.02)
    assert row["mxfp4"]["bytes_x_fp8"] == pytest.approx((32 + 2) / 64, rel=0.02)
    assert row["fp8-k-nvfp4-v"]["bytes_x_fp8"] == pytest.approx((1 + 18 / 32) / 2, rel=0.02)
