"""Host (Python/CPU) overhead of kvquant per decode step, measured on CPU.

A tiny Llama (sizes are flags) generates greedily in two arms, on CPU:

* ``null``: the model unpatched, attention replaced by a stub that returns
  zeros of the right shape and a cache that stores nothing (transformers'
  own per-step work: embedding, projections, masks, ``generate``'s loop);
* ``kvquant``: the model patched with ``kvquant.patch(model, scales={},
  scale_format="fp32-group")``, with kvquant's *compute* replaced by stubs
  (``write_kv_reference`` does nothing, ``paged_attention_reference`` returns
  zeros), so what remains of kvquant is its Python path: validation, slot
  mapping, page allocator, block tables, memos, hooks.

The difference of the two arms' median decode-step times (the arms run
interleaved, one ``generate`` each per repeat) is kvquant's host cost per
step, hooks included; it is noisy on a loaded machine (a few hundred us), the
inclusive timers below are the stable figure. In separate runs, kvquant's entry points are wrapped with timers
(inclusive wall time, per step and per layer call): cache-layer ``update``
(first layer of the step, which reserves pages, apart from the others),
``slots_for``, the storage's write and attend, the attention function and the
cache's kernel plans (finding or building a plan: the structural checks); and aten operators run inside kvquant's entry points
are counted (a CPU-side proxy for GPU launch overhead: each non-view op is a
kernel launch or a copy on CUDA). ``--profile`` adds a cProfile table of
kvquant's functions.

Value checks (``kvquant.kernels.validate``: they read tensor values and run
on CPU tensors only, or with ``KVQUANT_CHECK_VALUES=1``) are switched off by
default so the measured path is the one a GPU run takes; ``--value-checks``
keeps them.

Usage::

    python benchmarks/host_overhead.py                     # defaults (about 1 min on CPU)
    python benchmarks/host_overhead.py --steps 64 --repeats 3 --json /tmp/host.json
    python benchmarks/host_overhead.py --profile           # + cProfile of kvquant functions
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STUB_ATTN = "kvq_host_stub"


# ---------------------------------------------------------------------- model


def build_model(args: argparse.Namespace) -> Any:
    """A small random-weight Llama in fp32 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, 2 * (args.prompt_len + args.steps)),
        tie_word_embeddings=True,
    )
    cfg.bos_token_id = None
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# ---------------------------------------------------------------------- stubs


def _stub_attention(
    module: Any, query: torch.Tensor, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Attention stub of the ``null`` arm: zeros ``[B, Lq, Hq, D]``."""
    b, h, lq, d = query.shape
    return torch.zeros((b, lq, h, d), dtype=query.dtype), None


def null_cache() -> Any:
    """A transformers ``Cache`` that stores nothing but counts positions (like ``DynamicLayer``)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class NullLayer(CacheLayerMixin):
        is_compileable = False
        is_sliding = False

        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            self.is_initialized = True

        def update(self, key_states: Any, value_states: Any, *a: Any, **k: Any) -> Any:
            self.n += key_states.shape[-2]
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.n + query_length, 0

        def get_seq_length(self) -> int:
            return self.n

        def get_max_length(self) -> int:
            return -1

    class NullCache(Cache):
        def __init__(self, num_layers: int) -> None:
            super().__init__(layers=[NullLayer() for _ in range(num_layers)])

    return NullCache


def _write_stub(*args: Any, **kwargs: Any) -> None:
    return None


_ZEROS: dict[tuple[Any, ...], torch.Tensor] = {}


def _attention_stub(query: torch.Tensor, *args: Any, out: Any = None, **kwargs: Any) -> Any:
    """``paged_attention_reference`` stub: zeros of the output's shape (reused: no tensor op)."""
    if out is not None:
        return out
    key = (tuple(query.shape), query.dtype, query.device)
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = _ZEROS[key] = torch.zeros(key[0], dtype=query.dtype, device=query.device)
    return zeros


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the duration (no-op if ``obj`` lacks ``name``)."""
    if not hasattr(obj, name):
        yield
        return
    old = obj.__dict__[name] if name in getattr(obj, "__dict__", {}) else getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# ---------------------------------------------------------------------- timers


class Meter:
    """Inclusive wall time and call counts of wrapped functions."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, label: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        total, calls = self.total, self.calls
        meter = self

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            if not meter.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                name = label if isinstance(label, str) else label(*a, **k)
                total[name] += time.perf_counter() - t0
                calls[name] += 1

        return timed


class OpCounter(TorchDispatchMode):
    """Counts the aten operators run inside kvquant's entry points (``--`` no timing)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.on = False
        self.depth = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        @functools.wraps(fn)
        def counted(*a: Any, **k: Any) -> Any:
            if not counter.on or counter.depth:
                return fn(*a, **k)
            counter.depth += 1
            try:
                with counter:
                    return fn(*a, **k)
            finally:
                counter.depth -= 1

        return counted


def _update_label(layer: Any, *a: Any, **k: Any) -> str:
    return "update (layer 0)" if getattr(layer, "layer_idx", 0) == 0 else "update (layers 1+)"


TIMED: tuple[tuple[str, str, str], ...] = (
    # label, module, attribute path ("Class.method" or a module global)
    ("slots_for", "kvquant.integrations.hf.cache_layer", "KVQuantCache.slots_for"),
    ("storage.write", "kvquant.cache", "PagedLayerStorage.write"),
    ("plans.write_kv", "kvquant.kernels", "PlanCache.write_kv"),
    ("write plan (find/build)", "kvquant.kernels", "PlanCache.write_plan"),
    ("storage.attend", "kvquant.cache", "PagedLayerStorage.attend"),
    ("plans.paged_attention", "kvquant.kernels", "PlanCache.paged_attention"),
    ("attention plan (find/build)", "kvquant.kernels", "PlanCache.attention_plan"),
)


@contextmanager
def instrument(meter: Meter | None, counter: OpCounter | None = None) -> Iterator[None]:
    """Wrap kvquant's entry points with ``meter`` timers or ``counter`` (restored on exit)."""
    import importlib

    from transformers import AttentionInterface

    from kvquant.integrations.hf import attention as kv_attention
    from kvquant.integrations.hf.cache_layer import KVQuantLayer

    undo: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, new: Any) -> None:
        undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, new)

    if counter is not None:  # the two outermost entry points only
        swap(KVQuantLayer, "update", counter.wrap(KVQuantLayer.__dict__["update"]))
        attn = counter.wrap(kv_attention.kvquant_attention)
    else:
        assert meter is not None
        swap(KVQuantLayer, "update", meter.wrap(_update_label, KVQuantLayer.__dict__["update"]))
        for label, mod_name, path in TIMED:
            owner: Any = importlib.import_module(mod_name)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            if attr in owner.__dict__:
                swap(owner, attr, meter.wrap(label, owner.__dict__[attr]))
        attn = meter.wrap("attention fn", kv_attention.kvquant_attention)
    AttentionInterface.register(kv_attention.ATTN_NAME, attn)
    try:
        yield
    finally:
        AttentionInterface.register(kv_attention.ATTN_NAME, kv_attention.kvquant_attention)
        for owner, name, old in reversed(undo):
            setattr(owner, name, old)


# ---------------------------------------------------------------------- running


class Clock:
    """Stopping criterion: a timestamp after every generated token; switches the meter on."""

    def __init__(self, meter: Meter | OpCounter | None) -> None:
        self.meter = meter
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        if self.meter is not None:
            self.meter.on = True  # decode steps only (the prefill is not counted)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def generate(
    model: Any, ids: torch.Tensor, steps: int, extra: dict[str, Any], clock: Clock
) -> None:
    from transformers import StoppingCriteriaList

    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps + 1,
        min_new_tokens=steps + 1,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([clock]),
        **extra,
    )


def step_times(clock: Clock) -> list[float]:
    s = clock.stamps
    return [(b - a) * 1e6 for a, b in itertools.pairwise(s)]


def null_once(model: Any, ids: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """One ``generate`` of the ``null`` arm (unpatched model, stub attention, null cache)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from kvquant.integrations.hf.compat import cache_keyword

    AttentionInterface.register(STUB_ATTN, _stub_attention)
    AttentionMaskInterface.register(STUB_ATTN, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(STUB_ATTN)
    try:
        clock = Clock(None)
        cache = null_cache()(model.config.num_hidden_layers)
        generate(model, ids, args.steps, {cache_keyword(model.model): cache}, clock)
    finally:
        model.set_attn_implementation(previous)
    return step_times(clock)


@contextmanager
def kvquant_stubbed(model: Any, args: argparse.Namespace) -> Iterator[Callable[[], dict[str, Any]]]:
    """The model patched by kvquant, its compute stubbed; yields a factory of ``generate`` kwargs."""
    import kvquant
    import kvquant.kernels as kernels
    import kvquant.kernels.attention.validate as attention_checks
    import kvquant.kernels.plan as plans
    import kvquant.kernels.write.validate as write_checks
    from kvquant.integrations.hf.compat import cache_keyword

    checks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if not args.value_checks:
        checks = contextlib.ExitStack()
        for module in (attention_checks, write_checks):
            checks.enter_context(patched(module, "value_checks_enabled", lambda device: False))
    handle = kvquant.patch(model, scales={}, scale_format="fp32-group", page_size=args.page_size)
    key = cache_keyword(model.model)
    tokens = args.batch * (args.prompt_len + args.steps + 8)
    try:
        with (
            patched(kernels, "write_kv_reference", _write_stub),
            patched(kernels, "paged_attention_reference", _attention_stub),
            patched(plans, "write_kv_reference", _write_stub),
            patched(plans, "paged_attention_reference", _attention_stub),
            checks,
        ):
            yield lambda: {key: handle.new_cache(max_cache_tokens=tokens)}
    finally:
        handle.remove()


def run_arms(
    model: Any, ids: torch.Tensor, args: argparse.Namespace
) -> tuple[list[float], list[float], Meter, OpCounter, str | None]:
    """Step times of both arms (interleaved, so both see the same machine load), then timers."""
    null: list[float] = []
    kvq: list[float] = []
    null_once(model, ids, args)  # warm-up
    with kvquant_stubbed(model, args) as extra:
        generate(model, ids, 2, extra(), Clock(None))
    for _ in range(args.repeats):
        null += null_once(model, ids, args)
        with kvquant_stubbed(model, args) as extra:
            clock = Clock(None)
            generate(model, ids, args.steps, extra(), clock)
            kvq += step_times(clock)
    meter = Meter()
    counter = OpCounter()
    prof_text = None
    with kvquant_stubbed(model, args) as extra:
        with instrument(meter):  # timers: separate runs (the wrappers cost time too)
            for _ in range(args.repeats):
                meter.on = False
                generate(model, ids, args.steps, extra(), Clock(meter))
                meter.on = False
        with instrument(None, counter):
            generate(model, ids, args.steps, extra(), Clock(counter))
            counter.on = False
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            generate(model, ids, args.steps, extra(), Clock(None))
            prof.disable()
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
            stats.print_stats(r"kvquant[/\\](?!.*host_overhead)", 40)
            prof_text = buf.getvalue()
    return null, kvq, meter, counter, prof_text


def summarize(
    args: argparse.Namespace, null: list[float], kvq: list[float], meter: Meter, counter: OpCounter
) -> dict[str, Any]:
    steps = args.steps * args.repeats  # decode steps the timers saw
    calls_per_step = args.layers
    null_med = statistics.median(null)
    kvq_med = statistics.median(kvq)
    rows: dict[str, dict[str, float]] = {}
    for label in sorted(meter.total, key=lambda s: -meter.total[s]):
        total_us = meter.total[label] * 1e6
        rows[label] = {
            "calls": meter.calls[label],
            "us_per_call": total_us / max(meter.calls[label], 1),
            "us_per_step": total_us / max(steps, 1),
        }
    kvq_total = sum(
        rows.get(k, {}).get("us_per_step", 0.0)
        for k in ("update (layer 0)", "update (layers 1+)", "attention fn")
    )
    return {
        "config": {
            k: getattr(args, k)
            for k in (
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "batch",
                "prompt_len",
                "steps",
                "repeats",
                "page_size",
                "threads",
                "value_checks",
            )
        },
        "decode_steps_timed": steps,
        "step_us_null_median": null_med,
        "step_us_kvquant_median": kvq_med,
        "step_us_difference": kvq_med - null_med,
        "kvquant_inclusive_us_per_step": kvq_total,
        "kvquant_inclusive_us_per_layer_call": kvq_total / calls_per_step,
        "timers": rows,
        "aten_ops_per_step": sum(counter.counts.values()) / max(args.steps, 1),
        "aten_ops_per_step_by_op": {
            op: n / max(args.steps, 1) for op, n in counter.counts.most_common()
        },
    }


def print_table(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        f"tiny Llama {c['layers']} layers, hidden {c['hidden']}, {c['heads']} q / "
        f"{c['kv_heads']} KV heads, head_dim {c['head_dim']}; batch {c['batch']}, prompt "
        f"{c['prompt_len']}, {res['decode_steps_timed']} decode steps timed "
        f"({c['repeats']} x {c['steps']}), page_size {c['page_size']}, threads {c['threads']}, "
        f"value checks {'on' if c['value_checks'] else 'off'}"
    )
    print(f"{'decode step (median)':<40}{'us':>12}")
    print(f"{'  null arm (stub attn, null cache)':<40}{res['step_us_null_median']:>12.1f}")
    print(f"{'  kvquant arm (stubbed kernels)':<40}{res['step_us_kvquant_median']:>12.1f}")
    print(f"{'  difference = kvquant host cost':<40}{res['step_us_difference']:>12.1f}")
    print(
        f"{'  kvquant entry points, inclusive':<40}{res['kvquant_inclusive_us_per_step']:>12.1f}"
        f"   ({res['kvquant_inclusive_us_per_layer_call']:.1f} us per layer call)"
    )
    by_op = ", ".join(f"{op} {n:g}" for op, n in list(res["aten_ops_per_step_by_op"].items())[:8])
    print(f"{'  aten ops in kvquant per step':<40}{res['aten_ops_per_step']:>12.1f}   ({by_op})")
    print(f"\n{'timer (inclusive)':<28}{'calls':>8}{'us/call':>12}{'us/step':>12}")
    for label, row in res["timers"].items():
        print(f"{label:<28}{row['calls']:>8}{row['us_per_call']:>12.1f}{row['us_per_step']:>12.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per generate")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls per arm")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--value-checks", action="store_true", help="keep CPU value checks on")
    ap.add_argument("--profile", action="store_true", help="cProfile kvquant's functions too")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=gen)
    with torch.inference_mode():
        null, kvq, meter, counter, prof_text = run_arms(model, ids, args)
    res = summarize(args, null, kvq, meter, counter)
    print_table(res)
    if prof_text:
        print("\ncProfile of one kvquant generate (prefill included), kvquant functions:")
        print(prof_text)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
