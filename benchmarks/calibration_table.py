"""Calibrated vs amax/448 FP8 KV scales on SmolLM2-135M, through ``kvquant.patch``.

Reproduces the SmolLM2-135M table of docs/calibration.md. Run from the
checkout's root (CPU is fine; the model is fetched on first use, see
``benchmarks/harness/smollm2.py``)::

    python -m benchmarks.calibration_table [--controls] [--json out.json]

Calibrates on the pinned calibration texts, writes compressed-tensors checkpoint
copies (per-tensor and per-head; kvquant-calibrated and amax/448), loads each
through ``kvquant.patch`` (torch backend) and evaluates teacher-forced
perplexity on the pinned evaluation texts (one window per text), plus
fp32-group and the unquantized model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # run as a script: make the checkout importable (benchmarks.harness, kvquant)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvquant.calibrate import (
    DEFAULT_RATIOS,
    FP8_E4M3_MAX,
    CalibrationResult,
    choose_scales,
    collect_statistics,
    write_calibrated_checkpoint,
)

_GRANULARITIES = ("per-tensor", "per-head")
_CONTROL_FACTORS = (1.01, 1.02, 1.05, 1.1, 1.25, 1.5)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure calibrated vs amax/448 scales on SmolLM2-135M through ``kvquant.patch``.

    Calibrates on the calibration text, writes compressed-tensors checkpoint
    copies (per-tensor and per-head; kvquant-calibrated and amax/448), loads each
    through ``kvquant.patch`` (torch backend) and evaluates teacher-forced
    perplexity on the *other* text, plus fp32-group and the unquantized model.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status 0.
    """
    import benchmarks.harness.accuracy as E
    from benchmarks.harness.smollm2 import load_smollm2, smollm2_path
    from benchmarks.harness.texts import calibration_texts, evaluation_ids

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.calibration_table",
        description="Perplexity of SmolLM2-135M with kvquant-calibrated vs amax/448 FP8 KV "
        "scales (written checkpoints loaded through kvquant.patch).",
    )
    parser.add_argument(
        "--tokens", type=int, default=1024, help="evaluation tokens per text (one window each)"
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        help="stop calibrating after this many tokens (default: all the calibration texts)",
    )
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--json", metavar="PATH", default=None, help="write rows as JSON")
    parser.add_argument(
        "--controls",
        action="store_true",
        help="instead of kvquant.patch runs, simulate FP8 K/V (benchmarks.harness.accuracy.simulate_fp8_kv) for "
        "every variant plus amax/448 scales multiplied by 1.01 ... 1.5 (alignment controls: no "
        "clipping, same MSE class), with per-window deltas",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    path = smollm2_path()
    model, tokenizer = load_smollm2(path)
    calib = calibration_texts()
    calib_names = tuple(t.name for t in calib)
    eval_ids = evaluation_ids(tokenizer, args.tokens)
    t0 = time.perf_counter()
    stats = collect_statistics(
        model,
        [t.text for t in calib],
        tokenizer=tokenizer,
        max_tokens=args.calibration_tokens,
        objective="attention",  # keeps the plain histograms too: both objectives below
        progress=True,
    )
    calib_seconds = time.perf_counter() - t0
    variants = (
        ("amax/448", (1.0,), "mse"),
        ("calibrated, objective mse", DEFAULT_RATIOS, "mse"),
        ("calibrated, objective attention", DEFAULT_RATIOS, "attention"),
    )
    results = {
        f"{g} {name}": choose_scales(
            stats,
            g,
            ratios=ratios,
            tolerance=args.tolerance,
            objective=objective,
            texts=calib_names,
        )
        for name, ratios, objective in variants
        for g in _GRANULARITIES
    }
    with E.simulate_fp8_kv(model, "none"):
        t0 = time.perf_counter()
        reference = E.teacher_forced(model, eval_ids)
    rows = [E.evaluate("bf16 KV (unquantized)", reference, reference, time.perf_counter() - t0)]
    if args.controls:
        return _controls(model, results, eval_ids, reference, rows)
    with tempfile.TemporaryDirectory(prefix="kvquant-calibrate-") as workdir:
        for i, (label, res) in enumerate(results.items()):
            folder = write_calibrated_checkpoint(path, res, Path(workdir) / str(i))
            row, _ = E.run_kvquant(
                model,
                eval_ids,
                reference,
                label=f"kvquant {label} (compressed-tensors checkpoint)",
                scales=folder,
                backend=args.backend,
            )
            rows.append(row)
    row, _ = E.run_kvquant(
        model,
        eval_ids,
        reference,
        label="kvquant fp32-group (G=64, dynamic)",
        scales={},
        scale_format="fp32-group",
        group_size=64,
        backend=args.backend,
    )
    rows.append(row)
    header = (
        f"SmolLM2-135M-Instruct (fp32 compute), calibration: {', '.join(calib_names)} "
        f"({stats.num_tokens} tokens, {calib_seconds:.1f} s), evaluation: pinned evaluation texts "
        f"({eval_ids.shape[0]} x {eval_ids.shape[1]} tokens)"
    )
    print(header)
    print(E.format_table(rows))
    for label, res in results.items():
        if "calibrated" in label:
            print(f"\n{label}:\n{res.render()}")
    if args.json:
        payload = {
            "header": header,
            "rows": [asdict(r) for r in rows],
            "calibrations": {k: r.to_dict() for k, r in results.items()},
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


def _as_calibrated(result: CalibrationResult, factor: float = 1.0) -> Any:
    """A ``benchmarks.harness.accuracy.CalibratedScales`` whose ``amax / 448`` is ``factor`` x the result's scales."""
    import benchmarks.harness.accuracy as E

    k = result.k_scales * FP8_E4M3_MAX * factor
    v = result.v_scales * FP8_E4M3_MAX * factor
    if k.dim() == 1:
        k = k[:, None].expand(-1, result.num_kv_heads)
        v = v[:, None].expand(-1, result.num_kv_heads)
    return E.CalibratedScales(k_amax=k.contiguous(), v_amax=v.contiguous(), num_tokens=0)


def _controls(
    model: torch.nn.Module,
    results: dict[str, CalibrationResult],
    eval_ids: torch.Tensor,
    reference: Any,
    rows: list[Any],
) -> int:
    """Simulated rows for every variant and for amax/448 x factor, with per-window deltas."""
    import benchmarks.harness.accuracy as E

    runs = [(label, res, 1.0) for label, res in results.items()]
    for g in _GRANULARITIES:
        runs += [(f"{g} amax/448 x {f}", results[f"{g} amax/448"], f) for f in _CONTROL_FACTORS]
    n = eval_ids.shape[1] - 1
    lines = []
    for label, res, factor in runs:
        t0 = time.perf_counter()
        with E.simulate_fp8_kv(model, res.granularity, _as_calibrated(res, factor)):
            st = E.teacher_forced(model, eval_ids)
        row = E.evaluate(f"simulated {label}", st, reference, time.perf_counter() - t0)
        rows.append(row)
        per_window = [
            100.0
            * (
                math.exp(float(st.nll[i * n : (i + 1) * n].double().mean()))
                / math.exp(float(reference.nll[i * n : (i + 1) * n].double().mean()))
                - 1.0
            )
            for i in range(eval_ids.shape[0])
        ]
        lines.append(
            f"| {row.label} | {row.delta_pct:+.2f}% | "
            + " ".join(f"{d:+.2f}" for d in per_window)
            + " |"
        )
        print(lines[-1], flush=True)
    print("\n| variant | Δ ppl (pooled) | Δ per window |\n|---|---:|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
