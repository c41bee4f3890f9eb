"""Continuous-batching benchmark: transformers' own paged cache against kvquant's FP8 pages.

A Llama model with Llama-3.2-1B shapes (``benchmarks/e2e_generate.py``'s ``build_model``:
random bf16 weights from a config, no download) serves ``--requests`` requests
through transformers' ``ContinuousBatchingManager``: prompts of random token ids,
their lengths uniform in ``--prompt`` (lo,hi), each request asking for a number of
new tokens uniform in ``--new`` (lo,hi), end-of-sequence disabled, so every arm
does the same work. Two arrival modes, one after the other on the same manager:

* ``burst``: every request added at once;
* ``stream``: arrivals of a Poisson process of ``--rate`` requests per second.

Every arm gets the same memory budget for its cache: ``--budget-gb`` GiB, passed as
``num_blocks`` = budget / bytes of one block of ``page_size`` tokens in bf16.
transformers' cache holds those blocks; kvquant's reads ``num_blocks`` as that
budget and holds the FP8 blocks the same bytes buy (about twice as many). Every
arm steps at most ``--max-batch-tokens`` tokens (8192, transformers 5.24's default;
5.17 would size it from memory); the rest of transformers' configuration stays at
its defaults for the arm (pages of 256 tokens; the flash arm may use CUDA graphs).
``--decode-graphs`` gives kvquant's arms ``use_cuda_graph=(False, True)`` (transformers
5.24 and later: decode steps replayed from CUDA graphs, every step padded).

Per arm and mode (JSON): wall time from the first request added to the last
result; output tokens/s (generated tokens / wall time); time to first token per
request (its first token's timestamp minus the time it was added), median and p95,
over every request added, finished or not: a run stopped by ``--timeout`` bounds a
request with no first token yet from below (the stop minus the time it was added),
and a median or p95 that such a bound could precede is reported as a lower bound
(``ttft_median_s_at_least``; ``censored_ttft``); ``ttft_finished_only_*`` are the
figures over finished requests of earlier results. Also the most requests in flight
(active in the scheduler, sampled every 10 ms); peak memory
(``torch.cuda.max_memory_allocated`` since the mode began); the cache's blocks and
token slots.

Arms (one process each, ``--arm`` runs one; without it the script runs each arm
in a child process and writes one JSON):

* ``sdpa``: transformers' continuous batching, bf16 cache, SDPA attention
  (``paged|sdpa`` on transformers 5.17);
* ``flash_attention_2``: the same with flash attention (only where ``flash_attn``
  is installed);
* ``kvquant``: ``kvquant.patch(model, scales=per_tensor)``: per-tensor scales
  calibrated on one random prompt (as a checkpoint would ship them);
* ``kvquant-dynamic``: ``kvquant.patch(model)`` without scales (dynamic
  ``fp32-group`` scales);
* on request (``--arms``): ``kvquant-nvfp4`` (``kv_format="nvfp4"``: 4-bit pages) and
  ``kvquant-recent16`` (``kvquant-dynamic`` with ``recent_tokens=16``: a ring of the 16
  newest tokens in every block, which batching keeps only when asked).

Usage (H200, repository root, PYTHONPATH=.)::

    python benchmarks/continuous_batching.py --out cb.json                # the full workload
    python benchmarks/continuous_batching.py --quick --out cb_quick.json  # about 2 minutes
    python benchmarks/continuous_batching.py --tiny --out /tmp/cb.json    # CPU smoke run

Works on transformers 5.17 and 5.24.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # run as a script from a checkout: make the repository's kvquant and benchmarks importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("sdpa", "flash_attention_2", "kvquant", "kvquant-dynamic")
"""The arms a run drives by default."""

PATCH_ARMS: dict[str, dict[str, Any]] = {
    "kvquant": {},  # per-tensor scales calibrated on random tokens
    "kvquant-dynamic": {},  # no scales: dynamic fp32-group
    "kvquant-nvfp4": {"kv_format": "nvfp4"},
    "kvquant-recent16": {"recent_tokens": 16},  # dynamic fp32-group, the 16 newest exact
}
"""Each kvquant arm's patch options (``--arms`` may name any)."""

FULL = {"requests": 256, "prompt": (256, 8192), "new": (128, 512), "budget_gb": 16.0, "rate": 4.0}
QUICK = {"requests": 32, "prompt": (256, 1024), "new": (32, 64), "budget_gb": 0.25, "rate": 16.0}
TINY = {"requests": 12, "prompt": (8, 48), "new": (4, 12), "budget_gb": 0.0005, "rate": 50.0}


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The requests: (prompt ids, new tokens), the same for every arm (seeded)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        n = rng.randint(*args.prompt)
        out.append(([rng.randrange(1, vocab) for _ in range(n)], rng.randint(*args.new)))
    return out


def cb_config(args: argparse.Namespace, model: Any, kvquant_arm: bool = False) -> Any:
    """The continuous-batching config of every arm: the same cache budget in bf16 blocks
    (with ``--decode-graphs``, kvquant's arms replay decode steps from CUDA graphs)."""
    from transformers import ContinuousBatchingConfig

    fields = ContinuousBatchingConfig.__dataclass_fields__
    page_key = "page_size" if "page_size" in fields else "block_size"
    page = args.page or int(fields[page_key].default)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    block = 2 * cfg.num_hidden_layers * page * cfg.num_key_value_heads * head_dim * 2  # bf16
    blocks = max(1, int(args.budget_gb * 2**30) // block)
    kw: dict[str, Any] = {page_key: page, "num_blocks": blocks}
    if args.max_batch_tokens:
        kw["max_batch_tokens"] = args.max_batch_tokens
    if args.max_blocks_per_request is not None and "max_blocks_per_request" in fields:
        kw["max_blocks_per_request"] = args.max_blocks_per_request
    if args.decode_graphs and kvquant_arm:
        kw["use_cuda_graph"] = (False, True)
    sizing = {"page": page, "num_blocks": blocks, "bf16_block": block}
    sizing["max_blocks_per_request"] = kw.get("max_blocks_per_request")  # None: the default
    sizing["use_cuda_graph"] = kw.get("use_cuda_graph")  # None: transformers' default
    return ContinuousBatchingConfig(**kw), sizing


class InFlight:
    """Samples the scheduler's active requests every 10 ms; keeps the maximum."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            processor = self.manager.batch_processor
            if processor is not None:
                self.peak = max(self.peak, len(processor.scheduler.active_requests))

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


class FirstTokens:
    """Every request state transformers' scheduler takes in, kept to read first tokens at the end.

    A request reaches the scheduler through ``add_waiting_request`` when it arrives, and again
    when it comes back after an eviction: the same state from CPU offloading, or a new one when
    it is recomputed (a "soft reset": the new state's ``created_time`` and timestamps restart).
    Each state keeps its token timestamps (``record_timestamps=True``), so a request's first
    token is the earliest over its states and its creation time the earliest ``created_time``,
    whether it finished or not. One list append per state taken in, nothing per token.
    """

    def __init__(self, manager: Any) -> None:
        self.states: dict[str, list[Any]] = {}
        self.note: str | None = None
        scheduler: Any = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
        take = getattr(scheduler, "add_waiting_request", None)
        if take is None:
            self.note = (
                "transformers' scheduler has no add_waiting_request: time to first token "
                "over finished requests only"
            )
            return

        def keep(state: Any) -> Any:
            self.states.setdefault(state.request_id, []).append(state)
            return take(state)

        scheduler.add_waiting_request = keep

    def first_token(self, request_id: str) -> tuple[float | None, float | None]:
        """(creation time, first token's time) of a request; None where not seen."""
        states = list(self.states.get(request_id, ()))
        if not states:
            return None, None
        created = min(s.created_time for s in states)
        firsts = [ts[0] for s in states if (ts := s.timestamps)]
        return created, min(firsts) if firsts else None


def order_statistic(
    observed: list[float], bounds: list[float], k: int
) -> tuple[float, bool] | None:
    """The ``k``-th smallest (from 1) of observed values and censored ones, each censored value
    known only to exceed its bound: ``(value, True)`` when known exactly, else ``(lower bound,
    False)``; None when there are fewer than ``k`` values.

    Exact when at least ``k`` values are observed and the ``k``-th smallest of them is at most
    every bound: every censored value is then larger, so the ``k`` smallest are all observed.
    Otherwise a censored value may or may not come before it; replacing each censored value by
    its bound lowers every order statistic, so the ``k``-th smallest of values and bounds
    together is a lower bound.
    """
    if not 1 <= k <= len(observed) + len(bounds):
        return None
    seen = sorted(observed)
    if k <= len(seen) and (not bounds or seen[k - 1] <= min(bounds)):
        return seen[k - 1], True
    return sorted(seen + list(bounds))[k - 1], False


def censored_ttft(observed: list[float], bounds: list[float]) -> dict[str, Any]:
    """Median and p95 of the time to first token over every request: ``observed`` for those that
    got a first token, ``bounds`` (stop time minus creation time) for those that had none when
    the run stopped. ``ttft_median_s`` / ``ttft_p95_s`` where known exactly, else
    ``ttft_median_s_at_least`` / ``ttft_p95_s_at_least``; the median of an even count is the mean
    of the two middle values (as ``statistics.median``), the p95 the ``ceil(0.95 n)``-th value.
    """
    n = len(observed) + len(bounds)
    out: dict[str, Any] = {"ttft_requests": n, "first_tokens": len(observed)}
    if n == 0:
        return out
    middle = [(n + 1) // 2] if n % 2 else [n // 2, n // 2 + 1]
    ranks = {"ttft_median_s": middle, "ttft_p95_s": [max(1, math.ceil(0.95 * n))]}
    for key, ks in ranks.items():
        parts = [order_statistic(observed, bounds, k) for k in ks]
        values = [p for p in parts if p is not None]
        exact = all(e for _, e in values)
        out[key if exact else f"{key}_at_least"] = sum(v for v, _ in values) / len(values)
    return out


def ttft_fields(
    tracker: FirstTokens | None, added: dict[str, float], stop: float, results: dict[str, Any]
) -> dict[str, Any]:
    """The mode's time-to-first-token fields: over every request added before ``stop``
    (:func:`censored_ttft`), and the earlier figures over finished requests only."""
    finished = sorted(r.timestamps[0] - r.created_time for r in results.values() if r.timestamps)
    out: dict[str, Any] = {
        "ttft_finished_only_median_s": statistics.median(finished) if finished else None,
        "ttft_finished_only_p95_s": finished[
            min(len(finished) - 1, math.ceil(0.95 * len(finished)) - 1)
        ]
        if finished
        else None,
    }
    if tracker is None or tracker.note is not None:
        out["ttft_note"] = tracker.note if tracker is not None else "no first-token tracker"
        return out
    observed, bounds = [], []
    for rid, added_at in added.items():
        created, first = tracker.first_token(rid)
        created = added_at if created is None else created
        if first is not None:
            observed.append(first - created)
        else:
            bounds.append(stop - created)
    out.update(censored_ttft(observed, bounds))
    return out


def _submit(
    manager: Any,
    ids: list[str],
    reqs: list[tuple[list[int], int]],
    mode: str,
    args: argparse.Namespace,
    added: dict[str, float],
) -> threading.Thread | None:
    """Add the mode's requests (all now, or a feeder thread's Poisson arrivals); ``added`` gets
    each request's time just after it was added."""

    def add(rid: str, prompt: list[int], new: int) -> None:
        manager.add_request(prompt, request_id=rid, max_new_tokens=new, record_timestamps=True)
        added[rid] = time.perf_counter()

    if mode != "stream":
        for rid, (prompt, new) in zip(ids, reqs, strict=True):
            add(rid, prompt, new)
        return None
    rng = random.Random(args.seed + 1)

    def feed() -> None:
        for rid, (prompt, new) in zip(ids, reqs, strict=True):
            time.sleep(rng.expovariate(args.rate))
            add(rid, prompt, new)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    return feeder


def run_mode(
    manager: Any,
    reqs: list[tuple[list[int], int]],
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
    tracker: FirstTokens | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Serve ``reqs`` once (``burst`` or ``stream``); the measurements of the mode."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ids = [f"{mode}_{i}" for i in range(len(reqs))]
    sampler = InFlight(manager)
    added: dict[str, float] = {}
    start = time.perf_counter()
    feeder = _submit(manager, ids, reqs, mode, args, added)
    results: dict[str, Any] = {}
    deadline = start + (args.timeout if timeout is None else timeout)
    while len(results) < len(reqs) and time.perf_counter() < deadline:
        result = manager.get_result(timeout=1.0)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    stop = time.perf_counter()
    ttft = ttft_fields(tracker, dict(added), stop, results)
    wall = stop - start
    if feeder is not None:
        feeder.join(timeout=5)
    peak_in_flight = sampler.close()
    generated = sum(len(r.generated_tokens) for r in results.values())
    out: dict[str, Any] = {
        "mode": mode,
        "requests": len(reqs),
        "finished": len(results),
        "failed": [r.request_id for r in results.values() if r.error is not None],
        "wall_s": wall,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / wall if wall > 0 else None,
        **ttft,
        "max_in_flight": peak_in_flight,
    }
    if len(results) < len(reqs):
        # Cut by --timeout: the arm's tokens/s at the end cannot exceed every requested token
        # over the time already spent (an upper bound, for ratios against a run that was cut).
        out["output_tokens_per_s_at_most"] = sum(new for _, new in reqs) / wall
    if device.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: build the model, patch it (kvquant arms), serve both modes."""
    from transformers import GenerationConfig

    from benchmarks.e2e_generate import build_model, calibrate_per_tensor

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype)
    row: dict[str, Any] = {"arm": arm}
    if arm == "flash_attention_2":
        model.set_attn_implementation("flash_attention_2")
    elif arm.startswith("kvquant"):
        import kvquant

        scales = None
        if arm == "kvquant":
            g = torch.Generator().manual_seed(1)
            calib = torch.randint(1, model.config.vocab_size, (1, 512), generator=g).to(device)
            scales = calibrate_per_tensor(model, calib)
        handle = kvquant.patch(model, scales=scales, backend=args.backend, **PATCH_ARMS[arm])
        row["granularity"] = sorted({s.granularity for s in handle.state.layer_specs})
    reqs = workload(args, model.config.vocab_size)
    config, sizing = cb_config(args, model, arm.startswith("kvquant"))
    row.update(sizing)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=args.new[1], eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=config
    )
    manager.start()
    cut = False
    try:
        warm = [(prompt[:64], 4) for prompt, _ in reqs[:4]]
        run_mode(manager, warm, "warmup", args, device, timeout=max(args.timeout, 60.0))
        cache = manager.batch_processor.cache
        row["cache_blocks"] = int(cache.num_blocks)
        row["cache_tokens"] = int(cache.num_blocks) * sizing["page"]
        tracker = FirstTokens(manager)  # after the warmup: the batch processor exists
        row["modes"] = []
        for mode in args.modes:
            row["modes"].append(run_mode(manager, reqs, mode, args, device, tracker))
            cut = cut or row["modes"][-1]["finished"] < len(reqs)
    finally:
        # A run cut by --timeout fails its unfinished requests: a flushing stop would wait for
        # them all (its 30 s join, then transformers' thread errors out for want of its batch
        # processor).
        manager.stop(block=True, timeout=30, hard_stop=cut)
    return row


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def _flash_installed() -> bool:
    from transformers.utils.import_utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def ttft_ratios(mine: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Median time to first token of a mode against the reference's, over every request:
    ``ttft_median_x`` where both are known, ``ttft_median_x_at_most`` where the reference's is
    only a lower bound, ``ttft_median_x_at_least`` where this mode's is; and
    ``ttft_finished_only_median_x``, over finished requests (the figure of earlier results)."""
    out: dict[str, float] = {}
    a, b = mine.get("ttft_median_s"), ref.get("ttft_median_s")
    a_low, b_low = mine.get("ttft_median_s_at_least"), ref.get("ttft_median_s_at_least")
    if a is not None and b is not None:
        out["ttft_median_x"] = a / max(1e-9, b)
    elif a is not None and b_low is not None:
        out["ttft_median_x_at_most"] = a / max(1e-9, b_low)
    elif a_low is not None and b is not None:
        out["ttft_median_x_at_least"] = a_low / max(1e-9, b)
    fa, fb = mine.get("ttft_finished_only_median_s"), ref.get("ttft_finished_only_median_s")
    if fa is not None and fb is not None:
        out["ttft_finished_only_median_x"] = fa / max(1e-9, fb)
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kvquant arms against the bf16 SDPA arm, per mode: the issue's targets as ratios."""
    base = next((r for r in rows if r.get("arm") == "sdpa" and "modes" in r), None)
    out: dict[str, Any] = {}
    if base is None:
        return out
    for row in rows:
        if not row.get("arm", "").startswith("kvquant") or "modes" not in row:
            continue
        for mine, ref in zip(row["modes"], base["modes"], strict=True):
            key = f"{row['arm']}/{mine['mode']}"
            out[key] = {
                "in_flight_x": mine["max_in_flight"] / max(1, ref["max_in_flight"]),
                "tokens_per_s_x": (mine["output_tokens_per_s"] or 0)
                / max(1e-9, ref["output_tokens_per_s"] or 0),
                **ttft_ratios(mine, ref),
            }
            if "output_tokens_per_s_at_most" in ref and "output_tokens_per_s_at_most" not in mine:
                # the reference was cut: this ratio holds whatever it would have reached
                out[key]["tokens_per_s_x_at_least"] = (mine["output_tokens_per_s"] or 0) / max(
                    1e-9, ref["output_tokens_per_s_at_most"]
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument(
        "--arm", choices=[*ARMS[:2], *PATCH_ARMS], default=None, help="run one arm in this process"
    )
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"arms the driver runs (default {','.join(ARMS)}; also {','.join(PATCH_ARMS)})",
    )
    parser.add_argument("--quick", action="store_true", help="a ~2 minute H200 run")
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU smoke run")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=_pair, default=None, help="lo,hi prompt tokens")
    parser.add_argument("--new", type=_pair, default=None, help="lo,hi new tokens")
    parser.add_argument("--budget-gb", type=float, default=None, help="cache budget (GiB, bf16)")
    parser.add_argument("--rate", type=float, default=None, help="stream arrivals per second")
    parser.add_argument("--modes", default="burst,stream", help="burst,stream")
    parser.add_argument("--page", type=int, default=None, help="tokens per block (default 256)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="tokens per step, every arm (8192)"
    )
    parser.add_argument(
        "--max-blocks-per-request",
        type=int,
        default=None,
        help="transformers' decode-path block table width, every arm (5.24+; 0: no decode "
        "path; default: transformers' and kvquant's own)",
    )
    parser.add_argument(
        "--decode-graphs",
        action="store_true",
        help="kvquant's arms: use_cuda_graph=(False, True), decode steps replayed from CUDA "
        "graphs (5.24+)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--backend", default="auto", help="kvquant kernel backend")
    args = parser.parse_args(argv)
    preset = TINY if args.tiny else QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.arm is not None:
        try:
            result: dict[str, Any] = run_arm(args.arm, args)
        except Exception as exc:  # the driver records a failed arm and runs the others
            traceback.print_exc()
            result = {"arm": args.arm, "error": f"{type(exc).__name__}: {exc}"}
        Path(args.out).write_text(json.dumps(result, indent=2))
        return 0 if "error" not in result else 1
    rows = []
    for arm in [a for a in args.arms.split(",") if a]:
        if arm == "flash_attention_2" and not _flash_installed():
            rows.append({"arm": arm, "skipped": "flash_attn is not installed"})
            continue
        part = Path(args.out).with_suffix(f".{arm}.json")
        child = [sys.executable, __file__, "--arm", arm, "--out", str(part)]
        child += _forwarded(args)
        print(f"arm {arm}: {' '.join(child[2:])}", flush=True)
        done = subprocess.run(child, check=False)
        rows.append(
            json.loads(part.read_text())
            if part.exists()
            else {"arm": arm, "error": f"exit {done.returncode}"}
        )
        part.unlink(missing_ok=True)
    result = {
        "environment": environment(),
        "workload": {
            "requests": args.requests,
            "prompt": list(args.prompt),
            "new": list(args.new),
            "budget_gb": args.budget_gb,
            "rate": args.rate,
            "modes": args.modes,
            "seed": args.seed,
        },
        "arms": rows,
        "ratios_vs_sdpa": ratios(rows),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    for row in rows:
        for mode in row.get("modes", []):
            print(
                f"  {row['arm']:>17} {mode['mode']:>6}: {mode['output_tokens_per_s'] or 0:9.1f} tok/s"
                f"  ttft p50 {_shown(mode, 'ttft_median_s')} s  p95 {_shown(mode, 'ttft_p95_s')} s"
                f" ({mode.get('first_tokens', '?')} first tokens)"
                f"  in flight {mode['max_in_flight']:4d}  peak {mode.get('peak_memory_bytes', 0) / 2**30:6.2f} GiB"
            )
        if "error" in row or "skipped" in row:
            print(f"  {row['arm']:>17}: {row.get('error') or row.get('skipped')}")
    return 0


def _shown(mode: dict[str, Any], key: str) -> str:
    """A figure of a mode for the summary line: ``>=`` before a lower bound."""
    if mode.get(key) is not None:
        return f"{mode[key]:7.3f}"
    if mode.get(f"{key}_at_least") is not None:
        return f">={mode[f'{key}_at_least']:.3f}".rjust(7)
    return "      -"


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The child process's arguments: the resolved workload and options."""
    out = [
        "--requests", str(args.requests),
        "--prompt", f"{args.prompt[0]},{args.prompt[1]}",
        "--new", f"{args.new[0]},{args.new[1]}",
        "--budget-gb", str(args.budget_gb),
        "--rate", str(args.rate),
        "--modes", ",".join(args.modes),
        "--timeout", str(args.timeout),
        "--seed", str(args.seed),
        "--backend", args.backend,
    ]  # fmt: skip
    for flag, value in (
        ("--page", args.page),
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--device", args.device),
    ):
        if value:
            out += [flag, str(value)]
    if args.max_blocks_per_request is not None:  # 0 too
        out += ["--max-blocks-per-request", str(args.max_blocks_per_request)]
    if args.decode_graphs:
        out.append("--decode-graphs")
    if args.tiny:
        out.append("--tiny")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
