"""benchmarks/kernel_resources.py compiles the decode kernel for sm_90 on a CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvquant.kernels.attention.tuning import programs_per_sm

ROOT = Path(__file__).resolve().parents[2]


def test_offline_sm90_compile_reports_pipelined_loads_and_pdl() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "benchmarks/kernel_resources.py", "--variant", "64,2,6,group64"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert 0 < report["registers"] <= 255
    assert report["shared_bytes"] > 0
    # K, V, block-table and group-scale loads of the key loop are software-pipelined copies
    assert report["async_copies_in_ir"] >= 4
    assert report["ptx"]["mma.sync"] > 0
    assert report["ptx"]["griddepcontrol"] == 2  # wait + launch_dependents
    # V pages keys-fastest: the V operand reaches the tensor cores through ldmatrix, not bytes
    assert report["ptx"]["ld.shared.b8"] == 0
    # three key loops (masked first tile, pipelined interior, masked rest)
    loops = report["sass_loop_instructions"]
    assert len(loops) == 3 and min(loops) == loops[1] > 0


def test_offline_sm90_k_transform_decode_keeps_registers_and_key_loop() -> None:
    """The k-transform path (offset, rotation, first tokens) adds work outside the key loop only.

    No register spills, and the pipelined interior loop (the cost per tile) stays within 5 %
    of the per-tensor kernel's instructions.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "benchmarks/kernel_resources.py",
         "--variant", "64,2,6", "--variant", "64,2,6,per-head-kt"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    plain, kt = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert kt["variant"].endswith("per-head-kt")
    assert kt["stack_bytes"] == 0
    # as many programs resident per SM as the plain kernel (the split count assumes it)
    assert programs_per_sm(kt["registers"], 2, kt["shared_bytes"]) == programs_per_sm(
        plain["registers"], 2, plain["shared_bytes"]
    )
    # the query rotation and the first tokens' tiles, then the three key loops
    loops = kt["sass_loop_instructions"]
    assert len(loops) == 5
    assert loops[3] <= 1.05 * plain["sass_loop_instructions"][1]


def test_offline_sm90_split_merge_compiles_without_spills() -> None:
    """The split merge (one warp, 32 columns per program) of 22 partials, 9/3/64."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "benchmarks/kernel_resources.py", "--shape", "9,3,64", "--reduce", "22"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    merge = json.loads(out.strip().splitlines()[-1])
    assert merge["reduce"] == 22 and merge["stack_bytes"] == 0
    assert merge["sass_instructions"] > 0
