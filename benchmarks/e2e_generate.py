"""End-to-end ``generate`` benchmark: kvquant's FP8 paged cache vs transformers' own caches.

A Llama-architecture model of about 1.2 B parameters (Llama-3.2-1B shapes:
16 layers, hidden 2048, 32 query / 8 KV heads, head_dim 64) is built from a
config with random bf16 weights; batch 16, 8192-token random prompts, 256 new
tokens (greedy, ``min_new_tokens`` forces all of them). Arms, measured in the
same run:

* ``sdpa``: transformers' default (SDPA attention + ``DynamicCache``, bf16 K/V);
* ``quantized-fp8``: ``QuantizedCache(backend="fp8")`` when the installed
  transformers has it (5.24: one per-tensor scale frozen at prefill, the whole
  cache dequantized at every step), else recorded as ``"unavailable"``;
* ``kvquant``: the model patched with ``kvquant.patch(..., cuda_graphs=True)``
  (the kvquant arms are the only ones that import kvquant's HF integration),
  per-tensor scales calibrated on a short random prompt (random weights have
  no checkpoint scales); decode steps replay a CUDA graph on a GPU;
* ``kvquant-fp32-group``: the same with dynamic ``fp32-group`` scales;
* ``kvquant-eager``: per-tensor scales, ``cuda_graphs=False`` (every decode
  step runs the eager forward).

Per arm, from one timed ``generate`` with a timestamp after every step: prefill
time (start to first token), decode tokens/s (``batch * (new_tokens - 1)`` over
first-to-last token), KV-cache bytes after
prefill (measured: every tensor the cache object holds, scales included; for
kvquant that is the page pool allocated for prompt + new tokens) and per token
(analytic; ``kv_bytes_at_prompt_analytic`` = per token x batch x prompt), peak GPU memory, greedy-token
agreement with ``sdpa``, and the longest context per sequence that fits a
memory budget. The longest context is an **estimate from KV bytes per token**
(not a run): ``budget / (batch * kv_bytes_per_token)``, for two budgets: the KV
bytes the bf16 ``DynamicCache`` needs at the prompt length, and the GPU memory
free after loading the weights minus the largest non-KV peak seen (activations),
minus 5 %.

Usage (H200)::

    python benchmarks/e2e_generate.py --out e2e.json
    python benchmarks/e2e_generate.py --tiny --out /tmp/e2e_tiny.json   # CPU smoke test

Works on transformers 5.17 (``past_key_values=``) and 5.24 (``cache=``): the
cache keyword is chosen by a feature test.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # run as a script from a checkout: make the repository's kvquant importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("sdpa", "quantized-fp8", "kvquant", "kvquant-fp32-group", "kvquant-eager")
KVQUANT_ARMS = {  # arm: (scale format, cuda_graphs)
    "kvquant": ("per-tensor", True),
    "kvquant-fp32-group": ("fp32-group", True),
    "kvquant-eager": ("per-tensor", False),
}


# ---------------------------------------------------------------------- model


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """A Llama model from a config, random weights (Llama-3.2-1B shapes, or tiny)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=16384,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        )
    cfg.bos_token_id = None
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def cache_kwarg(model: Any) -> str:
    """``"cache"`` (transformers >= 5.2x) or ``"past_key_values"`` (5.17), by feature test."""
    params = inspect.signature(type(model.model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# ---------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(cache: Any) -> int:
    """KV bytes a cache object holds.

    A cache with ``memory_bytes()`` (kvquant's: FP8 pages plus scales) reports
    its own; for any other cache, the bytes of every tensor its layers hold
    (deduplicated by storage).
    """
    if callable(getattr(cache, "memory_bytes", None)):
        return int(cache.memory_bytes()["total"])
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta" or obj.numel() == 0:
                return
            key = (obj.untyped_storage().data_ptr(), obj.device.index or 0)
            if key in seen:
                return
            seen.add(key)
            total += obj.untyped_storage().nbytes()
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                add(item)

    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            add(value)
    return total


def kv_bytes_per_token(arm: str, cfg: Any, *, group_size: int, model_dtype: torch.dtype) -> float:
    """Analytic KV bytes per token (all layers, K and V, scales included)."""
    layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arm == "sdpa":
        return 2 * layers * hkv * d * float(model_dtype.itemsize)
    if arm == "quantized-fp8":
        return 2 * layers * hkv * d * 1.0  # + one fp32 scale per layer and tensor (negligible)
    per = 2 * layers * hkv * d * 1.0
    if KVQUANT_ARMS[arm][0] == "fp32-group":
        per += 2 * layers * hkv * (d // group_size) * 4.0
    return per


class StepClock:
    """A stopping criterion that never stops and records a timestamp after every step.

    ``generate`` calls it once per new token (after the token is chosen), so
    ``stamps[0] - start`` is the prefill (plus the first token) and
    ``stamps[-1] - stamps[0]`` the decode of the remaining ``new_tokens - 1``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0.0
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_generate(
    model: Any, ids: torch.Tensor, new_tokens: int, extra: dict[str, Any]
) -> tuple[Any, StepClock]:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens, with per-step timestamps."""
    from transformers import StoppingCriteriaList

    clock = StepClock(ids.device)
    sync(ids.device)
    clock.start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        stopping_criteria=StoppingCriteriaList([clock]),
        **extra,
    )
    sync(ids.device)
    return out, clock


def output_cache(out: Any) -> Any:
    """The cache a ``generate`` output carries (``cache`` on newer transformers)."""
    names = getattr(type(out), "__dataclass_fields__", {}) or {}
    if "cache" in names:
        return out.cache
    return out.past_key_values


def measure_arm(
    model: Any,
    ids: torch.Tensor,
    new_tokens: int,
    make_extra: Any,
    warmup_ids: torch.Tensor,
) -> dict[str, Any]:
    """Warm up (short prompt, then the real prompt with 2 tokens), then time one full generation."""
    device = ids.device
    run_generate(model, warmup_ids, 4, make_extra())
    out, _ = run_generate(model, ids, 2, make_extra())
    kv_prompt = cache_bytes(output_cache(out))
    del out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out, clock = run_generate(model, ids, new_tokens, make_extra())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    tokens = out.sequences[:, ids.shape[1] :].cpu()
    kv_final = cache_bytes(output_cache(out))
    del out
    if len(clock.stamps) != new_tokens:
        raise RuntimeError(
            f"the step clock saw {len(clock.stamps)} steps for {new_tokens} new tokens; "
            "expected one call per token"
        )
    prefill_s = clock.stamps[0] - clock.start
    decode_s = max(clock.stamps[-1] - clock.stamps[0], 1e-9)
    batch = ids.shape[0]
    return {
        "status": "ok",
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": clock.stamps[-1] - clock.start,
        "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
        "decode_ms_per_step": 1000.0 * decode_s / (new_tokens - 1),
        "kv_bytes_after_prefill_measured": kv_prompt,
        "kv_bytes_after_generate_measured": kv_final,
        "peak_memory_bytes": peak,
        "_tokens": tokens,
    }


# ---------------------------------------------------------------------- arms


def arm_sdpa(model: Any) -> Any:
    return dict


def arm_quantized_fp8(model: Any) -> Any:
    """A factory of ``QuantizedCache(backend="fp8")`` kwargs, or raise if unavailable."""
    from transformers.cache_utils import QuantizedCache

    QuantizedCache(backend="fp8", config=model.config)  # feature test: 5.17 raises
    key = cache_kwarg(model)
    return lambda: {key: QuantizedCache(backend="fp8", config=model.config)}


def arm_kvquant(
    model: Any,
    *,
    backend: str,
    kvquant_format: str,
    cuda_graphs: bool,
    group_size: int,
    max_cache_tokens: int,
    calib_ids: torch.Tensor,
) -> tuple[Any, Any]:
    """Patch the model with kvquant; return (kwargs factory, handle)."""
    import kvquant

    if kvquant_format == "fp32-group":
        handle = kvquant.patch(
            model,
            scales={},
            scale_format="fp32-group",
            group_size=group_size,
            backend=backend,
            cuda_graphs=cuda_graphs,
        )
    else:
        scales = calibrate_per_tensor(model, calib_ids)
        handle = kvquant.patch(model, scales=scales, backend=backend, cuda_graphs=cuda_graphs)
    key = cache_kwarg(model)
    return (lambda: {key: handle.new_cache(max_cache_tokens=max_cache_tokens)}), handle


def calibrate_per_tensor(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt-named per-tensor scales (amax / 448 of post-RoPE K/V) from a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): cache})
    out = {}
    for i, layer in enumerate(cache.layers):
        base = f"model.layers.{i}.self_attn"
        out[f"{base}.k_proj.k_scale"] = (layer.keys.float().abs().amax() / 448.0).cpu()
        out[f"{base}.v_proj.v_scale"] = (layer.values.float().abs().amax() / 448.0).cpu()
    return out


# ---------------------------------------------------------------------- main


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU-sized run")
    parser.add_argument("--batch", type=int, default=None, help="default 16 (tiny: 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 8192 (tiny: 48)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 6)")
    parser.add_argument("--device", default=None, help="default cuda if available, else cpu")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {ARMS}")
    parser.add_argument("--backend", default="auto", help="kvquant kernel backend")
    parser.add_argument(
        "--group-size", type=int, default=None, help="fp32-group G (default 64 capped at head_dim)"
    )
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if (args.tiny and device.type == "cpu") else torch.bfloat16
    batch = args.batch or (2 if args.tiny else 16)
    prompt_len = args.prompt_len or (48 if args.tiny else 8192)
    new_tokens = args.new_tokens or (6 if args.tiny else 256)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; expected a subset of {ARMS}")
    if new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode speed needs more than the prefill token)")

    model = build_model(args.tiny, device, dtype)
    cfg = model.config
    if args.group_size is None:
        args.group_size = min(64, cfg.head_dim)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    warmup_ids = ids[:, : min(prompt_len, 128)]
    calib_ids = torch.randint(1, cfg.vocab_size, (1, min(prompt_len, 512)), generator=gen).to(
        device
    )
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free_after_weights = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    result: dict[str, Any] = {
        "environment": environment(device),
        "config": {
            "model": "Llama (random weights)" + (" tiny" if args.tiny else ", Llama-3.2-1B shapes"),
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(dtype),
            "num_layers": cfg.num_hidden_layers,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "batch": batch,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "kvquant_arms": {
                a: {"format": f, "cuda_graphs": g} for a, (f, g) in KVQUANT_ARMS.items()
            },
            "group_size": args.group_size,
            "page_size": args.page_size,
            "backend": args.backend,
            "cache_kwarg": cache_kwarg(model),
            "weights_bytes": weights_bytes,
            "free_memory_after_weights_bytes": free_after_weights,
        },
        "arms": {},
    }
    reference_tokens = None
    for arm in ARMS:
        if arm not in arms:
            continue
        print(f"[e2e] {arm} ...", file=sys.stderr, flush=True)
        handle = None
        try:
            if arm == "sdpa":
                make_extra = arm_sdpa(model)
            elif arm == "quantized-fp8":
                try:
                    make_extra = arm_quantized_fp8(model)
                except (ImportError, ValueError, TypeError) as exc:
                    result["arms"][arm] = {"status": "unavailable", "reason": f"{exc}"}
                    continue
            else:
                try:
                    import kvquant.integrations.hf  # noqa: F401
                except ImportError as exc:
                    result["arms"][arm] = {"status": "unavailable", "reason": f"{exc}"}
                    continue
                slots = batch * (prompt_len + new_tokens + 2 * args.page_size)
                make_extra, handle = arm_kvquant(
                    model,
                    backend=args.backend,
                    kvquant_format=KVQUANT_ARMS[arm][0],
                    cuda_graphs=KVQUANT_ARMS[arm][1],
                    group_size=args.group_size,
                    max_cache_tokens=slots,
                    calib_ids=calib_ids,
                )
            row = measure_arm(model, ids, new_tokens, make_extra, warmup_ids)
            runner = None if handle is None else handle.state.graph_runner
            if runner is not None:  # all generate calls of the arm, warm-ups included
                row["graph_stats"] = dict(vars(runner.stats))
        except Exception as exc:  # record and go on: one failing arm must not lose the others
            result["arms"][arm] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
            continue
        finally:
            if handle is not None:
                handle.remove()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tokens = row.pop("_tokens")
        if reference_tokens is None and arm == "sdpa":
            reference_tokens = tokens
        if reference_tokens is not None:
            row["greedy_token_agreement_vs_sdpa"] = float(
                (tokens == reference_tokens).double().mean()
            )
        per_token = kv_bytes_per_token(arm, cfg, group_size=args.group_size, model_dtype=dtype)
        row["kv_bytes_per_token_analytic"] = per_token
        row["kv_bytes_at_prompt_analytic"] = per_token * batch * prompt_len
        result["arms"][arm] = row

    # longest context per sequence that fits a memory budget: estimate from bytes per token
    arms_ok = {a: r for a, r in result["arms"].items() if r.get("status") == "ok"}
    bf16_per_token = kv_bytes_per_token("sdpa", cfg, group_size=args.group_size, model_dtype=dtype)
    budget_same_as_bf16 = bf16_per_token * batch * prompt_len
    budgets = {"kv_bytes_of_model_dtype_cache_at_prompt_len": budget_same_as_bf16}
    if free_after_weights is not None and arms_ok:
        activation = max(
            (r["peak_memory_bytes"] or 0) - weights_bytes - r["kv_bytes_after_generate_measured"]
            for r in arms_ok.values()
        )
        budgets["free_gpu_memory_after_weights_minus_activations"] = 0.95 * (
            free_after_weights - max(activation, 0)
        )
    result["longest_context"] = {
        "method": "estimate: budget / (batch * analytic KV bytes per token); not a run",
        "budgets_bytes": budgets,
        "tokens_per_sequence": {
            arm: {
                name: int(b // (batch * row["kv_bytes_per_token_analytic"]))
                for name, b in budgets.items()
            }
            for arm, row in arms_ok.items()
        },
    }
    if "sdpa" in arms_ok:
        base = arms_ok["sdpa"]
        result["ratios_vs_sdpa"] = {
            arm: {
                "decode_tokens_per_s": r["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                "prefill_s": r["prefill_s"] / base["prefill_s"],
                "kv_bytes_after_prefill_measured": r["kv_bytes_after_prefill_measured"]
                / max(base["kv_bytes_after_prefill_measured"], 1),
                "kv_bytes_per_token_analytic": r["kv_bytes_per_token_analytic"]
                / base["kv_bytes_per_token_analytic"],
            }
            for arm, r in arms_ok.items()
        }
    if "quantized-fp8" in arms_ok:
        qc = arms_ok["quantized-fp8"]["decode_tokens_per_s"]
        result["decode_speed_vs_quantized_fp8"] = {
            arm: r["decode_tokens_per_s"] / qc for arm, r in arms_ok.items()
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        arm: {
            k: r.get(k)
            for k in (
                "status",
                "prefill_s",
                "decode_tokens_per_s",
                "kv_bytes_after_prefill_measured",
            )
        }
        for arm, r in result["arms"].items()
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
