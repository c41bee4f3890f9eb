"""Where the host time of a ``generate`` call goes, per arm (Python functions under cProfile).

Builds the model of ``e2e_generate.py`` and, per arm (``default``, ``kvquant``,
``kvquant-eager``: the arms of ``e2e_generate.py``), runs one warm-up
``generate`` and then one under ``cProfile`` (prefill, any graph capture and
every decode step), and prints the wall time of both calls and the functions
with the most total and cumulative time. At chat shapes a decode step is bound
by the host, so this is where its time is. Usage (H200)::

    python3 benchmarks/profile_generate.py --batch 1 --prompt 512 --new 64 --out prof.txt
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--arms", default="default,kvquant")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--backend", default="auto")
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
