"""Where the memory of a chunked-prefill ``generate`` goes: default vs kvquant, layer by layer.

Builds the model of ``e2e_generate.py`` (Llama-3.2-1B shapes, random bf16
weights) and runs ``generate(prefill_chunk_size=C)`` on ``B`` prompts of ``L``
tokens, for transformers' default and for ``kvquant.patch(model, scales=...)``.
Forward hooks on the decoder layers record, for every forward call and layer,
the allocated bytes after the layer and the peak since the previous record;
the script prints, per call, the allocated memory after the last layer and the
largest peak, and writes every record to JSON.

Usage (H200)::

    python benchmarks/memory_probe.py --batch 40 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_generate import build_model, calibrate_per_tensor, free_memory


def probe(model: Any, ids: torch.Tensor, chunk: int, new: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    calls = [0]

    def after(module: torch.nn.Module, args: Any, out: Any) -> None:
        records.append(
            {
                "call": calls[0],
                "layer": module.layer_idx_for_probe,
                "allocated": torch.cuda.memory_allocated(),
                "peak": torch.cuda.max_memory_allocated(),
            }
        )
        torch.cuda.reset_peak_memory_stats()

    def count(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        calls[0] += 1

    handles = [model.model.register_forward_pre_hook(count, with_kwargs=True)]
    for i, layer in enumerate(model.model.layers):
        layer.layer_idx_for_probe = i
        handles.append(layer.register_forward_hook(after))
    free_memory(ids.device)
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                prefill_chunk_size=chunk,
            )
    finally:
        for h in handles:
            h.remove()
    return records


def main() -> int:
    import kvquant

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = build_model(False, torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    scales = calibrate_per_tensor(model, torch.randint(1, vocab, (1, 256), generator=gen).cuda())
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=gen).cuda()
    weights = torch.cuda.memory_allocated()
    result: dict[str, Any] = {"args": vars(args), "weights_bytes": weights}
    for arm in ("default", "kvquant"):
        handle = kvquant.patch(model, scales=scales) if arm == "kvquant" else None
        recs = probe(model, ids, args.chunk, args.new)
        if handle is not None:
            handle.remove()
        result[arm] = recs
        print(f"{arm}: call  allocated-after-last-layer GB  largest-peak GB (layer)")
        for call in sorted({r["call"] for r in recs}):
            rows = [r for r in recs if r["call"] == call]
            top = max(rows, key=lambda r: r["peak"])
            print(
                f"  {call:3d}  {rows[-1]['allocated'] / 1e9:8.2f}  "
                f"{top['peak'] / 1e9:8.2f} ({top['layer']})"
            )
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
