"""The several-GPU benchmark runs at tiny size on CPU: both modes, complete JSON, same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_script, script_path

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = script_path("multi_gpu")
SMALL = ["--shape", "tiny", "--device", "cpu", "--backend", "torch", "--batch", "2"]
SMALL += ["--prompt", "16", "--new", "4", "--repeats", "1"]


@pytest.mark.slow
def test_multi_gpu_benchmark_tiny_cpu(tmp_path: Path) -> None:
    bench = load_script("multi_gpu")
    ckpt = str(tmp_path / "ckpt")
    assert bench.main(["make", "--dir", ckpt, "--shape", "tiny"]) == 0
    assert (
        bench.main(["device-map", "--dir", ckpt, *SMALL, "--out", str(tmp_path / "dm.json")]) == 0
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(SCRIPT), "tp", "--dir", ckpt, *SMALL, "--out", str(tmp_path / "tp.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("dm", "tp")}
    assert runs["tp"]["world_size"] == 2 and runs["dm"]["world_size"] == 1
    for name in ("default", "kvquant", "kvquant-fp32-group"):
        rows = [runs[m]["arms"][name] for m in ("dm", "tp")]
        for row in rows:
            assert row["status"] == "ok", row
            assert row["step_ms_median"] > 0 and row["prefill_s"] > 0
        # the same model split two ways chooses the same greedy tokens
        assert rows[0]["tokens"] == rows[1]["tokens"]
    assert "graph_stats" in runs["tp"]["arms"]["kvquant"]
