"""Split-count rules for the decode kernel against forced split counts timed on a GPU.

Reads the JSON of ``bench_fp4_decode.py --splits`` (any ``--table-pages``, ``--recent``) and
the ``tune.json`` of ``tune_decode.py --no-configs`` (forced counts and the launcher's own), and
prints per shape and format the graph-replay time of the best forced count, of the launcher's
count (today's wave-and-balance rule, ``kvquant.kernels.attention.tuning.choose_num_splits``)
and of each candidate rule's count, each as a multiple of the best; a rule whose count was not
timed takes the nearest timed count (marked ``~``). Then per rule the geometric mean and the
worst of those multiples. No GPU needed: it reads results.

The candidates, ``fill-C``: split only until the programs number ``C`` per multiprocessor
(``ceil(C * SMs / (B * Hkv))``), at most one split per two tiles of the keys stored. They
assume a memory-bound program of a partial wave streams faster than a full wave's, so the
waves the current rule counts cost less than it thinks once the programs fill the bandwidth.

Usage::

    python benchmarks/split_rules.py splits_b64.json splits_b16.json kt/tune.json [--sms 132]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILL = (1, 2, 4)
"""Programs per multiprocessor of the ``fill-C`` candidates."""
BLOCK_N = 64
"""Keys per tile of the decode kernel (the launcher's decode tiles)."""


@dataclass
class Case:
    """One shape and format: its forced counts' times and the launcher's count and time."""

    label: str
    pairs: int  # sequences x KV heads
    keys: int  # keys stored per sequence
    times: dict[int, float]  # forced split count -> ms
    launcher: int | None
    launcher_ms: float


def fill_splits(pairs: int, keys: int, sms: int, per_sm: int) -> int:
    """``fill-C``: the smallest count whose programs number ``per_sm`` per multiprocessor,
    at most one split per two tiles of ``keys``.

    Example:
        >>> fill_splits(512, 2080, 132, 2)
        1
        >>> fill_splits(128, 8192, 132, 2)
        3
    """
    tiles = max(1, math.ceil(keys / BLOCK_N))
    return max(1, min(math.ceil(per_sm * sms / pairs), max(1, tiles // 2)))


def _time_of(case: Case, splits: int) -> tuple[float, bool]:
    """The time of ``splits`` (exact) or of the nearest timed count (False)."""
    if splits in case.times:
        return case.times[splits], True
    nearest = min(case.times, key=lambda s: (abs(s - splits), s))
    return case.times[nearest], False


def cases_of_bench(data: dict[str, Any]) -> list[Case]:
    """The cases of a ``bench_fp4_decode.py --splits`` JSON (graph replay)."""
    out = []
    for row in data["rows"]:
        shape = f"{row['hq']}/{row['hkv']}/{row['d']} B{row['B']}x{row['ctx']}"
        if "table_pages" in row:
            shape += f" (table {row['table_pages'] * row['page']})"
        for name, entry in row.items():
            if not isinstance(entry, dict) or "splits" not in entry:
                continue
            for label, e in ((name, entry), (f"{name} + ring", entry.get("recent"))):
                if not isinstance(e, dict) or not e.get("splits") or "graph_ms" not in e:
                    continue
                times = {int(s): t["graph_ms"] for s, t in e["splits"].items() if "graph_ms" in t}
                out.append(
                    Case(
                        f"{shape} {label}",
                        row["B"] * row["hkv"],
                        row["ctx"],
                        times,
                        e.get("launcher_splits"),
                        e["graph_ms"],
                    )
                )
    return out


def cases_of_tune(data: dict[str, Any]) -> list[Case]:
    """The cases of a ``tune_decode.py --no-configs`` ``tune.json`` (its timer's times)."""
    out = []
    for row in data["shapes"]:
        m = re.match(r"(\d+)/(\d+)/(\d+) B(\d+)x(\d+)", row["shape"])
        if m is None:
            continue
        hkv, bsz, ctx = int(m.group(2)), int(m.group(4)), int(m.group(5))
        for name, entry in row.items():
            if not isinstance(entry, dict) or "runs" not in entry:
                continue
            runs = [r for r in entry["runs"] if r.get("impl") == "current" and not r.get("config")]
            runs = [r for r in runs if isinstance(r.get("ms"), float) and r["ms"] == r["ms"]]
            auto = [r for r in runs if r["splits"] is None]
            times = {int(r["splits"]): r["ms"] for r in runs if r["splits"] is not None}
            if not auto or not times:
                continue
            out.append(
                Case(
                    f"{row['shape']} {name}",
                    bsz * hkv,
                    ctx,
                    times,
                    auto[0].get("launcher_splits"),
                    auto[0]["ms"],
                )
            )
    return out


def load_cases(paths: list[Path]) -> list[Case]:
    """Every case of the given result files (each a bench or a tune JSON)."""
    cases: list[Case] = []
    for path in paths:
        data = json.loads(path.read_text())
        cases += cases_of_bench(data) if "rows" in data else cases_of_tune(data)
    return cases


def judge(cases: list[Case], sms: int) -> dict[str, Any]:
    """Per case the best forced count and each rule's count and multiple of the best; per rule
    the geometric mean and worst multiple."""
    rules = ["launcher", *(f"fill-{c}" for c in FILL)]
    rows = []
    ratios: dict[str, list[float]] = {r: [] for r in rules}
    for case in cases:
        best_s = min(case.times, key=lambda s: case.times[s])
        best = case.times[best_s]
        row: dict[str, Any] = {"case": case.label, "best": [best_s, best]}
        row["launcher"] = [case.launcher, case.launcher_ms, case.launcher_ms / best, True]
        for c in FILL:
            s = fill_splits(case.pairs, case.keys, sms, c)
            t, exact = _time_of(case, s)
            row[f"fill-{c}"] = [s, t, t / best, exact]
        for r in rules:
            ratios[r].append(row[r][2])
        rows.append(row)
    summary = {
        r: {
            "geomean_x_best": math.exp(sum(map(math.log, v)) / len(v)) if v else None,
            "worst_x_best": max(v) if v else None,
        }
        for r, v in ratios.items()
    }
    return {"sms": sms, "cases": rows, "rules": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench_fp4_decode / tune_decode JSON")
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors of the GPU (H200: 132)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    cases = load_cases(args.results)
    if not cases:
        raise SystemExit("no forced split counts in these files (run with --splits/--no-configs)")
    result = judge(cases, args.sms)
    rules = list(result["rules"])
    print("case | best (splits, ms) | " + " | ".join(rules))
    for row in result["cases"]:
        cells = []
        for r in rules:
            s, _t, x, exact = row[r]
            cells.append(f"{'' if exact else '~'}{s}: {x:.3f}x")
        print(f"{row['case']} | {row['best'][0]}: {row['best'][1]:.4f} | " + " | ".join(cells))
    for r, s in result["rules"].items():
        print(f"{r}: geomean {s['geomean_x_best']:.3f}x best, worst {s['worst_x_best']:.3f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
