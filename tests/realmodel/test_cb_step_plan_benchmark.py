"""The continuous-batching step-plan benchmark times every step it names and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script


def test_step_plan_benchmark_times_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("cb_step_plan")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    out = tmp_path / "plan.json"
    assert bench.main(["--repeats", "2", "--recent", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kvquant"] == "kvquant"  # this checkout's, not an earlier copy's
    steps = {
        (r["decoding"], r["chunks"], r["first_tokens"], r["recent_tokens"]) for r in data["rows"]
    }
    assert steps == {(d, c, f, r) for d, c in bench.STEPS for f in (0, 16) for r in (0, 8)}
    assert all(r["median_ms"] > 0 for r in data["rows"])
    # the synthetic step: one query per decoding request, 512 per chunk, pages in read order
    kw = bench.step_kwargs(3, 1)
    assert kw["cu_seq_lens_q"].tolist() == [0, 1, 2, 3, 515]
    assert kw["read_index"][0].numel() == sum(
        -(-int(k) // bench.PAGE) for k in kw["cu_seq_lens_k"].diff()
    )
