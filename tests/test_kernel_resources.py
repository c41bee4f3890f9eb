"""benchmarks/kernel_resources.py compiles the decode kernel for sm_90 on a CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvquant.kernels.attention.tuning import programs_per_sm, register_cap

ROOT = Path(__file__).resolve().parents[1]


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


def test_offline_sm90_k_transform_latency_variants() -> None:
    """9/3/64 decode: computed Hadamard slices drop R's loads before the key loops, and the
    register cap ``REG_TRIM`` would pick reaches per-head's residency (8 programs per SM)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)

    def compile_(*flags: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "benchmarks/kernel_resources.py", "--shape", "9,3,64",
             "--variant", "64,2,6,per-head-kt", *flags],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        return dict(json.loads(out.strip().splitlines()[-1]))

    default, computed = compile_(), compile_("--rot-kind", "hadamard")
    assert computed["rot_kind"] == "hadamard" and default["rot_kind"] == "matrix"
    assert int(computed["prologue_global_loads"]) < int(default["prologue_global_loads"])
    regs, shared = int(default["registers"]), int(default["shared_bytes"])
    cap = register_cap(regs, 2, shared, 32)
    if cap is None:  # already at the next residency step
        assert programs_per_sm(regs, 2, shared) >= 8
        return
    capped = compile_("--maxnreg", str(cap))
    assert int(capped["registers"]) <= cap
    assert programs_per_sm(int(capped["registers"]), 2, int(capped["shared_bytes"])) > (
        programs_per_sm(regs, 2, shared)
    )


def test_offline_sm90_first_tokens_in_the_split_merge() -> None:
    """``FIRST_SPLIT="merge"`` (9/3/64 decode): no first-token loop before the key loops, and
    the kernel keeps per-head's residency, which the first tokens in split 0 cost; the
    merge that takes them over stays a one-warp kernel without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)

    def compile_(*flags: str) -> list[dict[str, Any]]:
        out = subprocess.run(
            [sys.executable, "benchmarks/kernel_resources.py", "--shape", "9,3,64", *flags],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        return [json.loads(line) for line in out.strip().splitlines()]

    plain, in_split = compile_("--variant", "64,2,6", "--variant", "64,2,6,per-head-kt-first")
    (merged,) = compile_("--variant", "64,2,6,per-head-kt-first", "--first-split", "merge")

    def residency(r: dict[str, Any]) -> int:
        return programs_per_sm(r["registers"], 2, r["shared_bytes"])

    assert merged["first_split"] == "merge"
    # the first-token loop, then the three key loops; with the merge only the key loops
    assert len(in_split["sass_loop_instructions"]) == 4
    assert len(merged["sass_loop_instructions"]) == 3
    assert residency(merged) == residency(plain) > residency(in_split)
    without, with_first = compile_("--reduce", "22")
    assert without["first_tokens"] is False and with_first["first_tokens"] is True
    assert with_first["stack_bytes"] == 0
    assert with_first["sass_instructions"] > without["sass_instructions"]
