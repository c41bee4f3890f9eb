"""Plots of the end-to-end benchmark for the docs (``docs/assets/e2e_*.png``).

Reads the JSON files ``e2e_generate.py`` wrote (``benchmarks/results/h200_e2e_*.json``)
and draws, for the arms docs/performance.md's tables show (:data:`ARMS`): decode speed per
shape and arm (tokens/s, higher is better), peak memory and capacity (largest batch of
8192-token prompts in 24 GB), and, where the sweeps were run, decode tokens/s against batch
and peak memory against context.

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
    "kvquant-nocompile": "#9edae5",
}

ARMS = {
    "default": "default",
    "static": "static\n(compiled)",
    "kvquant": "kvquant",
    "kvquant-fp32-group": "kvquant,\nno scales",
    "kvquant-nocompile": "kvquant,\nno compile",
}
"""Every arm the plots draw, in order, as they name it."""

TABLE_ARMS = {
    "b16x8k": ("default", "kvquant", "kvquant-fp32-group"),
    "chat": ("default", "static", "kvquant", "kvquant-fp32-group"),
    "b64x2k": ("default", "static", "kvquant", "kvquant-nocompile"),
}
"""Per shape, the arms docs/performance.md's table shows (a run may hold more)."""


def _arms(name: str, shape: dict[str, Any]) -> list[str]:
    wanted = TABLE_ARMS.get(name, tuple(ARMS))
    return [a for a in wanted if shape["arms"].get(a, {}).get("status") == "ok"]


def _bars(ax: Any, names: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    bars = ax.bar(range(len(names)), values, color=colors)
    ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=9)
    ax.set_xticks(range(len(names)), names, fontsize=9)
    ax.margins(y=0.15)


def load(results: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for path in sorted(results.glob("h200_e2e_*.json")):
        data[path.stem.removeprefix("h200_e2e_")] = json.loads(path.read_text())
    return data


def plot_shapes(data: dict[str, Any], out: Path) -> None:
    """One panel: each arm's decode speed relative to transformers' default, per shape."""
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11})
    order = [k for k in TABLE_ARMS if k in data.get(k, {}).get("shapes", {})]
    shapes = [(k, data[k]["shapes"][k]) for k in order]
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    arms = [a for a in ARMS if any(a in _arms(k, shape) for k, shape in shapes)]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs, ys = [], []
        for j, (k, shape) in enumerate(shapes):
            if arm in _arms(k, shape):
                base = shape["arms"]["default"]["decode_tokens_per_s"]
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(shape["arms"][arm]["decode_tokens_per_s"] / base)
        bars = ax.bar(xs, ys, width, color=COLORS[arm], label=ARMS[arm].replace("\n", " "))
        ax.bar_label(bars, [f"{y:.1f}x" for y in ys], fontsize=8)
    ax.axhline(1.0, color="k", linewidth=1)
    labels = [f"{s['batch']} x ({s['prompt']} + {s['new']})" for _, s in shapes]
    ax.set_xticks(range(len(shapes)), labels)
    ax.set_xlabel("prompts x (prompt + new tokens)")
    ax.set_ylabel("decode speed / default's (higher is better)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3)
    fig.tight_layout()
    fig.savefig(out / "e2e_decode.png", dpi=100)
    plt.close(fig)


def plot_memory(data: dict[str, Any], out: Path) -> None:
    """Peak memory of the 16 x 8k call; the largest batch that fits 24 GiB, per setting."""
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 7.4))
    shape = data.get("b16x8k", {}).get("shapes", {}).get("b16x8k")
    if shape:
        arms = _arms("b16x8k", shape)
        vals = [shape["arms"][a]["peak_bytes"] / 1e9 for a in arms]
        _bars(ax1, [ARMS[a] for a in arms], vals, [COLORS[a] for a in arms], "{:.2f}")
        ax1.set_title("peak memory, 16 x 8k prompts (lower is better)")
        ax1.set_ylabel("GB")
    cap = data.get("capacity_defaults", {}).get("capacity")
    if cap:
        runs = cap["runs"]
        wide = data.get("capacity_expandable_segments", {}).get("capacity", {}).get("runs", {})
        groups = [
            ("one prefill", runs.get("default"), runs.get("kvquant")),
            ("chunked prefill", runs.get("default-chunked"), runs.get("kvquant-chunked")),
            (
                "chunked, expandable\nsegments",
                wide.get("default-chunked"),
                wide.get("kvquant-chunked"),
            ),
        ]
        groups = [g for g in groups if g[1] and g[2]]
        for i, arm in enumerate(("default", "kvquant")):
            xs = [j + (i - 0.5) * 0.4 for j in range(len(groups))]
            vals = [g[1 + i]["max_batch"] for g in groups]
            bars = ax2.bar(xs, vals, 0.4, color=COLORS[arm], label=arm)
            ax2.bar_label(bars, [str(v) for v in vals], fontsize=9)
        ax2.set_xticks(range(len(groups)), [g[0] for g in groups])
        ax2.margins(y=0.15)
        ax2.legend()
        gb = cap["budget_bytes"] / 2**30
        ax2.set_title(f"largest batch of 8k prompts in {gb:.0f} GiB")
        ax2.set_ylabel("sequences (higher is better)")
    fig.tight_layout()
    fig.savefig(out / "e2e_memory.png", dpi=100)
    plt.close(fig)


def plot_sweeps(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    sweeps = data.get("sweeps", {})
    batch, context = sweeps.get("sweep_batch"), sweeps.get("sweep_context")
    if not batch and not context:
        return
    plt.rcParams.update({"font.size": 10})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.9))
    # the sweeps were measured before the compiled decode step: kvquant's decode graph then
    # captured the eager layers, as compile_step=False does now
    labels = {"default": "default", "kvquant": "kvquant, compile_step=False"}
    for arm in ("default", "kvquant"):
        if batch:
            xs = [p["batch"] for p in batch if p["arms"][arm]["status"] == "ok"]
            ys = [
                p["arms"][arm]["decode_tokens_per_s"]
                for p in batch
                if p["arms"][arm]["status"] == "ok"
            ]
            ax1.plot(xs, ys, "o-", color=COLORS[arm], label=labels[arm])
        if context:
            xs = [p["prompt"] for p in context if p["arms"][arm]["status"] == "ok"]
            ys = [
                p["arms"][arm]["peak_bytes"] / 1e9
                for p in context
                if p["arms"][arm]["status"] == "ok"
            ]
            ax2.plot(xs, ys, "o-", color=COLORS[arm], label=labels[arm])
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch (2048-token prompts, 32 new tokens)")
    ax1.set_ylabel("decode tokens/s (higher is better)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt tokens (batch 16, 8 new tokens)")
    ax2.set_ylabel("peak GB (lower is better)")
    for ax, points, key in ((ax1, batch, "batch"), (ax2, context, "prompt")):
        ticks = sorted({p[key] for p in points or []})
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "e2e_sweeps.png", dpi=100)
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
