"""End-to-end ``generate`` benchmark: kvquant as users call it, against transformers' own paths.

A Llama model with Llama-3.2-1B shapes (16 layers, hidden 2048, 32 query / 8 KV
heads, head_dim 64) is built from a config with random bf16 weights. Every
arm is measured the way users meet it: greedy ``generate`` of exactly
``new`` tokens (``min_new_tokens``), one identical warm-up call first (a first
call of a new size is dominated by the allocator growing), then ``--repeats``
timed calls. Per call: wall time of the whole call (everything ``generate``
does, CUDA-graph capture included), prefill (start to first token), every
decode step (a timestamp after each step, the device synchronised), and peak
memory (``torch.cuda.max_memory_allocated``, reset before the call). The
first call's wall time is kept too (``first_call_s``: capture and compile
included). Arms run one after the other in one process, so a compiling arm
after another one finds torch.compile's imports done and may find kernels in
inductor's caches: for the first-call comparison run each compiling arm alone
in a fresh process with fresh compile caches (``benchmarks/e2e_round.sh first``).

Every arm runs with its defaults except where named: no ``gc.collect()`` and no
``torch.cuda.empty_cache()`` between the calls of an arm (``second_call_peak_bytes`` is the
peak of the first timed call right after the warm-up; ``allocated_*_calls_bytes`` what each
call found and left), and ``left_after_remove_bytes`` is what stayed allocated after
``handle.remove()``, also without collection. Between arms the process collects.

Arms:

* ``default``: transformers' default (SDPA attention + bf16 ``DynamicCache``);
* ``static``: ``cache_implementation="static"`` (generate compiles the decode
  step with ``torch.compile`` on CUDA; its first call pays the compile);
* ``kvquant``: ``kvquant.patch(model, scales=per_tensor)``, every other
  argument default (random weights have no checkpoint scales: per-tensor
  scales are calibrated on a short random prompt, as a checkpoint would ship);
  on CUDA its decode graph captures ``torch.compile``'d decoder layers
  (``compile_step=None``), so its first call pays that compile;
* ``kvquant-nocompile``: the same with ``compile_step=False`` (the graph
  captures the eager layers), beside the default to show what the fused
  kernels gain and what their compile costs;
* ``kvquant-fp32-group``: ``kvquant.patch(model)``, nothing else: without
  scales the default is the dynamic ``fp32-group`` format;
* ``kvquant-eager``: per-tensor scales, ``cuda_graphs=False``;
* ``kvquant-nvfp4`` and ``kvquant-mxfp4`` (opt-in, ``--arms`` / ``--capacity-arms``):
  ``kvquant.patch(model, kv_format="nvfp4")`` (or ``"mxfp4"``): 4-bit pages, block scales
  computed as tokens are written, nothing else; ``kvquant-nvfp4-rotk`` (opt-in) the same
  with ``k_rotation="hadamard"`` (rotated 4-bit keys), ``kvquant-nvfp4-recent0`` (opt-in)
  with ``recent_tokens=0`` (no ring of each sequence's 16 newest tokens at full precision,
  which every other kvquant arm keeps by default);
* ``kvquant-g32``, ``kvquant-rotk32`` and ``kvquant-rotk64`` (opt-in, ``--arms`` /
  ``--capacity-arms``): the ``kvquant-fp32-group`` arm (no scales) with ``group_size=32``,
  with ``group_size=32, k_rotation="hadamard"`` (Hadamard-rotated keys) and with
  ``k_rotation="hadamard"`` alone (G=64): the decode cost of smaller groups and of the
  rotation against today's default (docs/dev/accuracy-history.md); ``kvquant-recent0``
  (opt-in) the same arm with ``recent_tokens=0`` (what the ring costs);
* ``kvquant-rowgroups`` (opt-in, ``--arms`` / ``--capacity-arms``): the
  ``kvquant`` arm with a fixed ``prefill_tokens=16384`` in place of the default
  ``"auto"`` (which chooses the bound per call from the free memory).

Shapes (``--shapes``): ``b16x8k`` (16 x 8192 prompt + 64 new), ``chat``
(1 x 512 + 256), ``b64x2k`` (64 x 2048 + 64), and two sweeps for the plots:
``batch`` (decode tokens/s at 2048 + 32 for batch 1 ... 64, default vs kvquant) and
``context`` (peak memory at batch 16 for prompts of 1k ... 16k, default vs kvquant).

``--capacity``: the largest batch of 8192-token prompts (8 new tokens) that
``generate`` serves in a memory budget (``torch.cuda.set_per_process_memory_fraction``),
with and without ``prefill_chunk_size=2048``, for the default, kvquant (per-tensor
scales) and kvquant-fp32-group (no scales) arms, all with default arguments
(``--capacity-arms``): a real run per tried batch (doubling, then bisection), never an
estimate. After every try the memory still allocated is recorded without any collection
(it must return to the weights alone); only a leftover is collected, and marked.

Usage (H200; one process per shape keeps the allocators apart)::

    python benchmarks/e2e_generate.py --shapes b16x8k --out b16x8k.json
    python benchmarks/e2e_generate.py --capacity --budget-gb 24 --out capacity.json
    python benchmarks/e2e_generate.py --tiny --out /tmp/e2e_tiny.json   # CPU smoke run
    python benchmarks/e2e_generate.py --shapes b16x8k --repeats 3 --out rotk.json \
        --arms kvquant-fp32-group,kvquant-g32,kvquant-rotk32,kvquant-rotk64

``benchmarks/plot_e2e.py`` draws the docs' plots from the JSON files.
Works on transformers 5.17 and 5.24 (it passes no cache object).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # run as a script from a checkout: make the repository's kvquant importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("default", "static", "kvquant", "kvquant-nocompile", "kvquant-fp32-group", "kvquant-eager")
SHAPES: dict[str, dict[str, Any]] = {
    "b16x8k": {"batch": 16, "prompt": 8192, "new": 64, "arms": ARMS},
    "chat": {"batch": 1, "prompt": 512, "new": 256, "arms": ARMS},
    "b64x2k": {"batch": 64, "prompt": 2048, "new": 64, "arms": ARMS},
}
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"batch": 2, "prompt": 40, "new": 6, "arms": ("default", "kvquant", "kvquant-eager")},
}
SWEEP_BATCHES = (1, 4, 16, 32, 64)
SWEEP_CONTEXTS = (1024, 2048, 4096, 8192, 16384)
SWEEP_ARMS = ("default", "kvquant")
CAPACITY_ARMS = (
    "default",
    "kvquant",
    "kvquant-fp32-group",
    "kvquant-rowgroups",
    "kvquant-nvfp4",
    "kvquant-mxfp4",
    "kvquant-nvfp4-rotk",
    "kvquant-nvfp4-recent0",
    "kvquant-g32",
    "kvquant-rotk32",
    "kvquant-rotk64",
    "kvquant-recent0",
)
DEFAULT_CAPACITY_ARMS = ("default", "kvquant", "kvquant-fp32-group")
GROUP_ARMS: dict[str, dict[str, Any]] = {
    "kvquant-g32": {"group_size": 32},
    "kvquant-rotk32": {"group_size": 32, "k_rotation": "hadamard"},
    "kvquant-rotk64": {"k_rotation": "hadamard"},
    "kvquant-recent0": {"recent_tokens": 0},
}
"""The fp32-group arms beside ``kvquant-fp32-group`` (no scales): their patch options."""
FP4_ARMS: dict[str, dict[str, Any]] = {
    "kvquant-nvfp4": {"kv_format": "nvfp4"},
    "kvquant-mxfp4": {"kv_format": "mxfp4"},
    "kvquant-nvfp4-rotk": {"kv_format": "nvfp4", "k_rotation": "hadamard"},
    "kvquant-nvfp4-recent0": {"kv_format": "nvfp4", "recent_tokens": 0},
}
"""The 4-bit arms (no scales): their patch options."""
OPT_IN_ARMS = ("kvquant-rowgroups", *FP4_ARMS, *GROUP_ARMS)
"""Arms a shape runs only when ``--arms`` names them."""
ROWGROUP_TOKENS = 16384
"""``prefill_tokens`` of the ``kvquant-rowgroups`` arm."""


# ---------------------------------------------------------------------- model


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """A Llama model from a config, random weights (Llama-3.2-1B shapes, or tiny)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = (
        {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 1024,
        }
        if tiny
        else {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "rope_theta": 500000.0,
        }
    )
    cfg = LlamaConfig(**shape, tie_word_embeddings=True)
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


def calibrate_per_tensor(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt-named per-tensor scales (amax / 448 of post-RoPE K/V) of one forward."""
    from transformers import DynamicCache

    params = inspect.signature(type(model.model).forward).parameters
    key = "cache" if "cache" in params else "past_key_values"  # transformers 5.24 / 5.17
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{key: cache})
    scales = {}
    for i, layer in enumerate(cache.layers):
        base = f"model.layers.{i}.self_attn"
        scales[f"{base}.k_proj.k_scale"] = (layer.keys.float().abs().amax() / 448.0).cpu()
        scales[f"{base}.v_proj.v_scale"] = (layer.values.float().abs().amax() / 448.0).cpu()
    return scales


# ---------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Between arms only (never between the calls of one arm): collect and release the cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class StepClock:
    """A stopping criterion that never stops and records a timestamp after every step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0.0
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def one_call(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int, gen_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """One timed greedy ``generate`` of exactly ``new`` tokens."""
    from transformers import StoppingCriteriaList

    device = ids.device
    # No collection and no cache release before the call: a user's repeated calls meet
    # whatever the previous call left (a reference cycle would show here).
    before = allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = StepClock(device)
    sync(device)
    clock.start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            **gen_kwargs,
        )
    sync(device)
    end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if len(clock.stamps) != new:
        raise RuntimeError(f"the step clock saw {len(clock.stamps)} steps for {new} new tokens")
    steps = [1000.0 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
    tokens = out[:, ids.shape[1] :].cpu()
    del out
    return {
        "wall_s": end - clock.start,
        "prefill_s": clock.stamps[0] - clock.start,
        "step_ms": steps,
        "peak_bytes": peak,
        "allocated_before_bytes": before,
        "allocated_after_bytes": allocated(device),
        "tokens": tokens,
    }


def _compile_times() -> dict[str, float]:
    """torch.compile's timed phases so far in this process, seconds each (summed)."""
    from torch._dynamo.utils import compile_times

    got = compile_times(repr="csv", aggregate=True)
    if not isinstance(got, tuple):
        return {}
    return {k: round(float(v), 3) for k, v in zip(*got, strict=True)}


def _dynamo_counts() -> dict[str, int]:
    """dynamo's graphs compiled and graph breaks met so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": sum(int(n) for n in counters["graph_break"].values()),
    }


def measure(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new: int,
    gen_kwargs: dict[str, Any],
    repeats: int,
) -> dict[str, Any]:
    """A warm-up call, then ``repeats`` timed calls; summary over the timed ones."""
    first = one_call(model, ids, mask, new, gen_kwargs)
    compile_metrics = _compile_times()
    dynamo_counts = _dynamo_counts()
    calls = [one_call(model, ids, mask, new, gen_kwargs) for _ in range(repeats)]
    steps = [s for c in calls for s in c["step_ms"]]
    batch = ids.shape[0]
    med_step = statistics.median(steps) if steps else float("nan")
    return {
        "status": "ok",
        "first_call_s": first["wall_s"],
        "first_call_peak_bytes": first["peak_bytes"],
        "first_call_prefill_s": first["prefill_s"],
        "first_call_slowest_step_ms": max(first["step_ms"], default=float("nan")),
        # torch.compile's own phases up to the end of the first call, seconds summed over
        # every compile of the process so far (a fresh process per arm: that arm's)
        "first_call_compile_times_s": compile_metrics,
        # dynamo's graphs and graph breaks up to the end of the first call (same scope)
        "first_call_dynamo": dynamo_counts,
        "wall_s": statistics.median(c["wall_s"] for c in calls),
        "wall_s_all": [c["wall_s"] for c in calls],
        "prefill_s": statistics.median(c["prefill_s"] for c in calls),
        "step_ms_median": med_step,
        "step_ms_mean": statistics.fmean(steps) if steps else float("nan"),
        "step_ms_p90": sorted(steps)[int(0.9 * (len(steps) - 1))] if steps else float("nan"),
        "decode_tokens_per_s": 1000.0 * batch / med_step if steps else float("nan"),
        "peak_bytes": max((c["peak_bytes"] or 0) for c in calls) or None,
        # the first timed call right after the warm-up call, nothing collected in between
        "second_call_peak_bytes": calls[0]["peak_bytes"] if calls else None,
        # what each call found allocated, and left allocated, beyond the model (no collection)
        "allocated_before_calls_bytes": [c["allocated_before_bytes"] for c in calls],
        "allocated_after_calls_bytes": [c["allocated_after_bytes"] for c in calls],
        "_tokens": calls[-1]["tokens"],
    }


# ---------------------------------------------------------------------- arms


class _Record(logging.Handler):
    """Keeps the text of every warning kvquant logs while an arm runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _LaunchLog:
    """The decode attention launches kvquant's kernel plans choose while an arm runs.

    Wraps ``kvquant.kernels.attention.launch.attention_launch`` (what a plan calls when it is
    built) and keeps, per geometry of a one-token query, the split count and tile: the split
    count follows the block table's width, which grows with the cache's pools.
    """

    def __init__(self) -> None:
        self.launches: dict[str, dict[str, Any]] = {}
        self._module: Any = None
        self._original: Any = None

    def install(self) -> None:
        from kvquant.kernels.attention import launch as module

        original = module.attention_launch

        def recorded(query: Any, pages: Any, block_tables: Any, *a: Any, **kw: Any) -> Any:
            launch = original(query, pages, block_tables, *a, **kw)
            if query.shape[1] == 1:
                key = f"B{query.shape[0]} table {block_tables.shape[1] * pages.k.shape[1]} keys"
                if kw.get("recent") is not None:
                    key += " recent"
                self.launches[key] = {
                    "num_splits": launch.num_splits,
                    "BLOCK_N": launch.tiles.BLOCK_N,
                    "num_warps": launch.tiles.num_warps,
                }
            return launch

        self._module, self._original = module, original
        module.attention_launch = recorded

    def remove(self) -> None:
        if self._module is not None:
            self._module.attention_launch = self._original
            self._module = None


class Arm:
    """Sets a model up for one arm and undoes it; ``warnings`` holds what kvquant warned,
    ``launches`` the decode attention launches its plans chose (:class:`_LaunchLog`)."""

    def __init__(self, name: str, model: Any, scales: dict[str, torch.Tensor], backend: str):
        self.name, self.model, self.scales, self.backend = name, model, scales, backend
        self.handle: Any = None
        self._record = _Record()
        self.warnings = self._record.messages
        self._launch_log = _LaunchLog()
        self.launches = self._launch_log.launches
        self.device = next(model.parameters()).device
        self.before: int | None = None
        self.left_after_remove: int | None = None

    def __enter__(self) -> dict[str, Any]:
        import kvquant

        logging.getLogger("kvquant").addHandler(self._record)
        self.before = allocated(self.device)
        if self.name == "default":
            return {}
        if self.name == "static":
            return {"cache_implementation": "static"}
        kw: dict[str, Any] = {} if self.backend == "auto" else {"backend": self.backend}
        if self.name == "kvquant":
            self.handle = kvquant.patch(self.model, scales=self.scales, **kw)
        elif self.name == "kvquant-nocompile":
            self.handle = kvquant.patch(self.model, scales=self.scales, compile_step=False, **kw)
        elif self.name == "kvquant-fp32-group":
            self.handle = kvquant.patch(self.model, **kw)
        elif self.name in GROUP_ARMS:
            self.handle = kvquant.patch(self.model, **GROUP_ARMS[self.name], **kw)
        elif self.name == "kvquant-eager":
            self.handle = kvquant.patch(self.model, scales=self.scales, cuda_graphs=False, **kw)
        elif self.name in FP4_ARMS:
            self.handle = kvquant.patch(self.model, **FP4_ARMS[self.name], **kw)
        elif self.name == "kvquant-rowgroups":
            self.handle = kvquant.patch(
                self.model, scales=self.scales, prefill_tokens=ROWGROUP_TOKENS, **kw
            )
        else:
            raise ValueError(f"unknown arm {self.name!r}")
        self._launch_log.install()
        return {}

    def stats(self) -> dict[str, Any] | None:
        runner = None if self.handle is None else self.handle.state.graph_runner
        return None if runner is None else dict(vars(runner.stats))

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("kvquant").removeHandler(self._record)
        self._launch_log.remove()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        now = allocated(self.device)
        if now is not None and self.before is not None:
            # bytes still allocated beyond what the arm found, without any collection
            self.left_after_remove = now - self.before


def run_arm(
    name: str,
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new: int,
    scales: dict[str, torch.Tensor],
    args: argparse.Namespace,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    device = ids.device
    if name == "static" and device.type != "cuda":
        return {"status": "skipped", "reason": "generate compiles static caches on CUDA only"}
    arm = Arm(name, model, scales, args.backend)
    try:
        with arm as gen_kwargs:
            row = measure(model, ids, mask, new, {**gen_kwargs, **(extra or {})}, args.repeats)
            stats = arm.stats()
            if stats is not None:
                row["graph_stats"] = stats
            if arm.warnings:  # e.g. a decode-graph capture that failed and fell back
                row["kvquant_warnings"] = list(arm.warnings)
            if arm.launches:
                row["decode_attention_launches"] = dict(arm.launches)
    except Exception as err:  # a benchmark records a failed arm and goes on
        row = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        traceback.print_exc()
    row["left_after_remove_bytes"] = arm.left_after_remove
    free_memory(device)
    if device.type == "cuda":
        row["allocated_after_bytes"] = torch.cuda.memory_allocated(device)
    return row


def agreement(rows: dict[str, dict[str, Any]]) -> None:
    """Greedy tokens equal to the default arm's, up to the first difference (fraction)."""
    ref = rows.get("default", {}).get("_tokens")
    for row in rows.values():
        toks = row.pop("_tokens", None)
        if ref is None or toks is None:
            continue
        same = (toks == ref).int().cumprod(dim=1)
        row["greedy_prefix_agreement_vs_default"] = float(same.float().mean())


def run_shape(
    model: Any, shape: dict[str, Any], scales: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, Any]:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (shape["batch"], shape["prompt"]), generator=gen).to(device)
    mask = torch.ones_like(ids)
    rows = {}
    known = (*shape["arms"], *OPT_IN_ARMS)
    # --arms: those arms in the order given (alternating orders shows order effects)
    names = [a for a in args.arms if a in known] if args.arms else list(shape["arms"])
    for name in names:
        print(f"  arm {name}", flush=True)
        rows[name] = run_arm(name, model, ids, mask, shape["new"], scales, args)
    agreement(rows)
    return {"batch": shape["batch"], "prompt": shape["prompt"], "new": shape["new"], "arms": rows}


def sweep(
    model: Any, kind: str, scales: dict[str, torch.Tensor], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Decode speed against batch (2048 + 32), or peak memory against context (batch 16 + 8)."""
    points = []
    values = SWEEP_BATCHES if kind == "batch" else SWEEP_CONTEXTS
    for value in values:
        shape = (
            {"batch": value, "prompt": 2048, "new": 32, "arms": SWEEP_ARMS}
            if kind == "batch"
            else {"batch": 16, "prompt": value, "new": 8, "arms": SWEEP_ARMS}
        )
        print(f" {kind} = {value}", flush=True)
        points.append(run_shape(model, shape, scales, args))
    return points


# ---------------------------------------------------------------------- capacity


def capacity(
    model: Any, scales: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, Any]:
    """The largest batch of 8192-token prompts that ``generate`` serves in the budget."""
    device = next(model.parameters()).device
    budget = int(args.budget_gb * 2**30)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    vocab, prompt, new = model.config.vocab_size, args.capacity_prompt, 8
    weights = torch.cuda.memory_allocated(device)
    out: dict[str, Any] = {"budget_bytes": budget, "prompt": prompt, "new": new, "runs": {}}

    def fits(name: str, batch: int, extra: dict[str, Any]) -> tuple[bool, str]:
        torch.cuda.reset_peak_memory_stats(device)
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, vocab, (batch, prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        arm = Arm(name, model, scales, args.backend)
        try:
            with arm as gen_kwargs, torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    **gen_kwargs,
                    **extra,
                )
            return True, "ok"
        except Exception as err:  # out of memory, or kvquant's CacheCapacityError
            return False, f"{type(err).__name__}: {str(err).splitlines()[0][:600]}"
        finally:
            del ids, mask

    for chunked in (False, True) if args.capacity_unchunked else (True,):
        extra = {"prefill_chunk_size": 2048} if chunked else {}
        for name in args.capacity_arms:
            tries: list[dict[str, Any]] = []
            lo, hi, batch = 0, None, args.capacity_start
            while True:
                ok, why = fits(name, batch, extra)
                # What the try left allocated, without any collection (a finished or failed
                # call must hold nothing). Only a leftover is collected, and that is recorded.
                leak = torch.cuda.memory_allocated(device) - weights
                collected = leak > 64 * 2**20
                if collected:
                    free_memory(device)
                tries.append(
                    {
                        "batch": batch,
                        "ok": ok,
                        "why": why,
                        "left_allocated_bytes": leak,
                        "collected_after": collected,
                        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                    }
                )
                print(f"  {name} chunked={chunked} batch {batch}: {why}", flush=True)
                if ok:
                    lo = batch
                else:
                    hi = batch
                if hi is None:
                    batch *= 2
                elif hi - lo <= max(1, lo // 16):
                    break
                else:
                    batch = (lo + hi) // 2
            out["runs"][f"{name}{'-chunked' if chunked else ''}"] = {
                "max_batch": lo,
                "tries": tries,
            }
            # written after every arm: a run stopped by its time limit keeps what it measured
            Path(args.out).write_text(json.dumps({"capacity": out}, indent=1, default=str))
            print(f"capacity {name} chunked={chunked}: max batch {lo}", flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
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


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for shape, data in result.get("shapes", {}).items():
        lines.append(f"{shape}: B{data['batch']} x ({data['prompt']} + {data['new']})")
        lines.append(
            f"  {'arm':20s} {'step ms med':>11s} {'mean':>7s} {'prefill s':>9s} "
            f"{'wall s':>7s} {'1st call s':>10s} {'peak GB':>8s}"
        )
        for arm, row in data["arms"].items():
            if row["status"] != "ok":
                lines.append(f"  {arm:20s} {row['status']}: {row.get('reason', '')[:70]}")
                continue
            peak = (row["peak_bytes"] or 0) / 1e9
            lines.append(
                f"  {arm:20s} {row['step_ms_median']:11.2f} {row['step_ms_mean']:7.2f} "
                f"{row['prefill_s']:9.3f} {row['wall_s']:7.3f} {row['first_call_s']:10.3f} "
                f"{peak:8.2f}"
            )
    cap = result.get("capacity")
    if cap:
        for name, run in cap["runs"].items():
            lines.append(f"capacity {name}: max batch {run['max_batch']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU-sized run")
    parser.add_argument(
        "--shapes", default="", help=f"comma list of {sorted(SHAPES)}, batch, context"
    )
    parser.add_argument(
        "--arms",
        default="",
        help=f"comma list, run in that order: a subset of {ARMS} and the opt-in arms "
        f"{OPT_IN_ARMS} (default: each shape's own arms)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up")
    parser.add_argument("--capacity", action="store_true", help="run the capacity search")
    parser.add_argument("--budget-gb", type=float, default=24.0)
    parser.add_argument("--capacity-prompt", type=int, default=8192)
    parser.add_argument("--capacity-start", type=int, default=8, help="first batch tried")
    parser.add_argument(
        "--capacity-unchunked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also search without prefill_chunk_size",
    )
    parser.add_argument(
        "--capacity-arms",
        default=",".join(DEFAULT_CAPACITY_ARMS),
        help=f"comma list of the capacity search's arms, a subset of {CAPACITY_ARMS}",
    )
    parser.add_argument("--device", default=None, help="default cuda if available, else cpu")
    parser.add_argument("--backend", default="auto", help="kvquant kernel backend")
    args = parser.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(ARMS) - set(OPT_IN_ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; expected a subset of {ARMS + OPT_IN_ARMS}")
    args.capacity_arms = [a for a in args.capacity_arms.split(",") if a]
    unknown = sorted(set(args.capacity_arms) - set(CAPACITY_ARMS))
    if unknown:
        parser.error(f"unknown capacity arms {unknown}; expected a subset of {CAPACITY_ARMS}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if (args.tiny and device.type == "cpu") else torch.bfloat16
    model = build_model(args.tiny, device, dtype)
    gen = torch.Generator().manual_seed(2)
    calib = torch.randint(1, model.config.vocab_size, (1, 256), generator=gen).to(device)
    scales = calibrate_per_tensor(model, calib)
    result: dict[str, Any] = {
        "environment": environment(device),
        "model": "Llama, random bf16 weights, " + ("tiny" if args.tiny else "Llama-3.2-1B shapes"),
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "command": " ".join(["python", "benchmarks/e2e_generate.py", *(argv or sys.argv[1:])]),
        "repeats": args.repeats,
        "shapes": {},
    }
    names = [s for s in args.shapes.split(",") if s] or ([] if args.capacity else ["all"])
    table = TINY_SHAPES if args.tiny else SHAPES
    for name in names:
        for key in table if name == "all" else [name]:
            print(f"shape {key}", flush=True)
            if key in ("batch", "context"):
                result[f"sweep_{key}"] = sweep(model, key, scales, args)
            elif key in table:
                result["shapes"][key] = run_shape(model, table[key], scales, args)
            else:
                parser.error(f"unknown shape {key!r}")
    if args.capacity:
        if device.type != "cuda":
            parser.error("--capacity needs a CUDA device")
        result["capacity"] = capacity(model, scales, args)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print("\n".join(summary(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
