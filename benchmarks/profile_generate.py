"""Where the host time of a ``generate`` call goes, per arm (Python functions under cProfile).

Builds the model of ``e2e_generate.py`` and, per arm (``default``, ``kvquant``,
``kvquant-eager``: the arms of ``e2e_generate.py``), runs one warm-up
``generate`` and then one under ``cProfile`` (prefill, any graph capture and
every decode step), and prints the wall time of both calls and the functions
with the most total and cumulative time. At chat shapes a decode step is bound
by the host, so this is where its time is. With ``--kernels`` the profiled call
runs under ``torch.profiler`` instead and the table lists the GPU kernels by total
device time (per decode step: divide by ``--new``), which is where a long-context
step's time is. With ``--timeline`` it splits each decode step's wall time (from one
stop-check read of ``generate``, a device-to-host copy, to the next) into the GPU's busy
time, its idle time before the step's first kernel (the host preparing the step) and the
idle time between the step's kernels, and lists what the host runs in that first gap and
the kernels launched outside a CUDA graph. With ``--phases`` (no profiler: timestamps only)
it times each decode step's host phases: from ``generate``'s stop-check read (the GPU has
finished the step before) to the model's ``forward``, from there to the CUDA graph's
``replay`` (the GPU idles through both), the rest of ``forward``, and the wait at the next
read, then lists where a second call synchronizes with the GPU (``torch.cuda``'s sync debug
mode: each call site and how often per step). Usage (H200)::

    python3 benchmarks/profile_generate.py --batch 1 --prompt 512 --new 64 --out prof.txt
    python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 32 --kernels --out k.txt
    python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 32 --timeline --out t.txt
    python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 64 --phases --out p.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_generate as e2e


def _kernel_times(model, ids, mask, new: int, gen_kwargs: dict) -> tuple[float, dict]:
    """One call under ``torch.profiler``: wall seconds and {kernel: (device us, launches)}."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=acts) as prof:
        e2e.one_call(model, ids, mask, new, gen_kwargs)
    wall = time.perf_counter() - start
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0)
        # kernels and copies only: an operator's row repeats the time of the kernels it launched
        if us > 0 and str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1")):
            times[e.key] = (us, e.count)
    return wall, times


def kernel_table(arm: str, warm: dict, model, ids, mask, new: int, gen_kwargs: dict) -> str:
    """The GPU kernels of one decode step: a call of ``new`` tokens minus a call of one
    (which holds the prefill), divided by ``new - 1``, by device time."""
    wall_1, one = _kernel_times(model, ids, mask, 1, gen_kwargs)
    wall_n, many = _kernel_times(model, ids, mask, new, gen_kwargs)
    steps = max(new - 1, 1)
    rows = []
    for name, (us, count) in many.items():
        us0, count0 = one.get(name, (0.0, 0))
        rows.append(((us - us0) / steps, (count - count0) / steps, name))
    rows.sort(reverse=True)
    step_us = sum(r[0] for r in rows)
    step_launches = sum(r[1] for r in rows)
    lines = [
        f"=== {arm}: warm-up {warm['wall_s']:.3f} s; profiled calls {wall_1:.3f} s (1 new) and "
        f"{wall_n:.3f} s ({new} new); per decode step: device {step_us / 1e3:.3f} ms in "
        f"{step_launches:.1f} kernel launches",
        f"{'us/step':>10} {'launches/step':>14}  kernel",
    ]
    lines += [f"{us:10.1f} {n:14.2f}  {name[:110]}" for us, n, name in rows[:40]]
    return "\n".join(lines)


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_events(
    model, ids, mask, new: int, gen_kwargs: dict, stack: bool = False
) -> tuple[float, list[dict]]:
    """One call under ``torch.profiler``: wall seconds and the Chrome-trace events
    (with ``stack``, Python functions too)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=acts, with_stack=stack) as prof:
        e2e.one_call(model, ids, mask, new, gen_kwargs)
    wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return wall, [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


_SYNCS = (
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)


def _graph_gaps(events: list[dict], gpu: list[dict], runtime: dict, stack: bool) -> list[str]:
    """Replayed steps, graph launch to graph launch (medians over the steps, us).

    Per replay after the first two: the graph's GPU span (its first kernel's start to its last
    kernel's end), the GPU's idle time from the previous graph's end to this one's start
    (kernels outside the graphs in between count as busy), and the host's critical path: from
    the return of the wait for the previous graph (the longest synchronizing call between the
    two launches) to this launch. With ``stack``, the Python functions and operators the host
    runs on that path, each one's inclusive time clipped to it (nested ones count in each).
    """
    launches = sorted(
        (e for e in events if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"]
    )
    by_corr: dict[Any, list[dict]] = {}
    for e in gpu:
        by_corr.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    syncs = sorted(
        (e for e in runtime.values() if any(e["name"].startswith(n) for n in _SYNCS)),
        key=lambda e: e["ts"],
    )
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op")]
    rows: dict[str, list[float]] = {k: [] for k in ("span", "idle", "path", "wait")}
    per_step: list[Counter] = []
    for prev, cur in list(itertools.pairwise(launches))[2:]:
        pk = by_corr.get(prev.get("args", {}).get("correlation"), [])
        ck = by_corr.get(cur.get("args", {}).get("correlation"), [])
        waits = [e for e in syncs if prev["ts"] <= e["ts"] and e["ts"] + e["dur"] <= cur["ts"]]
        if not pk or not ck or not waits:
            continue
        p_end = max(e["ts"] + e["dur"] for e in pk)
        c_start = min(e["ts"] for e in ck)
        between = [
            (max(e["ts"], p_end), min(e["ts"] + e["dur"], c_start))
            for e in gpu
            if e["ts"] < c_start and e["ts"] + e["dur"] > p_end
        ]
        wait = max(waits, key=lambda e: e["dur"])
        w0 = wait["ts"] + wait["dur"]
        rows["span"].append(max(e["ts"] + e["dur"] for e in ck) - c_start)
        rows["idle"].append(c_start - p_end - _union([iv for iv in between if iv[1] > iv[0]]))
        rows["path"].append(cur["ts"] - w0)
        rows["wait"].append(wait["dur"])
        if stack:
            step: Counter = Counter()
            for e in host:
                if w0 <= e["ts"] < cur["ts"]:
                    step[e["name"]] += min(e["ts"] + e["dur"], cur["ts"]) - e["ts"]
            per_step.append(step)
    lines = [
        f"  replayed steps, graph launch to graph launch ({len(rows['span'])} steps, medians, us):",
        f"    the graph's GPU span                                  {_median(rows['span']):9.1f}",
        f"    GPU idle from the previous graph's end to its start   {_median(rows['idle']):9.1f}",
        f"    host: the wait for the previous graph                 {_median(rows['wait']):9.1f}",
        f"    host: from that wait's return to the graph's launch   {_median(rows['path']):9.1f}",
    ]
    if stack and per_step:
        names = set().union(*per_step)
        med = {n: statistics.median(s.get(n, 0.0) for s in per_step) for n in names}
        lines.append(
            "    on that host path, Python functions and operators (median inclusive us per "
            "step, profiler overhead included):"
        )
        for name, us in sorted(med.items(), key=lambda kv: -kv[1])[:70]:
            lines.append(f"      {us:8.1f}  {name[:110]}")
    return lines


def timeline_table(
    arm: str, warm: dict, model, ids, mask, new: int, gen_kwargs: dict, stack: bool = False
) -> str:
    """Each decode step's wall time split into GPU busy, the idle gap before its first
    kernel and the idle gaps between its kernels (medians over the steps). With ``stack``
    (Python functions traced: slower, for attribution only) it also lists the Python
    functions the host runs between the read's return and the graph's launch."""
    wall, events = _trace_events(model, ids, mask, new, gen_kwargs, stack)
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    runtime = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
    }
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    reads = [e for e in gpu if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]]
    rows: dict[str, list[float]] = {k: [] for k in ("wall", "busy", "first", "between", "n")}
    outside: Counter = Counter()
    host_ops: Counter = Counter()
    prep: list[float] = []
    cycles = list(itertools.pairwise(reads))[2:]  # the first cycles: the prefill and capture
    for r0, r1 in cycles:
        a, b = r0["ts"] + r0["dur"], r1["ts"] + r1["dur"]
        step = [e for e in gpu if a <= e["ts"] < b]
        if not step:
            continue
        busy = _union([(e["ts"], min(e["ts"] + e["dur"], b)) for e in step])
        first = step[0]["ts"] - a
        rows["wall"].append(b - a)
        rows["busy"].append(busy)
        rows["first"].append(first)
        rows["between"].append(b - a - busy - first)
        rows["n"].append(len(step))
        for e in step:
            call = runtime.get(e.get("args", {}).get("correlation"))
            if call is not None and call["name"] != "cudaGraphLaunch":
                outside[e["name"][:90]] += 1
        # the host between the read's return and the launch of the step's first kernel
        read_call = runtime.get(r0.get("args", {}).get("correlation"))
        first_call = runtime.get(step[0].get("args", {}).get("correlation"))
        if read_call is not None and first_call is not None:
            h0, h1 = read_call["ts"] + read_call["dur"], first_call["ts"]
            prep.append(h1 - h0)
            top: list[tuple[float, float]] = []
            for e in sorted(cpu_ops, key=lambda e: (e["ts"], -e["dur"])):
                if h0 <= e["ts"] and e["ts"] + e["dur"] <= h1:
                    if top and e["ts"] < top[-1][1]:
                        continue  # inside an op already counted
                    top.append((e["ts"], e["ts"] + e["dur"]))
                    host_ops[e["name"]] += e["dur"]
    steps = max(len(rows["wall"]), 1)
    lines = [
        f"=== {arm}: warm-up {warm['wall_s']:.3f} s; profiled call {wall:.3f} s ({new} new); "
        f"{len(rows['wall'])} decode steps between stop-check reads (medians, us):",
        f"  step wall {_median(rows['wall']):9.1f}   mean {statistics.fmean(rows['wall'] or [0]):9.1f}",
        f"  GPU busy  {_median(rows['busy']):9.1f}   in {_median(rows['n']):.0f} kernels and copies",
        f"  GPU idle before the step's first kernel {_median(rows['first']):9.1f}",
        f"  GPU idle between the step's kernels     {_median(rows['between']):9.1f}",
        f"  host from the read's return to the step's first launch {_median(prep):9.1f}",
        "  kernels launched outside a CUDA graph, per step:",
    ]
    lines += [f"    {n / steps:6.2f}  {name}" for name, n in outside.most_common(25)]
    lines.append("  host operators between the read and the first launch (us per step):")
    lines += [f"    {us / steps:8.1f}  {name[:90]}" for name, us in host_ops.most_common(25)]
    lines += _graph_gaps(events, gpu, runtime, stack)
    cats = Counter(e.get("cat") for e in events)
    lines.append(f"  trace events by category: {dict(cats.most_common(12))}")
    return "\n".join(lines)


def phases_table(arm: str, warm: dict, model, ids, mask, new: int, gen_kwargs: dict) -> str:
    """Host phases of each decode step, from timestamps (medians over the steps, us)."""
    marks: list[tuple[str, float]] = []
    clock = time.perf_counter

    def stamped(fn, before: str, after: str):
        def wrapper(*args, **kwargs):
            marks.append((before, clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((after, clock()))

        return wrapper

    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    classes = [
        (torch.cuda.CUDAGraph, "replay", "replay", "replayed"),
        (LogitsProcessorList, "__call__", "logits processors", "logits processed"),
        (StoppingCriteriaList, "__call__", "stopping criteria", "stopping criteria done"),
    ]
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _, _ in classes]
    for cls, name, before, after in classes:
        setattr(cls, name, stamped(getattr(cls, name), before, after))
    instance = [
        ("_has_unfinished_sequences", "read", "done"),
        ("_update_model_kwargs_for_generation", "kwargs update", "kwargs updated"),
        ("prepare_inputs_for_generation", "inputs prepare", "inputs prepared"),
    ]
    for name, before, after in instance:
        setattr(model, name, stamped(getattr(model, name), before, after))
    # module hooks, not a wrapped ``forward``: kvquant's step runner is the model's ``forward``
    hooks = [
        model.register_forward_pre_hook(lambda *_: marks.append(("forward", clock()))),
        model.register_forward_hook(lambda *_: marks.append(("returned", clock()))),
    ]
    try:
        e2e.one_call(model, ids, mask, new, gen_kwargs)
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
        for name, _, _ in instance:
            delattr(model, name)
        for hook in hooks:
            hook.remove()
    # one step: the read's return, forward, (replay), forward's return, the next read's return
    steps: dict[str, list[float]] = {
        k: [] for k in ("step", "to_forward", "to_replay", "after_replay", "to_read", "read")
    }
    offsets: dict[str, list[float]] = {}
    done = [t for name, t in marks if name == "done"]
    for a, b in itertools.pairwise(done[2:]):  # skip the prefill and the first (capture) step
        inside = [(name, t) for name, t in marks if a < t < b]
        at = {name: t for name, t in reversed(inside)}  # the first time of each mark
        for name, t in at.items():
            offsets.setdefault(name, []).append(t - a)
        if not {"forward", "returned", "read"} <= at.keys():
            continue
        rep = at.get("replay", at["forward"])
        steps["step"].append(b - a)
        steps["to_forward"].append(at["forward"] - a)
        steps["to_replay"].append(rep - at["forward"])
        steps["after_replay"].append(at["returned"] - rep)
        steps["to_read"].append(at["read"] - at["returned"])
        steps["read"].append(b - at["read"])
    med = {k: _median(v) * 1e6 for k, v in steps.items()}
    syncs = _sync_sites(model, ids, mask, new, gen_kwargs)
    return "\n".join(
        [
            f"=== {arm}: warm-up {warm['wall_s']:.3f} s; {len(steps['step'])} decode steps "
            "(medians, us)",
            f"  step (read's return to read's return)        {med['step']:9.1f}",
            f"  read's return -> forward (generate)          {med['to_forward']:9.1f}",
            f"  forward -> graph replay (kvquant's runner)   {med['to_replay']:9.1f}",
            f"  replay -> forward returns                    {med['after_replay']:9.1f}",
            f"  forward returns -> next read (generate)      {med['to_read']:9.1f}",
            f"  the read (waits for the GPU)                 {med['read']:9.1f}",
            "  every mark, from the read's return (medians, us):",
        ]
        + [
            f"    {_median(v) * 1e6:9.1f}  {name}"
            for name, v in sorted(offsets.items(), key=lambda kv: _median(kv[1]))
        ]
        + ["  synchronizing calls per decode step (a second call, sync debug mode), by site:"]
        + [f"    {n / max(new - 1, 1):6.2f}  {site}" for site, n in syncs.most_common(12)]
    )


def _sync_sites(model, ids, mask, new: int, gen_kwargs: dict) -> Counter:
    """Where one call synchronizes with the GPU: innermost non-torch frames, counted."""
    import traceback
    import warnings

    sites: Counter = Counter()
    if not torch.cuda.is_available():
        return sites

    def record(*_args, **_kwargs) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "site-packages/torch/" not in f.filename and "warnings" not in f.filename
        ]
        sites[
            " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        ] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            e2e.one_call(model, ids, mask, new, gen_kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--arms", default="default,kvquant")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kernels", action="store_true", help="GPU kernel table (torch.profiler)")
    ap.add_argument("--timeline", action="store_true", help="decode step wall/busy/idle split")
    ap.add_argument("--phases", action="store_true", help="decode step host phases (no profiler)")
    ap.add_argument(
        "--stack", action="store_true", help="with --timeline: the Python functions in the gap"
    )
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = e2e.build_model(args.tiny, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    scales = e2e.calibrate_per_tensor(
        model, torch.randint(1, vocab, (1, 64), generator=gen).to(dev)
    )
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=gen).to(dev)
    mask = torch.ones_like(ids)
    lines: list[str] = []
    for arm in args.arms.split(","):
        with e2e.Arm(arm, model, scales, args.backend) as gen_kwargs:
            warm = e2e.one_call(model, ids, mask, args.new, gen_kwargs)
            if args.kernels or args.timeline or args.phases:
                table = (
                    kernel_table
                    if args.kernels
                    else timeline_table
                    if args.timeline
                    else phases_table
                )
                extra = {"stack": args.stack} if table is timeline_table else {}
                lines.append(table(arm, warm, model, ids, mask, args.new, gen_kwargs, **extra))
                args.out.write_text("\n".join(lines))  # kept if a later arm is cut short
                continue
            prof = cProfile.Profile()
            start = time.perf_counter()
            prof.enable()
            e2e.one_call(model, ids, mask, args.new, gen_kwargs)
            prof.disable()
            wall = time.perf_counter() - start
        buf = io.StringIO()
        lines.append(
            f"=== {arm}: warm-up call {warm['wall_s']:.3f} s; profiled call {wall:.3f} s "
            f"(cProfile overhead included)"
        )
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        lines.append(buf.getvalue())
    text = "\n".join(lines)
    args.out.write_text(text)
    print("\n".join(line for line in text.splitlines() if line.startswith("===")))


if __name__ == "__main__":
    main()
