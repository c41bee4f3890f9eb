"""Where the host time of a ``generate`` call goes, per arm (Python functions under cProfile).

Builds the model of ``e2e_generate.py`` and, per arm (``default``, ``kvquant``,
``kvquant-eager``: the arms of ``e2e_generate.py``), runs one warm-up
``generate`` and then one under ``cProfile`` (prefill, any graph capture and
every decode step), and prints the wall time of both calls and the functions
with the most total and cumulative time. At chat shapes a decode step is bound
by the host, so this is where its time is. With ``--kernels`` the profiled call
runs under ``torch.profiler`` instead and the table lists the GPU kernels by total
device time (per decode step: divide by ``--new``), which is where a long-context
step's time is. Usage (H200)::

    python3 benchmarks/profile_generate.py --batch 1 --prompt 512 --new 64 --out prof.txt
    python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 32 --kernels --out k.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

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
            if args.kernels:
                lines.append(kernel_table(arm, warm, model, ids, mask, args.new, gen_kwargs))
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
