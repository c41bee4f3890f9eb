"""The split-rule analysis reads forced split counts from both benchmarks' JSON and ranks the
launcher's choice and each candidate rule's against the best count timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script


def _bench_json() -> dict:
    """B64 x 2080 keys, 8 KV heads: 512 pairs; forced 1, 3 and 17 splits."""
    entry = {
        "graph_ms": 0.090,
        "launcher_splits": 17,
        "splits": {"1": {"graph_ms": 0.060}, "3": {"graph_ms": 0.066}, "17": {"graph_ms": 0.090}},
        "recent": {
            "graph_ms": 0.120,
            "launcher_splits": 17,
            "splits": {"1": {"graph_ms": 0.063}, "17": {"graph_ms": 0.120}},
        },
    }
    row = {"B": 64, "ctx": 2080, "hq": 32, "hkv": 8, "d": 64, "page": 16, "table_pages": 193}
    return {"rows": [{**row, "fp8-group": entry}]}


def _tune_json() -> dict:
    """16 sequences x 3 KV heads = 48 pairs, 8192 keys (128 tiles)."""
    runs = [
        {"impl": "current", "config": {}, "splits": None, "ms": 0.050, "launcher_splits": 22},
        *(
            {"impl": "current", "config": {}, "splits": s, "ms": ms}
            for s, ms in ((2, 0.080), (4, 0.045), (8, 0.040), (16, 0.048))
        ),
        {"impl": "baseline", "config": {}, "splits": 8, "ms": 0.001},  # not this tree's
        {"impl": "current", "config": {"BLOCK_N": 32}, "splits": 8, "ms": 0.001},  # other tile
    ]
    return {"shapes": [{"shape": "9/3/64 B16x8192", "sdpa_ms": 0.1, "per-head": {"runs": runs}}]}


def test_rules_are_ranked_against_the_best_forced_count(tmp_path: Path) -> None:
    rules = load_script("split_rules")
    bench, tune = tmp_path / "b.json", tmp_path / "t.json"
    bench.write_text(json.dumps(_bench_json()))
    tune.write_text(json.dumps(_tune_json()))
    out = tmp_path / "rules.json"
    assert rules.main([str(bench), str(tune), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    by_case = {row["case"]: row for row in result["cases"]}
    plain = by_case["32/8/64 B64x2080 (table 3088) fp8-group"]
    assert plain["best"] == [1, 0.060]
    assert plain["launcher"][:3] == [17, 0.090, pytest.approx(1.5)]
    assert plain["fill-1"][:2] == [1, 0.060]  # 512 pairs fill 132 SMs once
    assert plain["fill-4"][0] == 2 and plain["fill-4"][3] is False  # 2 not timed: nearest, 1
    ring = by_case["32/8/64 B64x2080 (table 3088) fp8-group + ring"]
    assert ring["launcher"][2] == pytest.approx(0.120 / 0.063)
    kt = by_case["9/3/64 B16x8192 per-head"]
    assert kt["best"] == [8, 0.040]  # the other impl's and tile's runs are not this rule's
    assert kt["launcher"][:2] == [22, 0.050]
    assert [kt[f"fill-{c}"][0] for c in (1, 2, 4)] == [3, 6, 11]
    assert result["rules"]["launcher"]["worst_x_best"] == pytest.approx(0.120 / 0.063)


def test_files_without_forced_counts_are_refused(tmp_path: Path) -> None:
    rules = load_script("split_rules")
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"rows": [{"B": 1, "ctx": 16, "hq": 4, "hkv": 2, "d": 32}]}))
    with pytest.raises(SystemExit, match="no forced split counts"):
        rules.main([str(empty)])
