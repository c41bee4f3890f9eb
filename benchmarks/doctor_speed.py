"""How fast is ``kvquant doctor`` on a big checkpoint, compared with loading its weights?

Builds a synthetic sharded checkpoint (random bf16 weights in several
safetensors shards, plus compressed-tensors KV scales and config) of at least
``--size-gb`` GB in a temporary folder, then times

* ``kvquant.inspect_checkpoint(path)``: config + every shard header + only the
  KV-scale tensors, then the registry's analysis;
* ``safetensors.torch.load_file`` of every shard (lazily mmap-backed, so cheap),
  and ``load_file`` plus a copy of every tensor: what loading the weights into
  a model costs at least.

Both run with the shards in the OS page cache (they were just written), so the
numbers compare the work done, not the disk. Prints a table and writes JSON to
``--out``. The checkpoint is deleted at the end.

Usage::

    python benchmarks/doctor_speed.py --size-gb 2 --shards 4 --out doctor_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm


def build_checkpoint(root: Path, size_gb: float, shards: int, seed: int = 0) -> dict[str, Any]:
    """Write a Llama-shaped sharded bf16 checkpoint of about ``size_gb`` GB with KV scales.

    Args:
        root: an empty folder.
        size_gb: target size of the weights in GB (10^9 bytes).
        shards: number of safetensors files.
        seed: random seed.

    Returns:
        Facts about the checkpoint (bytes, tensors, layers, shards).
    """
    hidden, heads, kv_heads, head_dim, inter = 2048, 16, 4, 128, 8192
    # per layer: q, o [hidden, hidden]; k, v [kv*hd, hidden]; gate, up [inter, hidden]; down [hidden, inter]
    per_layer = (2 * hidden * hidden + 2 * kv_heads * head_dim * hidden + 3 * inter * hidden) * 2
    layers = max(shards, int(size_gb * 1e9 // per_layer) + 1)
    gen = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": 32000,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "config_groups": {},
            "kv_cache_scheme": {
                "num_bits": 8,
                "type": "float",
                "strategy": "tensor",
                "dynamic": False,
                "symmetric": True,
            },
        },
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    weight_map: dict[str, str] = {}
    total = 0
    bounds = [round(i * layers / shards) for i in range(shards + 1)]
    for s in tqdm(range(shards), desc="writing shards", unit="shard"):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part: dict[str, torch.Tensor] = {}
        for layer in range(bounds[s], bounds[s + 1]):
            base = f"model.layers.{layer}"
            for name, shape in shapes.items():
                part[f"{base}.{name}"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
            part[f"{base}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            part[f"{base}.self_attn.k_scale"] = torch.tensor([0.02 + 0.001 * layer]).to(
                torch.bfloat16
            )
            part[f"{base}.self_attn.v_scale"] = torch.tensor([0.01 + 0.001 * layer]).to(
                torch.bfloat16
            )
        save_file(part, str(root / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del part
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return {"bytes": total, "tensors": len(weight_map), "layers": layers, "shards": shards}


def _time(fn: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="weights size (default 2 GB)")
    parser.add_argument("--shards", type=int, default=4, help="safetensors shards (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each (default 3)")
    parser.add_argument("--out", type=Path, default=Path("doctor_speed.json"), help="JSON output")
    parser.add_argument("--tmp", type=Path, default=None, help="parent folder of the checkpoint")
    args = parser.parse_args(argv)

    import kvquant.report as report_mod

    root = Path(tempfile.mkdtemp(prefix="kvquant-doctor-speed-", dir=args.tmp))
    try:
        facts = build_checkpoint(root, args.size_gb, args.shards)
        shard_files = sorted(root.glob("*.safetensors"))
        report = report_mod.inspect_checkpoint(root)  # warm-up (imports), also checks the result
        inspect_times = _time(lambda: report_mod.inspect_checkpoint(root), args.repeats)

        def load_all() -> int:
            n = 0
            for f in shard_files:
                n += len(load_file(str(f)))
            return n

        def load_and_copy_all() -> int:
            # what loading weights into a model costs at least: every byte read and copied
            n = 0
            for f in shard_files:
                for t in load_file(str(f)).values():
                    n += t.clone().numel()
            return n

        load_and_copy_all()  # warm-up: make sure every shard is in the page cache
        load_times = _time(load_all, args.repeats)
        copy_times = _time(load_and_copy_all, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    t_inspect = statistics.median(inspect_times)
    t_load = statistics.median(load_times)
    t_copy = statistics.median(copy_times)
    result = {
        "checkpoint": facts,
        "inspect_checkpoint_s": inspect_times,
        "load_file_all_shards_s": load_times,
        "load_file_and_copy_all_shards_s": copy_times,
        "median_inspect_s": t_inspect,
        "median_load_file_s": t_load,
        "median_load_file_and_copy_s": t_copy,
        "speedup_vs_load_and_copy": t_copy / t_inspect,
        "report_ok": report.ok,
        "report_layers": len({r.layer for r in report.rows}),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": __import__("os").cpu_count(),
            "platform": platform.platform(),
        },
        "note": "shards in the OS page cache for every measurement (written just before); "
        "load_file alone only maps the files (lazy), the copy variant touches every byte",
    }
    gb = facts["bytes"] / 1e9
    print(
        f"checkpoint: {gb:.2f} GB, {facts['shards']} shards, {facts['tensors']} tensors, "
        f"{facts['layers']} layers"
    )
    rows = [
        ("kvquant.inspect_checkpoint (headers + scales)", t_inspect, inspect_times),
        ("safetensors load_file, every shard (mmap)", t_load, load_times),
        ("load_file + copy every tensor (a real load)", t_copy, copy_times),
    ]
    print(f"{'what':<48} {'median s':>10} {'runs':>5}")
    for what, median, runs in rows:
        print(f"{what:<48} {median:>10.4f} {len(runs):>5}")
    print(
        f"inspect_checkpoint takes {t_inspect / t_copy:.2%} of the time of reading the weights "
        f"({t_copy / t_inspect:.0f}x faster); lazy mmap load_file alone: {t_load:.4f} s"
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
