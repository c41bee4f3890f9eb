"""Plots of the end-to-end benchmark for the docs (``docs/assets/e2e_*.png``).

Reads the JSON files ``e2e_generate.py`` wrote (``benchmarks/results/h200_e2e_*.json``)
and draws: decode speed per shape and arm (tokens/s, higher is better), peak memory and
capacity (largest batch of 8192-token prompts in 24 GB), and, where the sweeps were run,
decode tokens/s against batch and peak memory against context.

Usage::

    python benchmarks/plot_e2e.py --results benchmarks/results --out docs/assets
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {
    "default": "#7f7f7f",
    "static": "#bcbd22",
    "kvquant": "#1f77b4",
    "kvquant-fp32-group": "#17becf",
    "kvquant-eager": "#aec7e8",
    "kvquant-nocompile": "#9edae5",
}


def load(results: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for path in sorted(results.glob("h200_e2e_*.json")):
        data[path.stem.removeprefix("h200_e2e_")] = json.loads(path.read_text())
    return data


def plot_shapes(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    shapes = [(k, v["shapes"][k]) for k, v in data.items() if k in v.get("shapes", {})]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6))
    for ax, (_name, shape) in zip(axes, shapes, strict=True):
        arms = [a for a, r in shape["arms"].items() if r["status"] == "ok"]
        vals = [shape["arms"][a]["decode_tokens_per_s"] for a in arms]
        ax.bar(range(len(arms)), vals, color=[COLORS.get(a, "#333") for a in arms])
        ax.set_xticks(range(len(arms)), arms, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"B{shape['batch']} x ({shape['prompt']} + {shape['new']})", fontsize=10)
        ax.set_ylabel("decode tokens/s (higher is better)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_decode.png", dpi=110)
    plt.close(fig)


def plot_memory(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    shape = data.get("b16x8k", {}).get("shapes", {}).get("b16x8k")
    if shape:
        arms = [a for a, r in shape["arms"].items() if r["status"] == "ok"]
        vals = [shape["arms"][a]["peak_bytes"] / 1e9 for a in arms]
        ax1.bar(range(len(arms)), vals, color=[COLORS.get(a, "#333") for a in arms])
        ax1.set_xticks(range(len(arms)), arms, rotation=35, ha="right", fontsize=8)
        ax1.set_ylabel("peak GB, B16 x 8k generate (lower is better)", fontsize=8)
    cap = data.get("capacity", {}).get("capacity")
    if cap:
        runs = dict(cap["runs"])
        # a later chunked-only search (h200_e2e_capacity_chunked.json) replaces its rows
        runs.update(data.get("capacity_chunked", {}).get("capacity", {}).get("runs", {}))
        names = list(runs)
        vals = [runs[n]["max_batch"] for n in names]
        colors = [COLORS["kvquant" if n.startswith("kvquant") else "default"] for n in names]
        ax2.bar(range(len(names)), vals, color=colors)
        ax2.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        gb = cap["budget_bytes"] / 2**30
        ax2.set_ylabel(f"largest batch of 8k prompts in {gb:.0f} GiB", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_memory.png", dpi=110)
    plt.close(fig)


def plot_sweeps(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    sweeps = data.get("sweeps", {})
    batch, context = sweeps.get("sweep_batch"), sweeps.get("sweep_context")
    if not batch and not context:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for arm in ("default", "kvquant"):
        if batch:
            xs = [p["batch"] for p in batch if p["arms"][arm]["status"] == "ok"]
            ys = [
                p["arms"][arm]["decode_tokens_per_s"]
                for p in batch
                if p["arms"][arm]["status"] == "ok"
            ]
            ax1.plot(xs, ys, "o-", color=COLORS[arm], label=arm)
        if context:
            xs = [p["prompt"] for p in context if p["arms"][arm]["status"] == "ok"]
            ys = [
                p["arms"][arm]["peak_bytes"] / 1e9
                for p in context
                if p["arms"][arm]["status"] == "ok"
            ]
            ax2.plot(xs, ys, "o-", color=COLORS[arm], label=arm)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch (2048-token prompts)", fontsize=8)
    ax1.set_ylabel("decode tokens/s", fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt tokens (batch 16)", fontsize=8)
    ax2.set_ylabel("peak GB", fontsize=8)
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_sweeps.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--out", default="docs/assets")
    args = ap.parse_args()
    data = load(Path(args.results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_shapes(data, out)
    plot_memory(data, out)
    plot_sweeps(data, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
