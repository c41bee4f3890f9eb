"""The end-to-end generate benchmark runs at tiny size on CPU and writes complete JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load_script

pytest.importorskip("transformers")


def test_e2e_generate_tiny_cpu(tmp_path: Path) -> None:
    bench = load_script("e2e_generate")
    out = tmp_path / "e2e.json"
    argv = ["--tiny", "--device", "cpu", "--backend", "torch", "--repeats", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    arms = data["shapes"]["tiny"]["arms"]
    assert set(arms) == {"default", "kvquant", "kvquant-eager"}
    for name, row in arms.items():
        assert row["status"] == "ok", (name, row)
        assert row["prefill_s"] > 0 and row["wall_s"] >= row["prefill_s"]
        assert row["step_ms_median"] > 0 and row["first_call_s"] > 0
        assert 0.0 <= row["greedy_prefix_agreement_vs_default"] <= 1.0
        assert set(row["first_call_dynamo"]) == {"graphs", "graph_breaks"}
    assert arms["default"]["greedy_prefix_agreement_vs_default"] == 1.0
    # On CPU the default cuda_graphs=None leaves every step to the ordinary forward.
    stats = arms["kvquant"]["graph_stats"]
    assert stats["static_eager"] == 0 and stats["captures"] == 0 and stats["ordinary"] > 0
    assert "graph_stats" not in arms["kvquant-eager"]
    # Same scales, same kernels on CPU: the two kvquant arms choose the same tokens.
    assert (
        arms["kvquant"]["greedy_prefix_agreement_vs_default"]
        == arms["kvquant-eager"]["greedy_prefix_agreement_vs_default"]
    )


def test_e2e_generate_runs_an_opt_in_arm_only_when_named(tmp_path: Path) -> None:
    bench = load_script("e2e_generate")
    out = tmp_path / "e2e.json"
    argv = ["--tiny", "--device", "cpu", "--backend", "torch", "--repeats", "1", "--out", str(out)]
    assert bench.main([*argv, "--arms", "default,kvquant-rowgroups"]) == 0
    arms = json.loads(out.read_text())["shapes"]["tiny"]["arms"]
    assert set(arms) == {"default", "kvquant-rowgroups"}
    assert arms["kvquant-rowgroups"]["status"] == "ok"
    with pytest.raises(SystemExit):
        bench.main([*argv, "--arms", "kvquant-nonesuch"])


def test_e2e_generate_runs_the_named_arms_in_their_order(tmp_path: Path) -> None:
    """``--arms`` in another order runs them in that order (order effects show when
    alternated); the ring arm runs on CPU too."""
    bench = load_script("e2e_generate")
    out = tmp_path / "e2e.json"
    argv = ["--tiny", "--device", "cpu", "--backend", "torch", "--repeats", "1", "--out", str(out)]
    assert bench.main([*argv, "--arms", "kvquant-recent0,default"]) == 0
    arms = json.loads(out.read_text())["shapes"]["tiny"]["arms"]
    assert list(arms) == ["kvquant-recent0", "default"]
    assert arms["kvquant-recent0"]["status"] == "ok"


def test_e2e_generate_records_the_decode_launches_plans_choose() -> None:
    """The arm's launch log keeps each one-token launch's split count by table width and
    puts the launcher back when removed."""
    from kvquant.kernels import page_storage, paged_attention
    from kvquant.kernels.attention import launch as module
    from kvquant.schemes import Pages, PerTensorScales

    bench = load_script("e2e_generate")
    original = module.attention_launch
    log = bench._LaunchLog()
    log.install()
    try:
        k, v = page_storage(6, 16, 2, 32)
        k.zero_(), v.zero_()
        pages = Pages(k, v)
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
        lens = torch.tensor([20, 33], dtype=torch.int32)
        scheme = PerTensorScales(torch.tensor(0.5), torch.tensor(0.5))
        for lq in (1, 3):
            query = torch.randn(2, lq, 4, 32, dtype=torch.float16)
            paged_attention(query, pages, table, lens, scheme, sm_scale=0.2, backend="triton")
    finally:
        log.remove()
    assert module.attention_launch is original
    (entry,) = log.launches.items()  # the 3-token query is not a decode launch
    assert entry[0] == "B2 table 48 keys"
    assert entry[1]["num_splits"] >= 1 and entry[1]["BLOCK_N"] > 0
