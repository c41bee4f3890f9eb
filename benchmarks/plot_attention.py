"""Plot the committed H200 attention benchmark as time per call and speed-up over SDPA.

Reads ``benchmarks/results/h200_attention_final.json`` (written by
``benchmarks/bench_attention.py``) and writes ``docs/assets/attention_h200.png``:

* left: decode time per call in µs (log scale, lower is better) for each batch ×
  context of the 32/8/128 shape, SDPA on a bf16 cache against kvquant's FP8 formats;
* right: the same runs as speed-up over SDPA (higher is better).

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
FORMATS = (
    ("per-tensor", "kvquant FP8, per-tensor"),
    ("per-head", "kvquant FP8, per-head"),
    ("group64", "kvquant FP8, fp32-group G=64"),
)


def _label(row: dict[str, Any]) -> str:
    ctx = row["ctx"] if "ctx" in row else row["prefix"] + row["chunk"]
    return f"{row['B']}×{ctx // 1024}k"


def plot(results: dict[str, Any], out: Path, source: str) -> None:
    """Draw the figure from a bench_attention.py result and save it as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in results["decode"] if (r["hq"], r["hkv"], r["d"]) == (32, 8, 128)]
    labels = [_label(r) for r in decode]
    x = range(len(decode))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    left.plot(x, [1000 * r["sdpa_bf16_ms"] for r in decode], "k-o", label="SDPA, bf16 cache")
    for key, name in FORMATS:
        left.plot(x, [1000 * r[key]["ms"] for r in decode], "-o", label=name, markersize=4)
    left.set_yscale("log")
    left.set_ylabel("µs per call (lower is better)")
    left.set_title("Decode, one layer, 32/8/128 heads, eager launch")
    width = 0.8 / len(FORMATS)
    for i, (key, name) in enumerate(FORMATS):
        offsets = [j + (i - 1) * width for j in x]
        right.bar(offsets, [r[key]["speedup_vs_sdpa"] for r in decode], width, label=name)
    right.axhline(1.0, color="k", linewidth=1)
    right.set_ylabel("speed-up over SDPA bf16 (higher is better)")
    right.set_title("Decode speed-up over SDPA (same runs)")
    for axis in (left, right):
        axis.set_xticks(list(x), labels, rotation=60, fontsize=8)
        axis.set_xlabel("batch × context (tokens)")
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(
        f"kvquant FP8 paged attention on {results['gpu']} ({results['date_utc'][:10]}, {source})",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
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
