"""Several GPUs: kvquant against transformers' default on a model that needs two GPUs.

A Llama model of a 30B-class shape (``--shape 32b``: Qwen2.5-32B's geometry, 64 layers,
hidden 5120, 40 query / 8 KV heads of 128, 32.8 B parameters, 66 GB in bf16) with random
bf16 weights is written once as a checkpoint (``make``; no download) and loaded over the
GPUs in one of two ways:

* ``device-map``: ``from_pretrained(device_map="auto", max_memory=...)``, one process,
  whole layers per GPU (each layer's pages on its GPU);
* ``tp``: ``from_pretrained(tp_plan="auto")`` under ``torchrun``, one process per GPU,
  every layer's heads split over the GPUs (each rank caches its KV heads).

Each GPU gets a memory budget (``--budget-gb``, through
``torch.cuda.set_per_process_memory_fraction``; the default 48 GiB makes the 66 GB of
weights need two GPUs). Arms: ``default`` (SDPA + bf16 ``DynamicCache``), ``kvquant``
(per-tensor scales calibrated on a random prompt: the max over the ranks under ``tp``),
``kvquant-fp32-group`` (no scales). Per arm: decode ms/step and prefill time of greedy
``generate`` at ``--batch`` x (``--prompt`` + ``--new``) (median of ``--repeats`` calls
after a warm-up), and with ``--capacity`` the largest batch of ``--capacity-prompt``-token
prompts (8 new tokens) that runs in the budget (doubling, then bisection; real runs).
JSON goes to ``--out`` (rank 0 under ``tp``), rewritten after every arm.

Usage (two GPUs; ``$OUT`` is the folder whose files come back)::

    python benchmarks/multi_gpu.py make --dir /tmp/llama32b
    python benchmarks/multi_gpu.py device-map --dir /tmp/llama32b --capacity --out $OUT/device_map.json
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py tp --dir /tmp/llama32b \\
        --capacity --out $OUT/tp.json

``--shape tiny --device cpu`` runs the whole thing on CPU (tests/realmodel).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_generate import environment, one_call

SHAPES: dict[str, dict[str, Any]] = {
    "32b": dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rope_theta=1000000.0,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    ),
}  # fmt: skip
"""Model geometries (``--shape``)."""

ARMS = ("default", "kvquant", "kvquant-fp32-group")
SHARD_BYTES = 4 * 2**30


# ---------------------------------------------------------------------- the checkpoint


def make_checkpoint(folder: Path, shape: str, layers: int | None) -> None:
    """A Llama checkpoint with random bf16 weights (std 0.02, norms 1), in 4 GiB shards."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, dtype="bfloat16")
    if layers is not None:
        cfg.num_hidden_layers = layers
    cfg.bos_token_id = cfg.eos_token_id = None
    cfg.pad_token_id = 0
    with torch.device("meta"):
        names = [(n, p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()]
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    size, count = 0, 0

    def flush() -> None:
        nonlocal shard, size, count
        count += 1
        file = f"model-{count:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, file))
        shard, size = {}, 0

    for name, shp in names:
        if len(shp) == 1:  # RMSNorm weights
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shp, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    cfg.save_pretrained(folder)
    print(f"wrote {len(names)} tensors in {count} shards to {folder}", flush=True)


# ---------------------------------------------------------------------- loading


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def load(args: argparse.Namespace) -> Any:
    """The checkpoint over the GPUs (``device-map`` or ``tp``), or on the CPU."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"dtype": torch.bfloat16}
    if args.mode == "tp":
        if not torch.distributed.is_initialized():  # a stuck collective fails instead of hanging
            backend = "nccl" if args.device == "cuda" else "gloo"
            torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
        if args.device == "cuda":
            torch.cuda.set_device(rank_world()[0])
        kw["tp_plan"] = "auto"
    elif args.device == "cuda":
        gib = f"{args.budget_gb:g}GiB"
        kw["device_map"] = "auto"
        kw["max_memory"] = {i: gib for i in range(torch.cuda.device_count())}
    model = AutoModelForCausalLM.from_pretrained(args.dir, **kw).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def gpus_used(model: Any) -> list[int]:
    return sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})


def set_budget(model: Any, gb: float) -> None:
    for i in gpus_used(model):
        total = torch.cuda.get_device_properties(i).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 2**30 / total), i)


def calibrate(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-tensor scales (amax / 448 of the post-RoPE K/V), the max over the ranks."""
    from transformers import DynamicCache

    params = inspect.signature(type(model.model).forward).parameters
    key = "cache" if "cache" in params else "past_key_values"  # transformers 5.24 / 5.17
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{key: cache})
    amax = torch.stack(
        [torch.stack([la.keys.float().abs().amax(), la.values.float().abs().amax()]) for la in cache.layers]
    )  # fmt: skip
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    scales = {}
    for i, (k, v) in enumerate(amax.cpu() / 448.0):
        scales[f"model.layers.{i}.self_attn.k_scale"] = k.reshape(1)
        scales[f"model.layers.{i}.self_attn.v_scale"] = v.reshape(1)
    return scales


# ---------------------------------------------------------------------- measuring


def patch_arm(
    model: Any, name: str, scales: dict[str, torch.Tensor], args: argparse.Namespace
) -> Any:
    import kvquant

    kw: dict[str, Any] = {"backend": args.backend}
    if args.cuda_graphs:
        kw["cuda_graphs"] = True
    if name == "kvquant":
        return kvquant.patch(model, scales=scales, **kw)
    if name == "kvquant-fp32-group":
        return kvquant.patch(model, **kw)
    return None


def prompts(model: Any, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)  # the same ids on every rank
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=gen).to(device)
    return ids, torch.ones_like(ids)


def speed(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    ids, mask = prompts(model, args.batch, args.prompt, 1)
    one_call(model, ids, mask, args.new, {})  # warm-up
    calls = [one_call(model, ids, mask, args.new, {}) for _ in range(args.repeats)]
    steps = [s for c in calls for s in c["step_ms"]]
    return {
        "step_ms_median": statistics.median(steps),
        "step_ms_mean": statistics.fmean(steps),
        "prefill_s": statistics.median(c["prefill_s"] for c in calls),
        "peak_bytes": calls[-1]["peak_bytes"],
        "tokens": calls[-1]["tokens"].tolist(),
    }


def fits(model: Any, batch: int, args: argparse.Namespace) -> tuple[bool, str]:
    ids, mask = prompts(model, batch, args.capacity_prompt, batch)
    try:
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                do_sample=False,
            )  # fmt: skip
        ok, why = True, "ok"
    except Exception as err:  # out of memory, or kvquant's CacheCapacityError
        ok, why = False, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    del ids, mask
    torch.cuda.empty_cache()
    if torch.distributed.is_initialized():  # every rank must agree (the next try is shared)
        flag = torch.tensor([1 if ok else 0], device=model.get_input_embeddings().weight.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok, why


def capacity(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    tries, lo, hi, batch = [], 0, None, args.capacity_start
    while True:
        ok, why = fits(model, batch, args)
        tries.append({"batch": batch, "ok": ok, "why": why})
        lo, hi = (batch, hi) if ok else (lo, batch)
        if hi is None:
            batch *= 2
        elif hi - lo <= max(1, lo // 16):
            break
        else:
            batch = (lo + hi) // 2
    return {"max_batch": lo, "prompt": args.capacity_prompt, "new": 8, "tries": tries}


def run_arm(
    model: Any, name: str, scales: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, Any]:
    handle = patch_arm(model, name, scales, args)
    row: dict[str, Any] = {"status": "ok"}
    try:
        row.update(speed(model, args))
        if args.capacity and args.device == "cuda":
            row["capacity"] = capacity(model, args)
        runner = None if handle is None else handle.state.graph_runner
        if runner is not None:
            row["graph_stats"] = dict(vars(runner.stats))
    except Exception as err:  # a benchmark records a failed arm and goes on
        row = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        traceback.print_exc()
    finally:
        if handle is not None:
            handle.remove()
    return row


# ---------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["make", "device-map", "tp"])
    ap.add_argument("--dir", required=True, help="the checkpoint folder (make writes it)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (make)")
    ap.add_argument("--out", help="JSON output path (device-map, tp)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--budget-gb", type=float, default=48.0, help="memory budget per GPU")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--capacity-prompt", type=int, default=8192)
    ap.add_argument("--capacity-start", type=int, default=8)
    ap.add_argument("--cuda-graphs", action="store_true", help="kvquant arms: cuda_graphs=True")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.mode == "make":
        make_checkpoint(Path(args.dir), args.shape, args.layers)
        return 0
    model = load(args)
    rank, world = rank_world()
    if args.device == "cuda":
        set_budget(model, args.budget_gb)
    device = model.get_input_embeddings().weight.device
    scales = calibrate(model, prompts(model, 1, 256, 0)[0])
    result: dict[str, Any] = {
        "mode": args.mode, "world_size": world, "gpus": gpus_used(model),
        "env": environment(device), "args": {k: v for k, v in vars(args).items() if k != "out"},
        "arms": {},
    }  # fmt: skip
    for name in args.arms.split(","):
        result["arms"][name] = row = run_arm(model, name, scales, args)
        if rank == 0:
            print(f"{args.mode} {name}: {json.dumps({k: v for k, v in row.items() if k != 'tokens'})[:400]}", flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
