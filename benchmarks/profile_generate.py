"""Profile the decode steps of ``generate`` per arm (where does a step's time go?).

Builds the model of ``e2e_generate.py`` and, per arm, runs a short greedy
``generate`` whose profiler starts after the first token (so the prefill is
not in the tables), then prints the operators with the most self CPU time and
the most self CUDA time, plus the wall time per decode step. Usage (H200)::

    python3 benchmarks/profile_generate.py --steps 8 --out prof.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_generate as e2e


class _ProfileDecode:
    """A stopping criterion that starts the profiler after the prefill's token."""

    def __init__(self, prof: torch.profiler.profile) -> None:
        self.prof = prof
        self.started = False

    def __call__(self, input_ids: torch.Tensor, scores: object, **kwargs: object) -> torch.Tensor:
        if not self.started:
            e2e.sync(input_ids.device)
            self.prof.start()
            self.started = True
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _python_profile(model: torch.nn.Module, ids: torch.Tensor, steps: int, extra: dict) -> str:
    """cProfile of a short greedy ``generate`` (prefill included): top functions by total time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    e2e.run_generate(model, ids, steps, extra)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--arms", default="sdpa,kvquant")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--python-profile",
        action="store_true",
        help="also run each arm's decode under cProfile (Python functions by total time)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = e2e.build_model(args.tiny, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    ids = ids.to(dev)
    lines: list[str] = []
    for arm in args.arms.split(","):
        if arm == "kvquant":
            import kvquant

            handle = kvquant.patch(
                model, scales={}, scale_format="fp32-group", group_size=None if args.tiny else 64
            )
            key = e2e.cache_kwarg(model)
            tokens = args.batch * (args.prompt_len + args.steps + 8)

            def extra(h=handle, k=key, t=tokens):  # type: ignore[no-untyped-def]
                return {k: h.new_cache(max_cache_tokens=t)}
        else:
            handle = None

            def extra():  # type: ignore[no-untyped-def]
                return {}

        e2e.run_generate(model, ids, 2, extra())  # warm-up: compile kernels, allocator
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        clock = e2e.StepClock(dev)
        e2e.sync(dev)
        clock.start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.steps,
            min_new_tokens=args.steps,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock, _ProfileDecode(prof)]),
            **extra(),
        )
        e2e.sync(dev)
        prof.stop()
        steps = clock.stamps
        per_step = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) * 1000
        lines.append(f"=== {arm}: prefill {steps[0] - clock.start:.3f} s, {per_step:.1f} ms/step")
        ka = prof.key_averages()
        lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=25))
        if dev.type == "cuda":
            lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=15))
        if args.python_profile:
            lines.append(_python_profile(model, ids, args.steps, extra()))
        if handle is not None:
            handle.remove()
        time.sleep(0.1)
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
