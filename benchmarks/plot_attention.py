"""Plot the committed H200 attention benchmark as time per call and speed-up over SDPA.

Reads ``benchmarks/results/h200_attention_final.json`` (written by
``benchmarks/bench_attention.py``) and writes ``docs/assets/attention_h200.png``:

* top: decode time per call in µs (log scale, lower is better) against the context,
  one line per batch size, SDPA on a bf16 cache (dashed) and kvquant per-tensor (solid);
* bottom: the same runs as speed-up over SDPA (higher is better), per-tensor and
  fp32-group.

Time, not effective bandwidth: FP8 moves half the bytes of bf16, so equal
bandwidth would hide a twofold speed-up. Run:
``python benchmarks/plot_attention.py [--results FILE] [--out PNG]`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 4096, 16384, 32768)


def plot(results: dict[str, Any], out: Path, source: str) -> None:
    """Draw the figure from a bench_attention.py result and save it as PNG.

    One line per batch size against the context (never a line across batch sizes):
    left, µs per call of SDPA (dashed) and kvquant per-tensor (solid); right, kvquant's
    speed-up over SDPA, per-tensor (solid) and fp32-group G=64 (dotted).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11})
    rows = {
        (r["B"], r["ctx"]): r
        for r in results["decode"]
        if (r["hq"], r["hkv"], r["d"]) == (32, 8, 128)
    }
    x = list(range(len(CONTEXTS)))
    ticks = [f"{c // 1024}k" for c in CONTEXTS]
    fig, (left, right) = plt.subplots(2, 1, figsize=(7.5, 9), constrained_layout=True)
    for i, batch in enumerate(BATCHES):
        color = f"C{i}"
        shape = [rows[(batch, c)] for c in CONTEXTS]
        left.plot(x, [1000 * r["sdpa_bf16_ms"] for r in shape], "--", color=color, alpha=0.7)
        left.plot(x, [1000 * r["per-tensor"]["ms"] for r in shape], "-o", color=color,
                  label=f"batch {batch}")  # fmt: skip
        right.plot(x, [r["per-tensor"]["speedup_vs_sdpa"] for r in shape], "-o", color=color,
                   label=f"batch {batch}")  # fmt: skip
        right.plot(x, [r["group64"]["speedup_vs_sdpa"] for r in shape], ":", color=color)
    left.set_yscale("log")
    left.set_ylabel("µs per call (lower is better)")
    left.set_title("time: kvquant per-tensor (solid), SDPA bf16 (dashed)")
    right.axhline(1.0, color="k", linewidth=1)
    right.set_ylabel("speed-up (higher is better)")
    right.set_title("speed-up over SDPA: per-tensor (solid), fp32-group (dotted)")
    for axis in (left, right):
        axis.set_xticks(x, ticks)
        axis.set_xlabel("context (tokens per sequence)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=10)
    fig.suptitle(
        f"Decode attention, one layer (32/8 heads, head_dim 128), {results['gpu']}",
        fontsize=12,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


RESULTS = ROOT / "benchmarks" / "results" / "h200_attention_final.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "attention_h200.png")
    args = parser.parse_args()
    plot(json.loads(args.results.read_text(encoding="utf-8")), args.out, args.results.name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
