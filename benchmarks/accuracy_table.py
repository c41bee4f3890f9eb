"""FP8 KV formats on SmolLM2-135M by simulation, beside a scale-jitter control.

Reproduces ``benchmarks/results/cpu_smollm2_accuracy_table.json`` and
``docs/assets/accuracy_formats.png`` (docs/accuracy.md). Run from the checkout's
root (CPU, fp32; the model is fetched on first use, see
``benchmarks/harness/smollm2.py``)::

    python -m benchmarks.accuracy_table --out table.json [--plot formats.png]

Static scales are ``amax / 448`` of the post-RoPE K/V per layer (per-tensor) or
per layer and KV head (per-head), measured on the pinned calibration texts. Every
format is evaluated by simulation (:func:`benchmarks.harness.accuracy.simulate_fp8_kv`,
one forward per run, every key and value read from FP8, including each window's
first position), teacher-forced on windows of the pinned evaluation texts, and
compared with the unquantized model's next-token distribution
(:mod:`benchmarks.harness.metrics`).

The static K transform (``kvquant calibrate --format k-transform``) is
calibrated by :func:`kvquant.calibrate.choose_k_transform` on the same texts and
simulated by ``simulate_fp8_kv(mode="k-transform")``: with the Hadamard
rotation (``kvquant calibrate, k-transform``, with its own jitter family) and
offset only (``kvquant calibrate, k-transform offset-only``), the first token
of every window attended exactly in both.

Calibration-free formats (``--sections groups,group-jitter,dynamic``): dynamic
fp32-group scales, alone or with a fixed Hadamard rotation of K (and V), the first
token at full precision, smaller groups for K (:data:`DYNAMIC`, simulated by
``simulate_fp8_kv(mode="dynamic")``); ``--eval-files`` evaluates on other texts
(held-out ones) instead of the pinned evaluation set.

4-bit formats (``--sections k-transform,fp4``): ``kvquant.patch(model, kv_format=...)``'s
NVFP4, MXFP4 and FP8 K beside NVFP4 V, plain and with a fixed Hadamard rotation of K (and V)
(:func:`fp4_formats`, simulated by ``simulate_fp8_kv(mode="fp4")``), beside the k-transform;
three of them with each position's newest 16 keys and values read exactly (``recent-16``,
``kvquant.patch(model, recent_tokens=16)``). ``--sections recent``: the static FP8 formats
(per-tensor, per-head, the k-transform) with the newest 16 exact (:data:`RECENT_ROWS`).

**Scale-jitter control.** Multiplying a set of static scales by 1.01 ... 1.10
changes neither clipping (the scales only grow) nor the size of FP8's relative
rounding error; it only moves values on the FP8 grid. The spread of a metric
over those runs (the unjittered run included) is what the metric moves for no
reason a format could claim, so a gap between two formats is called resolved
only when it is larger than the widest of the jitter families' ranges
(per-tensor, per-head, the k-transform's scales with its offsets fixed, and
fp32-group G = 64's dynamic scales, whichever were run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    # run as a script: make the checkout importable (benchmarks.harness, kvquant)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import accuracy as A
from benchmarks.harness import metrics as M
from benchmarks.harness.dynamic import DynamicFormat
from benchmarks.harness.fp4 import Fp4KV

JITTER_FACTORS = (1.0, 1.01, 1.02, 1.05, 1.10)
"""Scale multipliers of the jitter control (1.0 is the calibrated run itself)."""

STATIC = ("per-tensor", "per-head")
KT = "k-transform"
GROUP_FAMILY = "fp32-group"
FAMILIES = (*STATIC, KT, GROUP_FAMILY)
BAND_FAMILIES = (*STATIC, KT)
"""The jitter families whose spread is noise. fp32-group's is not: with ``s = amax / 448``
the largest value of every group is stored exactly (``448 * s``), and any factor above 1
rounds it, so its scaled runs are systematically worse (measured: reported, not a band)."""
CALIBRATED = "per-head kvquant calibrate ({})"
KT_LABEL = "kvquant calibrate, k-transform"
KT_OFFSET_LABEL = "kvquant calibrate, k-transform offset-only"
GROUPS = (64, 32)
DYNAMIC = (
    DynamicFormat(rotate_k=True),
    DynamicFormat(k_group=32, v_group=32, rotate_k=True),
    DynamicFormat(rotate_k=True, rotate_v=True),
    DynamicFormat(first_tokens=1),
    DynamicFormat(rotate_k=True, first_tokens=1),
    DynamicFormat(k_group=32, v_group=32, rotate_k=True, first_tokens=1),
    DynamicFormat(k_group=16, v_group=64),
    DynamicFormat(k_group=16, v_group=64, rotate_k=True),
    DynamicFormat(recent_tokens=16),
    DynamicFormat(k_group=32, v_group=32, recent_tokens=16),
    DynamicFormat(rotate_k=True, recent_tokens=16),
)
"""The calibration-free formats beside plain fp32-group (:mod:`benchmarks.harness.dynamic`)."""

SECTIONS = (
    "per-tensor",
    "per-head",
    "calibrated",
    "groups",
    "group-jitter",
    "dynamic",
    "k-transform",
    "fp4",
    "recent",
)
"""Parts of the table ``--sections`` picks: the static families, ``kvquant calibrate``'s
formats (per-head both objectives, the k-transform family and offset only), fp32-group
(G = 64 and 32), fp32-group G = 64's scale-jitter family, the calibration-free
:data:`DYNAMIC`, the k-transform alone (Hadamard, unjittered), the 4-bit formats
(:func:`fp4_formats`) and the static formats with each position's newest
:data:`RECENT` tokens exact (:data:`RECENT_ROWS`). The default (the first four) is the
committed table's."""
RECENT = 16
"""``recent_tokens`` of the ``recent`` section's rows (``--recent-tokens``)."""
RECENT_ROWS = ("per-tensor", "per-head", GROUP_FAMILY, KT)
"""The formats the ``recent`` section runs with each position's newest tokens exact
(per-tensor and per-head from the calibration texts' amax, fp32-group G = 64, the
k-transform of ``kvquant calibrate`` with the Hadamard rotation; ``--recent-rows``)."""


def fp4_formats(static: A.CalibratedScales, kt: A.KTransformScales) -> tuple[Fp4KV, ...]:
    """The 4-bit ``kv_format`` rows: NVFP4 and MXFP4 plain, with a fixed Hadamard rotation of K
    (and V), and with the keys in the k-transform's frame (rotation and offset); FP8 K beside
    NVFP4 V with the per-tensor ``amax / 448`` K scale a producer exports, or with the
    k-transform's keys (V plain or rotated). The k-transform rows are K sides
    ``kvquant.patch`` does not combine with 4-bit pages today."""
    return (
        Fp4KV("nvfp4"),
        Fp4KV("nvfp4", rotate_k=True),
        Fp4KV("nvfp4", rotate_k=True, rotate_v=True),
        Fp4KV("nvfp4", k_transform=kt),
        Fp4KV("mxfp4"),
        Fp4KV("mxfp4", rotate_k=True, rotate_v=True),
        Fp4KV("fp8-k-nvfp4-v", k_scales=static),
        Fp4KV("fp8-k-nvfp4-v", k_transform=kt),
        Fp4KV("fp8-k-nvfp4-v", rotate_v=True, k_transform=kt),
        # the newest 16 tokens of each position exact (``recent_tokens=16``)
        Fp4KV("nvfp4", rotate_k=True, rotate_v=True, recent_tokens=16),
        Fp4KV("nvfp4", k_transform=kt, recent_tokens=16),
        Fp4KV("fp8-k-nvfp4-v", k_transform=kt, recent_tokens=16),
    )


def _scaled(scales: A.CalibratedScales, factor: float) -> A.CalibratedScales:
    return A.CalibratedScales(
        k_amax=scales.k_amax * factor, v_amax=scales.v_amax * factor, num_tokens=scales.num_tokens
    )


def _calibrate(model: Any, tokenizer: Any, max_tokens: int) -> tuple[A.CalibratedScales, dict]:
    """amax over every calibration text, each its own forward (at most ``max_tokens``)."""
    from benchmarks.harness.texts import calibration_texts

    k = v = None
    used = {}
    for text in calibration_texts():
        ids = A.tokenize(tokenizer, text.text, max_tokens)
        s = A.calibrate(model, ids)
        k = s.k_amax if k is None else torch.maximum(k, s.k_amax)
        v = s.v_amax if v is None else torch.maximum(v, s.v_amax)
        used[text.name] = int(ids.shape[1])
    if k is None or v is None:
        raise FileNotFoundError("no calibration texts; expected benchmarks/data/texts/calibration")
    return A.CalibratedScales(k_amax=k, v_amax=v, num_tokens=sum(used.values())), used


def _eval_texts(files: Sequence[Path] | None) -> tuple[Any, ...]:
    """The pinned evaluation texts, or the given files (held-out texts) in the given order."""
    from benchmarks.harness.texts import Text, evaluation_texts

    if not files:
        return evaluation_texts()
    return tuple(
        Text(name=f"held-out/{i}-{f.name}", path=f, text=f.read_text(encoding="utf-8"))
        for i, f in enumerate(files)
    )


def _windows(
    tokenizer: Any, length: int, per_text: int, texts: Sequence[Any]
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Up to ``per_text`` consecutive windows of ``length`` tokens from every evaluation text."""
    rows, names = [], []
    for text in texts:
        n = len(tokenizer(text.text)["input_ids"]) // length
        count = min(per_text, n)
        if count == 0:
            raise ValueError(
                f"{text.path} is shorter than one window of {length} tokens; expected at "
                "least one. Fix: pass a smaller --window."
            )
        rows.append(A.tokenize(tokenizer, text.text, length, windows=count))
        names += [text.name] * count
    return torch.cat(rows), tuple(names)


def _run(
    model: Any, ids: torch.Tensor, mode: str, scales: Any = None, group: int | None = None,
    recent: int = 0,
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """Decoder hidden states of one simulated run, and its wall time."""
    t0 = time.perf_counter()
    with A.simulate_fp8_kv(model, mode, scales, group_size=group, recent_tokens=recent):
        hidden = M.decoder_hidden(model, ids)
    return hidden, time.perf_counter() - t0


def _shown_path(path: Path) -> str:
    """``path`` relative to the checkout or to the Python installation's prefix, if inside."""
    for root, shown in ((Path(__file__).resolve().parents[1], ""), (Path(sys.prefix), "$PREFIX/")):
        try:
            return shown + path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
    return str(path)


def _formats(runs: dict[str, Any]) -> list[str]:
    """The compared formats (every run but the jittered ones), in run order."""
    return [k for k, r in runs.items() if r.get("scale_factor", 1.0) == 1.0]


def _statistics(model: Any, tokenizer: Any, max_tokens: int | None) -> tuple[Any, tuple[str, ...]]:
    """``kvquant.calibrate.collect_statistics`` on the calibration texts (each whole, or its
    first ``max_tokens`` tokens), and their names."""
    from benchmarks.harness.texts import calibration_texts
    from kvquant.calibrate import collect_statistics

    texts = calibration_texts()
    inputs = [
        t.text if max_tokens is None else A.tokenize(tokenizer, t.text, max_tokens)[0]
        for t in texts
    ]
    stats = collect_statistics(
        model, inputs, tokenizer=tokenizer, objective="attention", progress=False
    )
    return stats, tuple(t.name for t in texts)


def _k_transform(model: Any, tokenizer: Any, max_tokens: int | None) -> A.KTransformScales:
    """The k-transform (Hadamard) of ``kvquant.calibrate`` on the calibration texts."""
    from kvquant.calibrate import choose_k_transform

    stats, names = _statistics(model, tokenizer, max_tokens)
    return A.KTransformScales.from_result(
        choose_k_transform(stats, rotation="hadamard", texts=names)
    )


def _kvquant_calibrated(
    model: Any, tokenizer: Any, max_tokens: int | None
) -> tuple[dict[str, A.CalibratedScales], dict[str, A.KTransformScales]]:
    """Per-head scales (both objectives) and the k-transform (Hadamard, offset only)
    from ``kvquant.calibrate`` on the calibration texts."""
    from kvquant.calibrate import FP8_E4M3_MAX, choose_k_transform, choose_scales

    stats, names = _statistics(model, tokenizer, max_tokens)
    out = {}
    for objective in ("mse", "attention"):
        res = choose_scales(stats, "per-head", objective=objective, texts=names)
        out[objective] = A.CalibratedScales(
            k_amax=res.k_scales * FP8_E4M3_MAX,
            v_amax=res.v_scales * FP8_E4M3_MAX,
            num_tokens=res.num_tokens,
        )
    kt = {
        label: A.KTransformScales.from_result(
            choose_k_transform(stats, rotation=rotation, texts=names)
        )
        for label, rotation in ((KT_LABEL, "hadamard"), (KT_OFFSET_LABEL, None))
    }
    return out, kt


def _row(metrics: M.RunMetrics) -> dict[str, Any]:
    return {
        "pooled": asdict(metrics.pooled),
        "per_text": {k: asdict(v) for k, v in metrics.per_text.items()},
    }


def _measure_static(args: argparse.Namespace, bench: _Bench, scales: A.CalibratedScales) -> None:
    """The per-tensor and per-head jitter families asked for."""
    for mode in STATIC:
        if mode not in args.sections:
            continue
        for factor in args.factors:
            hidden, sec = _run(bench.model, bench.ids, mode, _scaled(scales, factor))
            label = mode if factor == 1.0 else f"{mode} x{factor:.2f}"
            bench.record(label, hidden, sec, format=mode, scale_factor=factor)


def _measure_calibrated(args: argparse.Namespace, bench: _Bench, tokenizer: Any) -> None:
    per_head, transforms = _kvquant_calibrated(bench.model, tokenizer, args.statistics_tokens)
    for objective, calibrated in per_head.items():
        hidden, sec = _run(bench.model, bench.ids, "per-head", calibrated)
        bench.record(
            CALIBRATED.format(objective), hidden, sec, format="per-head", objective=objective
        )
    for factor in args.factors:
        hidden, sec = _run(bench.model, bench.ids, KT, transforms[KT_LABEL].scaled(factor))
        label = KT_LABEL if factor == 1.0 else f"{KT} x{factor:.2f}"
        bench.record(label, hidden, sec, format=KT, rotation="hadamard", scale_factor=factor)
    hidden, sec = _run(bench.model, bench.ids, KT, transforms[KT_OFFSET_LABEL])
    bench.record(KT_OFFSET_LABEL, hidden, sec, format=KT, rotation=None)


def _measure_dynamic(args: argparse.Namespace, bench: _Bench) -> None:
    """fp32-group (G = 64 with its scale-jitter family when asked, G = 32) and :data:`DYNAMIC`."""
    jitter = "group-jitter" in args.sections
    if "groups" in args.sections:
        for g in GROUPS:
            hidden, sec = _run(bench.model, bench.ids, "fp32-group", group=g)
            extra = {"scale_factor": 1.0} if jitter and g == GROUPS[0] else {}
            bench.record(
                f"fp32-group G={g}", hidden, sec, format=GROUP_FAMILY, group_size=g, **extra
            )
    if jitter:
        for factor in args.factors:
            if factor == 1.0 and "groups" in args.sections:
                continue  # the G = 64 row above
            fmt = DynamicFormat(k_group=GROUPS[0], v_group=GROUPS[0]).scaled(factor)
            hidden, sec = _run(bench.model, bench.ids, "dynamic", fmt)
            label = f"fp32-group G={GROUPS[0]}" if factor == 1.0 else f"fp32-group x{factor:.2f}"
            bench.record(
                label, hidden, sec, format=GROUP_FAMILY, group_size=GROUPS[0], scale_factor=factor
            )
    if "dynamic" in args.sections:
        for fmt in DYNAMIC:
            if args.dynamic_rows and fmt.label not in args.dynamic_rows:
                continue
            hidden, sec = _run(bench.model, bench.ids, "dynamic", fmt)
            bench.record(fmt.label, hidden, sec, format="dynamic", dynamic=asdict(fmt))


def _measure_fp4(
    args: argparse.Namespace, bench: _Bench, static: A.CalibratedScales | None, tokenizer: Any
) -> None:
    """The k-transform alone and the 4-bit formats of :func:`fp4_formats`, when asked."""
    if not {"k-transform", "fp4"} & set(args.sections):
        return
    kt = _k_transform(bench.model, tokenizer, args.statistics_tokens)
    if "k-transform" in args.sections:
        hidden, sec = _run(bench.model, bench.ids, KT, kt)
        bench.record(KT_LABEL, hidden, sec, format=KT, rotation="hadamard")
    if "fp4" in args.sections and static is not None:
        for fmt in fp4_formats(static, kt):
            if args.fp4_rows and fmt.label not in args.fp4_rows:
                continue
            hidden, sec = _run(bench.model, bench.ids, "fp4", fmt)
            bench.record(
                fmt.label,
                hidden,
                sec,
                format=fmt.kv_format,
                rotate_k=fmt.rotate_k,
                rotate_v=fmt.rotate_v,
                k_transform=fmt.k_transform is not None,
                recent_tokens=fmt.recent_tokens,
            )


def _measure_recent(
    args: argparse.Namespace, bench: _Bench, static: A.CalibratedScales | None, tokenizer: Any
) -> None:
    """The formats of :data:`RECENT_ROWS` with each position's newest tokens exact."""
    if "recent" not in args.sections or static is None:
        return
    n = args.recent_tokens
    for mode in args.recent_rows or RECENT_ROWS:
        scales: Any = static
        if mode == KT:
            scales = _k_transform(bench.model, tokenizer, args.statistics_tokens)
        elif mode == GROUP_FAMILY:
            scales = None
        group = GROUPS[0] if mode == GROUP_FAMILY else None
        hidden, sec = _run(bench.model, bench.ids, mode, scales, group=group, recent=n)
        name = {KT: KT_LABEL, GROUP_FAMILY: f"fp32-group G={GROUPS[0]}"}.get(mode, mode)
        bench.record(f"{name} recent-{n}", hidden, sec, format=mode, recent_tokens=n)


class _Bench:
    """The evaluation tokens, the reference run and every run recorded so far."""

    def __init__(self, args: argparse.Namespace, model: Any, ids: torch.Tensor, texts: Any):
        self.args, self.model, self.ids = args, model, ids
        self.layout = M.BlockLayout(texts, ids.shape[1] - 1, args.block)
        self.draws = M.bootstrap_draws(self.layout, args.resamples, args.seed)
        self.ref_hidden, self.ref_seconds = _run(model, ids, "none")
        self.runs: dict[str, dict[str, Any]] = {}
        self.boots: dict[str, dict[str, torch.Tensor]] = {}

    def record(self, label: str, hidden: torch.Tensor, seconds: float, **extra: Any) -> None:
        """Compare one run with the reference, keep its metrics and bootstrap draws, print it."""
        args = self.args
        stats = M.compare_hidden(self.model, self.ref_hidden, hidden, self.ids)
        summary = M.summarize(stats, self.layout, resamples=args.resamples, seed=args.seed)
        self.boots[label] = M.metric_draws(stats, self.layout, self.draws)
        self.runs[label] = {**extra, "seconds": round(seconds, 1), **_row(summary)}
        p = summary.pooled
        print(
            f"{label:28s} KL {p.kl_mean:.5f} (p99 {p.kl_p99:.4f})  top-1 {100 * p.top1:.2f} %  "
            f"ppl {p.ppl_delta_pct:+.2f} %  [{seconds:.0f} s]",
            flush=True,
        )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every format and the jitter families; return the JSON payload."""
    import transformers

    from benchmarks.harness.smollm2 import load_smollm2

    torch.manual_seed(0)
    started = time.perf_counter()
    model, tokenizer = load_smollm2(args.model)
    calib_used: dict[str, int] = {}
    texts = _eval_texts(args.eval_files)
    ids, window_texts = _windows(tokenizer, args.window, args.windows_per_text, texts)
    bench = _Bench(args, model, ids, window_texts)
    layout, runs, boots = bench.layout, bench.runs, bench.boots
    scales = None
    if {*STATIC, "fp4", "recent"} & set(args.sections):  # amax of the calibration texts
        scales, calib_used = _calibrate(model, tokenizer, args.calibration_tokens)
        _measure_static(args, bench, scales)
    if args.calibrated and "calibrated" in args.sections:
        _measure_calibrated(args, bench, tokenizer)
    _measure_dynamic(args, bench)
    _measure_fp4(args, bench, scales, tokenizer)
    _measure_recent(args, bench, scales, tokenizer)

    jitter, band, comparisons = jitter_control(runs, boots)
    return {
        "command": "python -m benchmarks.accuracy_table " + " ".join(args.argv),
        "model": "SmolLM2-135M-Instruct (benchmarks/harness/smollm2.py), fp32 on CPU",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "method": (
            "simulation: simulate_fp8_kv rounds K/V through float8_e4m3fn in every attention "
            "call of one teacher-forced forward (every position reads every key and value from "
            "FP8, each window's first position included); metrics against the unquantized "
            "model's next-token distribution on the same tokens"
            + (
                "; the 4-bit rows (mode fp4) round K/V through kvquant.kernels.fp4.quantize_fp4's "
                "codes (NVFP4 global scale DYNAMIC_NVFP4_GLOBAL_SCALE, as kv_format= uses), "
                "rot-K / rot-KV: Hadamard rotation of q and K (and V, output rotated back)"
                if "fp4" in args.sections
                else ""
            )
        ),
        "calibration": {
            "texts": calib_used,
            "scales": "amax / 448 of post-RoPE K/V",
            "k-transform": "kvquant.calibrate.choose_k_transform on the calibration texts: "
            "per-channel mean offset of K (Hadamard-rotated, or not: offset-only), first token "
            "of each window left out and attended exactly, K scale = amax of k R - c / 448 per "
            "head, V per-head (mse clipping search)",
            **(
                {"statistics_tokens_per_text": args.statistics_tokens}
                if args.statistics_tokens is not None
                else {}
            ),
        },
        "evaluation": {
            "window_tokens": args.window,
            "windows": list(window_texts),
            "texts": {
                t.name: {
                    "path": _shown_path(t.path),
                    "sha256": t.digest,
                    "tokens": len(tokenizer(t.text)["input_ids"]),
                }
                for t in texts
            },
            "scored_positions": layout.num_positions,
            "positions_per_text": {t: int(layout.text_mask(t).sum()) for t in layout.texts},
        },
        "bootstrap": {
            "block_positions": args.block,
            "resamples": args.resamples,
            "seed": args.seed,
            "scheme": "blocks resampled with replacement within each text; paired across runs",
        },
        "sections": list(args.sections),
        "jitter_rule": (
            "a gap is resolved (exceeds_jitter) when |gap| > the widest range (max - min) of the "
            "jitter families run (per-tensor, per-head, k-transform, fp32-group G=64: scales x "
            + ", ".join(f"{f:.2f}" for f in args.factors)
            + ")"
        ),
        "reference_seconds": round(bench.ref_seconds, 1),
        "runs": runs,
        "jitter": jitter,
        "jitter_band": band,
        "comparisons": comparisons,
        "total_seconds": round(time.perf_counter() - started, 1),
    }


def jitter_control(
    runs: dict[str, dict[str, Any]],
    boots: dict[str, dict[str, torch.Tensor]] | None,
    other_band: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, float], list[dict[str, Any]]]:
    """Spread of every metric over each jitter family, and every pairwise format gap.

    Args:
        runs: label -> run record (``"format"``, ``"scale_factor"`` for the jitter
            runs, ``"pooled"`` metrics), in run order.
        boots: label -> :func:`benchmarks.harness.metrics.metric_draws` on shared draws,
            or None (no paired SE).
        other_band: a band measured in another run on the same tokens, widened into this one.

    Returns:
        ``(jitter, band, comparisons)``: per jitter family the factors, whether it counts
        in the band (:data:`BAND_FAMILIES`) and :func:`~benchmarks.harness.metrics.spread`
        of each metric; per metric the widest of the counted families' ranges (NaN when
        none ran); per pair of formats and metric the gap ``a - b``, its paired bootstrap
        SE, the band and whether ``|gap|`` exceeds it.
    """
    names = (*M.METRICS, "kl_p99")
    jitter: dict[str, Any] = {}
    for mode in FAMILIES:
        family = [r for r in runs.values() if r.get("format") == mode and "scale_factor" in r]
        if len(family) < 2:
            continue
        jitter[mode] = {
            "factors": [r["scale_factor"] for r in family],
            "in_band": mode in BAND_FAMILIES,
            **{m: M.spread([r["pooled"][m] for r in family]) for m in names},
        }
    counted = [j for j in jitter.values() if j["in_band"]]
    band = {
        m: max([j[m]["range"] for j in counted] + ([other_band[m]] if other_band else []))
        if counted or other_band
        else float("nan")
        for m in names
    }
    comparisons = []
    for a, b in itertools.combinations(_formats(runs), 2):
        row: dict[str, Any] = {"a": a, "b": b}
        for m in names:
            gap = runs[a]["pooled"][m] - runs[b]["pooled"][m]
            entry = {"gap": gap, "jitter_range": band[m], "exceeds_jitter": abs(gap) > band[m]}
            if m in M.METRICS and boots is not None:
                entry["paired_se"] = float((boots[a][m] - boots[b][m]).std())
            row[m] = entry
        comparisons.append(row)
    return jitter, band, comparisons


def rejudge(payload: dict[str, Any], other: dict[str, Any] | None, command: str) -> dict[str, Any]:
    """Recompute the jitter families, the band and the comparisons of a written table.

    The runs and their paired SEs are kept; ``other`` (a table on the same tokens, e.g. the
    committed one with the static families) widens the band with its own. ``command`` is
    recorded as ``"rejudged_by"``.
    """
    se = {(c["a"], c["b"]): c for c in payload["comparisons"]}
    other_band = other["jitter_band"] if other else None
    jitter, band, comparisons = jitter_control(payload["runs"], None, other_band)
    for row in comparisons:
        for m in M.METRICS:
            old = se.get((row["a"], row["b"]), {}).get(m, {})
            if "paired_se" in old:
                row[m]["paired_se"] = old["paired_se"]
    band_source = {k: v for k, v in jitter.items() if v["in_band"]}
    return {
        **payload,
        "jitter": jitter,
        "jitter_band": band,
        "jitter_band_from": sorted(band_source)
        + (["band of " + other["command"]] if other else []),
        "comparisons": comparisons,
        "rejudged_by": command,
    }


def plot(payload: dict[str, Any], path: str | Path) -> None:
    """KL divergence and top-1 agreement by format, with the static formats' jitter bands.

    One row per format (its name on the left, readable at page width), the two metrics
    stacked; a static format's band spans its jitter family (scales x 1.00 ... 1.10, the
    runs drawn as small dots); the per-head runs of ``kvquant calibrate`` are drawn over
    the per-head band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11})
    runs = payload["runs"]
    formats = _formats(runs)
    y = list(range(len(formats)))[::-1]  # the first format at the top
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 8.8), sharey=True)
    panels = (
        ("kl_mean", "mean KL to unquantized (nats, lower is better)", 1.0),
        ("top1", "top-1 agreement (%, higher is better)", 100.0),
    )
    for ax, (metric, title, mult) in zip(axes, panels, strict=True):
        for row, name in zip(y, formats, strict=True):
            pooled = runs[name]["pooled"]
            ax.errorbar(
                mult * pooled[metric],
                row,
                xerr=mult * pooled["se"][metric],
                fmt="o",
                color="C0",
                capsize=4,
                zorder=3,
                label="run (block-bootstrap SE)" if row == y[0] else None,
            )
            fmt = runs[name].get("format")
            family = fmt if fmt in payload["jitter"] else None
            if family is None:
                continue
            j = payload["jitter"][family][metric]
            ax.fill_betweenx(
                [row - 0.3, row + 0.3],
                mult * j["min"],
                mult * j["max"],
                color="C1",
                alpha=0.35,
                zorder=2,
                label="jitter band (scales x 1.00-1.10)" if row == y[0] else None,
            )
            if "scale_factor" in runs[name]:
                values = [
                    r["pooled"][metric]
                    for r in runs.values()
                    if r.get("format") == family and "scale_factor" in r
                ]
                ax.scatter(
                    [mult * v for v in values], [row] * len(values), s=12, color="C1", zorder=2
                )
        ax.set_yticks(y, [_label(f) for f in formats])
        ax.set_title(title, fontsize=11)
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=9)
    n = payload["evaluation"]["scored_positions"]
    fig.suptitle(f"SmolLM2-135M, simulated FP8 K/V, {n} scored positions", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label(name: str) -> str:
    """A format's name on one line for the plot's rows."""
    return (
        name.replace("kvquant calibrate, k-transform", "k-transform")
        .replace(" kvquant calibrate (", ", calibrated (")
        .replace(" offset-only", ", no rotation")
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: measure, write the JSON, optionally plot.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy_table",
        description="KL divergence, top-1 agreement and perplexity change of simulated FP8 KV "
        "formats on SmolLM2-135M, beside a scale-jitter control.",
    )
    parser.add_argument("--out", required=True, metavar="FILE.json")
    parser.add_argument("--plot", metavar="FILE.png", default=None)
    parser.add_argument("--from-json", action="store_true", help="only plot the --out file")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="SmolLM2-135M bf16 folder (default: smollm2_path(), fetched on first use)",
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per evaluation window")
    parser.add_argument("--windows-per-text", type=int, default=3)
    parser.add_argument("--calibration-tokens", type=int, default=4096, help="per calibration text")
    parser.add_argument(
        "--statistics-tokens",
        type=int,
        default=None,
        help="kvquant calibrate's statistics (the calibrated rows, the k-transform): the first "
        "this many tokens of each calibration text (default: every token)",
    )
    parser.add_argument("--block", type=int, default=64, help="bootstrap block (positions)")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sections",
        default="per-tensor,per-head,calibrated,groups",
        help="comma-separated parts of the table: per-tensor, per-head, calibrated, groups, "
        "group-jitter (fp32-group G=64 with its scales jittered), dynamic (the calibration-free "
        "formats of DYNAMIC); default: the committed table's",
    )
    parser.add_argument(
        "--jitter-factors",
        default=",".join(str(f) for f in JITTER_FACTORS),
        help="scale multipliers of every jitter family, the first 1.0",
    )
    parser.add_argument(
        "--eval-files",
        type=Path,
        nargs="+",
        default=None,
        help="evaluate on these text files (held-out texts) instead of the pinned evaluation set",
    )
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="recompute the jitter band and the comparisons of the --out file (its runs and "
        "paired SEs kept) and write it back; nothing is measured",
    )
    parser.add_argument(
        "--band-from",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="with --rejudge: widen the band with this table's (same evaluation tokens)",
    )
    parser.add_argument(
        "--fp4-rows",
        default="",
        metavar="LABEL;LABEL",
        help="with --sections fp4: only these rows (their labels, ';'-separated, e.g. "
        "'fp8-k-nvfp4-v (K k-transform)'); default: every row",
    )
    parser.add_argument(
        "--dynamic-rows",
        default="",
        metavar="LABEL;LABEL",
        help="with --sections dynamic: only these rows (their labels, ';'-separated, e.g. "
        "'dynamic G=64 recent-16'); default: every row",
    )
    parser.add_argument(
        "--recent-tokens",
        type=int,
        default=RECENT,
        help=f"with --sections recent: the newest tokens read exactly (default {RECENT})",
    )
    parser.add_argument(
        "--recent-rows",
        default="",
        metavar="FORMAT,FORMAT",
        help=f"with --sections recent: only these of {RECENT_ROWS}; default: every one",
    )
    parser.add_argument(
        "--no-calibrated",
        dest="calibrated",
        action="store_false",
        help="skip the per-head scales of kvquant calibrate (objectives mse and attention)",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    args.sections = tuple(x for x in args.sections.split(",") if x)
    args.fp4_rows = tuple(x for x in args.fp4_rows.split(";") if x)
    placeholder: Any = object()  # the labels depend on the rows' flags only
    rows = {fmt.label for fmt in fp4_formats(placeholder, placeholder)}
    if set(args.fp4_rows) - rows:
        parser.error(
            f"--fp4-rows {sorted(set(args.fp4_rows) - rows)} unknown; rows: {sorted(rows)}"
        )
    args.dynamic_rows = tuple(x for x in args.dynamic_rows.split(";") if x)
    if set(args.dynamic_rows) - {fmt.label for fmt in DYNAMIC}:
        parser.error(
            f"--dynamic-rows {sorted(set(args.dynamic_rows) - {f.label for f in DYNAMIC})} "
            f"unknown; rows: {sorted(f.label for f in DYNAMIC)}"
        )
    args.recent_rows = tuple(x for x in args.recent_rows.split(",") if x)
    if set(args.recent_rows) - set(RECENT_ROWS) or args.recent_tokens < 1:
        parser.error(
            f"--recent-rows {args.recent_rows} / --recent-tokens {args.recent_tokens}: expected "
            f"formats from {RECENT_ROWS} and at least 1 token"
        )
    unknown = set(args.sections) - set(SECTIONS)
    args.factors = tuple(float(f) for f in args.jitter_factors.split(","))
    if unknown or not args.factors or args.factors[0] != 1.0:
        parser.error(
            f"--sections {sorted(unknown)} unknown (expected some of {SECTIONS}) or "
            "--jitter-factors not starting with 1.0"
        )
    if args.from_json or args.rejudge:
        payload = json.loads(Path(args.out).read_text(encoding="utf-8"))
    else:
        payload = measure(args)
    if args.rejudge:
        other = json.loads(args.band_from.read_text(encoding="utf-8")) if args.band_from else None
        payload = rejudge(payload, other, "python -m benchmarks.accuracy_table " + " ".join(argv))
    if args.rejudge or not args.from_json:
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(payload, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
