"""The 4-bit decode benchmark runs at tiny size (CPU interpreter, no timing) and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU interpreter's")
def test_smoke_run_checks_every_format_and_writes_the_bytes(tmp_path: Path) -> None:
    bench = load_script("bench_fp4_decode")
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU interpreter's")
def test_smoke_run_with_a_wide_table_checks_forced_splits(tmp_path: Path) -> None:
    bench = load_script("bench_fp4_decode")
    out = tmp_path / "splits.json"
    argv = ["--out", str(out), "--smoke", "--formats", "fp8,nvfp4", "--recent", "4"]
    assert bench.main([*argv, "--table-pages", "5", "--splits", "1,3"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["table_pages"] == 5  # 40 tokens fill 3 pages; 2 more columns
    for name in ("fp8", "nvfp4"):
        for entry in (row[name], row[name]["recent"]):
            assert entry["launcher_splits"] >= 1
            assert sorted(entry["splits"]) == ["1", "3"]
            for forced in entry["splits"].values():
                assert 0.0 <= forced["rel_err"] <= bench.REL_TOL
    with pytest.raises(SystemExit, match="fewer than the 3 pages"):
        bench.main([*argv, "--table-pages", "2"])


def test_split_kernel_use_lists_each_compiled_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The residency inputs the launcher memoised, per variant (filled on a GPU only)."""
    bench = load_script("bench_fp4_decode")
    key = (torch.device("cuda", 0), (torch.bfloat16, None), ("BLOCK_N", 64), ("PDL", True))
    monkeypatch.setattr(bench.attention_launcher, "_KERNEL_USE", {key: (168, 2, 22624)})
    (use,) = bench.split_kernel_use()
    assert use == {
        "registers": 168,
        "warps": 2,
        "shared_bytes": 22624,
        "consts": {"BLOCK_N": 64, "PDL": True},
        "pointers": ["torch.bfloat16", None],
    }
