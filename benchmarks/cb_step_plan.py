"""Host time of kvquant's continuous-batching step plan (``build_plan``), on CPU.

Under transformers' continuous batching kvquant plans each forward once, on the host, after
reading the step's lengths (the one synchronisation): which requests attend at full precision,
and for the others the paged-attention launches' query slots, block tables and lengths. The
device waits for that plan, so its host time adds to every step. This times it for synthetic
steps of Llama-3.2-1B's cache geometry (8 KV heads, head_dim 64, 256-token blocks): ``N``
requests decoding one token each at random lengths of 256 to 8192, with and without a few
512-token prompt chunks, with and without the k-transform's first tokens, and with
``--recent R`` also with a ring of ``R`` newest tokens per block. The median of
``--repeats`` calls per step; no GPU needed (the plan's host part is the same).

Usage::

    python benchmarks/cb_step_plan.py [--repeats 50] [--recent 16] [--json out.json]
    PYTHONPATH=_prev:. python benchmarks/cb_step_plan.py   # an earlier kvquant in _prev/
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvquant.integrations.hf.continuous.layout import BlockLayout
from kvquant.integrations.hf.continuous.plan import build_plan

PAGE = 256
STEPS = ((64, 0), (256, 0), (240, 4))
"""(requests decoding one token, requests with a 512-token prompt chunk) of each timed step."""


def step_kwargs(decoding: int, chunks: int, seed: int = 0) -> dict[str, Any]:
    """transformers' batching keywords of one step (host tensors)."""
    rng = random.Random(seed)
    q_lens = [1] * decoding + [512] * chunks
    kv_lens = [rng.randint(256, 8192) for _ in range(decoding)]
    kv_lens += [rng.randint(512, 8192) for _ in range(chunks)]
    cu_q, cu_k = [0], [0]
    for q, k in zip(q_lens, kv_lens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    pages = sum(-(-k // PAGE) for k in kv_lens)
    return {
        "cu_seq_lens_q": torch.tensor(cu_q, dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor(cu_k, dtype=torch.int32),
        "write_index": [torch.arange(cu_q[-1], dtype=torch.long)],
        "read_index": [torch.arange(pages, dtype=torch.long)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--recent", type=int, default=0, help="also time a ring of this many tokens")
    args = ap.parse_args(argv)
    rows = []
    cases = [(first, 0) for first in (0, 16)]
    if args.recent:
        cases += [(first, args.recent) for first in (0, 16)]
    for first, recent in cases:
        layout = BlockLayout(16, PAGE, 8, 64, first_tokens=first, recent_tokens=recent)
        for decoding, chunks in STEPS:
            kw = step_kwargs(decoding, chunks)
            build_plan(kw, layout)  # first call: imports, allocator warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                build_plan(kw, layout)
                times.append(time.perf_counter() - start)
            row = {
                "decoding": decoding,
                "chunks": chunks,
                "first_tokens": first,
                "recent_tokens": recent,
                "median_ms": statistics.median(times) * 1e3,
            }
            rows.append(row)
            print(
                f"{decoding} decoding + {chunks} chunks, first tokens {first}, ring {recent}: "
                f"{row['median_ms']:.3f} ms"
            )
    if args.json is not None:
        import kvquant

        where = str(Path(kvquant.__file__).resolve().parent.relative_to(Path.cwd().resolve()))
        record = {"command": sys.argv, "kvquant": where, "rows": rows}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
