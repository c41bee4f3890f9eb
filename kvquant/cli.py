"""The ``kvquant`` command line (also ``python -m kvquant``).

Subcommands:

* ``kvquant doctor PATH``: read a checkpoint's KV scales (headers and scale
  tensors only, never the weights) and print, per layer, what kvquant would do
  with them: use, convert or reject, and why. Exit code 0 when the checkpoint
  would load, 1 when any layer (or the checkpoint) would be rejected, 2 on a
  usage error (missing path, not a checkpoint, bad option).
* ``kvquant demo``: build tiny checkpoints in each producer's convention in a
  temporary folder and walk through what the doctor says about each.
* ``kvquant export PATH --engine vllm|sglang|tensorrt-llm --out DIR``: write a
  copy of the checkpoint whose KV scales follow that engine's loader (names,
  shapes, fp32, config keys); see :mod:`kvquant.export`. Exit code 0 when
  written, 1 when the checkpoint cannot be exported for that engine (nothing is
  written), 2 on a usage error (not a checkpoint, ``--out`` exists without
  ``--force``).
* ``kvquant calibrate MODEL_DIR --out DIR``: run the model over real
  calibration text, choose static FP8 K/V scales by the expected quantization
  error they cause and write a copy of the checkpoint carrying them in a
  producer convention (see :mod:`kvquant.calibrate`). Exit code 0 when written,
  1 when the model or the requested convention cannot be calibrated (nothing
  is written), 2 on a usage error (not a checkpoint, no tokenizer, unreadable
  text, ``--out`` exists without ``--force``).

The demo is a list of steps (:data:`DEMO_STEPS`); later features append steps
(load, patch, generate) with :func:`add_demo_step`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvquant.errors import KVQuantError

__all__ = [
    "DEMO_STEPS",
    "DemoCheckpoint",
    "DemoContext",
    "DemoStep",
    "add_demo_step",
    "build_parser",
    "main",
    "run_demo",
]

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_USAGE = 2

_DOCTOR_OPTIONS = ("scale_format", "missing_scales", "missing_kv", "group_size", "rope_policy")


# ---------------------------------------------------------------------------
# doctor


def _doctor(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.report import inspect_checkpoint

    options: dict[str, Any] = {
        name: getattr(args, name) for name in _DOCTOR_OPTIONS if getattr(args, name) is not None
    }
    try:
        report = inspect_checkpoint(args.path, **options)
    except KVQuantError as exc:
        # CheckpointError (not a checkpoint) or an option the registry refuses
        print(f"kvquant doctor: error: {exc}", file=err)
        return EXIT_USAGE
    if args.json:
        print(report.to_json(), file=out)
    else:
        print(report.render(), file=out)
    return report.exit_code


# ---------------------------------------------------------------------------
# export


def _export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.errors import CheckpointError
    from kvquant.export import ExportTargetExistsError, export_checkpoint

    granularity = "per-head" if args.per_head else args.granularity
    try:
        report = export_checkpoint(
            args.path,
            args.out,
            engine=args.engine,
            granularity=granularity,
            rope_policy=args.rope_policy,
            missing_kv=args.missing_kv,
            force=args.force,
            link=not args.copy,
        )
    except (CheckpointError, ExportTargetExistsError) as exc:
        print(f"kvquant export: error: {exc}", file=err)
        return EXIT_USAGE
    except KVQuantError as exc:
        # ExportError (the engine cannot take it) or the registry's ScaleFormatError
        print(f"kvquant export: refused: {exc}", file=err)
        return EXIT_REJECTED
    print(report.to_json() if args.json else report.render(), file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# calibrate


def _load_for_calibration(path: str) -> tuple[Any, Any]:
    """Load the model (fp32, its quantization_config dropped) and tokenizer of a folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            del holder.quantization_config  # KV scales are replaced; weights load as floats
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _calibration_texts(files: Sequence[Path] | None) -> tuple[list[str], list[str]]:
    from kvquant.errors import CheckpointError

    if not files:
        from kvquant.testing.texts import calibration_text

        text = calibration_text()
        return [text.text], [f"{text.name} ({text.path})"]
    texts, names = [], []
    for file in files:
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"--text {file} could not be read as UTF-8 text ({exc}). Fix: pass a readable "
                "plain-text file."
            ) from exc
        names.append(str(file))
    return texts, names


def _at_least_two(text: str) -> int:
    """argparse type: an integer >= 2 (token counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} is too small; expected at least 2 tokens")
    return value


def _calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.calibrate import calibrate, write_calibrated_checkpoint
    from kvquant.errors import CheckpointError
    from kvquant.export import ExportTargetExistsError
    from kvquant.registry.discovery import discover_scales

    if args.granularity == "per-head" and args.convention != "compressed-tensors":
        print(
            f"kvquant calibrate: error: --format per-head is stored by the compressed-tensors "
            f"convention only (strategy attn_head), not {args.convention}. Fix: drop "
            "--convention or use --format per-tensor.",
            file=err,
        )
        return EXIT_USAGE
    try:
        discover_scales(args.path)
        if (args.out.exists() or args.out.is_symlink()) and not args.force:
            raise ExportTargetExistsError(
                f"{args.out} already exists; expected a new folder. Fix: pass another --out, "
                "or --force to replace it."
            )
        texts, names = _calibration_texts(args.text)
    except KVQuantError as exc:  # CheckpointError, ExportTargetExistsError, TextNotFoundError
        print(f"kvquant calibrate: error: {exc}", file=err)
        return EXIT_USAGE
    try:
        model, tokenizer = _load_for_calibration(args.path)
    except (OSError, ValueError, KeyError) as exc:
        print(
            f"kvquant calibrate: error: could not load the model and tokenizer of {args.path} "
            f"with transformers ({type(exc).__name__}: {exc}). Fix: pass a folder that "
            "AutoModelForCausalLM and AutoTokenizer load (tokenizer files included).",
            file=err,
        )
        return EXIT_USAGE
    try:
        result = calibrate(
            model,
            texts,
            granularity=args.granularity,
            tokenizer=tokenizer,
            window=args.window,
            max_tokens=args.max_tokens,
            tolerance=args.tolerance,
            objective=args.objective,
            progress=True,
            text_names=names,
        )
        written = write_calibrated_checkpoint(
            args.path, result, args.out, args.convention, force=args.force
        )
    except (CheckpointError, ExportTargetExistsError) as exc:
        print(f"kvquant calibrate: error: {exc}", file=err)
        return EXIT_USAGE
    except KVQuantError as exc:  # CalibrationError, UnsupportedModelError, ExportError
        print(f"kvquant calibrate: refused: {exc}", file=err)
        return EXIT_REJECTED
    if args.json:
        import json

        payload = {"out": str(written), "convention": args.convention, **result.to_dict()}
        print(json.dumps(payload, indent=2, allow_nan=False), file=out)
    else:
        print(result.render(), file=out)
        print(f"\nwrote {written} ({args.convention} convention, {result.granularity})", file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# demo


@dataclass(frozen=True)
class DemoCheckpoint:
    """One checkpoint the demo builds.

    Attributes:
        key: short identifier (``"ct-tensor"``, ...).
        title: one line naming the producer and variant.
        story: what a newcomer should learn from it.
        options: keyword arguments of
            :func:`kvquant.testing.checkpoints.write_checkpoint`.
        plain_loadable: whether plain transformers ``from_pretrained`` gives a
            correct model (False for ModelOpt FP8 weights, which it upcasts
            without their weight scales). Later steps that load models skip the others.
    """

    key: str
    title: str
    story: str
    options: dict[str, Any]
    plain_loadable: bool = True


@dataclass
class DemoContext:
    """State shared by the demo steps.

    Attributes:
        workdir: the temporary folder the checkpoints live in.
        out: where the story is printed.
        checkpoints: key -> (demo checkpoint, its folder), filled by the build step.
        reports: key -> :class:`kvquant.report.CheckpointReport`, filled by the doctor step.
        extra: free space for later steps.
    """

    workdir: Path
    out: TextIO
    checkpoints: dict[str, tuple[DemoCheckpoint, Path]] = field(default_factory=dict)
    reports: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def say(self, text: str = "", *, wrap: bool = True) -> None:
        """Print one paragraph of the story (wrapped at 100 columns unless ``wrap=False``)."""
        if wrap and "\n" not in text and len(text) > 100:
            text = textwrap.fill(text, width=100, break_on_hyphens=False)
        print(text, file=self.out)


@dataclass(frozen=True)
class DemoStep:
    """A titled step of ``kvquant demo``.

    Attributes:
        title: shown as a heading.
        run: the step; reads and fills the :class:`DemoContext`.
    """

    title: str
    run: Callable[[DemoContext], None]


def _broken_per_query_head() -> dict[str, Any]:
    import torch

    # layer 0's K scale exported per *query* head (4) instead of per KV head (2)
    return {
        "convention": "compressed-tensors",
        "scales": {(0, "k"): torch.full((4,), 0.02, dtype=torch.bfloat16)},
    }


def _broken_nan() -> dict[str, Any]:
    import torch

    return {"convention": "modelopt", "scales": {(1, "v"): torch.tensor(float("nan"))}}


DEMO_CHECKPOINTS: tuple[DemoCheckpoint, ...] = (
    DemoCheckpoint(
        "ct-tensor",
        "llm-compressor / compressed-tensors, strategy 'tensor'",
        "One bf16 scale of shape (1,) per K and per V: kvquant casts it to fp32 and uses it.",
        {"convention": "compressed-tensors"},
    ),
    DemoCheckpoint(
        "ct-attn_head",
        "llm-compressor / compressed-tensors, strategy 'attn_head'",
        "One bf16 scale per KV head, shape (Hkv, 1, 1): kvquant keeps one fp32 scale per head.",
        {"convention": "compressed-tensors", "granularity": "per-head"},
    ),
    DemoCheckpoint(
        "modelopt",
        "NVIDIA ModelOpt, FP8 KV only",
        "0-dim fp32 scales named k_proj.k_scale / v_proj.v_scale: used exactly as stored.",
        {"convention": "modelopt"},
    ),
    DemoCheckpoint(
        "modelopt-fp8",
        "NVIDIA ModelOpt, FP8 weights + FP8 KV",
        "Same KV scales, but the Linear weights are FP8 with weight_scale / input_scale beside "
        "them. Those are not KV scales and discovery skips them; the doctor warns that plain "
        "transformers would load these weights without their scales (a silently broken model).",
        {"convention": "modelopt", "fp8_weights": True},
        plain_loadable=False,
    ),
    DemoCheckpoint(
        "quark",
        "AMD Quark, default export (pre-RoPE, merged)",
        "Quark measures K before RoPE and stores max(K, V) in both tensors; RoPE can push keys "
        "up to sqrt(2) higher, so kvquant's policy decides whether to widen K.",
        {"convention": "quark"},
    ),
    DemoCheckpoint(
        "legacy",
        "legacy single kv_scale",
        "One scale per layer serves both K and V; kvquant says so.",
        {"convention": "legacy-kv_scale"},
    ),
    DemoCheckpoint(
        "broken-shape",
        "broken: a K scale per query head",
        "Layer 0's K scale has 4 values but the model has 2 KV heads: other engines keep element "
        "[0] or crash obscurely; kvquant rejects it and says what it expected.",
        {},
    ),
    DemoCheckpoint(
        "broken-nan",
        "broken: a NaN V scale",
        "A calibration that diverged left NaN in layer 1's V scale; kvquant rejects it instead of "
        "filling the cache with NaN.",
        {},
    ),
)


def _demo_options(ckpt: DemoCheckpoint) -> dict[str, Any]:
    if ckpt.key == "broken-shape":
        return _broken_per_query_head()
    if ckpt.key == "broken-nan":
        return _broken_nan()
    return dict(ckpt.options)


def _step_build(ctx: DemoContext) -> None:
    from tqdm import tqdm

    from kvquant.testing.checkpoints import write_checkpoint

    ctx.say(
        "kvquant reads the FP8 KV-cache scales that quantization tools store in a checkpoint. "
        "Each tool names, shapes and types them differently. This demo writes tiny random "
        f"Llama checkpoints (2 layers, 4 query heads, 2 KV heads, head_dim 16) under {ctx.workdir}, "
        "one per producer convention, plus two broken ones."
    )
    for ckpt in tqdm(DEMO_CHECKPOINTS, desc="writing checkpoints", unit="ckpt", file=sys.stderr):
        path = write_checkpoint(ctx.workdir / ckpt.key, **_demo_options(ckpt))
        ctx.checkpoints[ckpt.key] = (ckpt, path)


def _step_doctor(ctx: DemoContext) -> None:
    from kvquant.report import inspect_checkpoint

    ctx.say(
        "For each checkpoint, `kvquant doctor PATH` reads config.json and the safetensors headers, "
        "loads only the scale tensors (never the weights) and shows what kvquant would do with "
        "every layer's K and V scale: use it as is, convert it (e.g. bf16 -> fp32), or reject it."
    )
    for key, (ckpt, path) in ctx.checkpoints.items():
        report = inspect_checkpoint(path)
        ctx.reports[key] = report
        ctx.say()
        ctx.say(f"--- {ckpt.title} ({key}) ---")
        ctx.say(ckpt.story)
        ctx.say(f"$ kvquant doctor {path}", wrap=False)
        ctx.say(report.render(), wrap=False)
        ctx.say(f"(exit code {report.exit_code})")


def _step_summary(ctx: DemoContext) -> None:
    ctx.say("Summary: what kvquant would do with each checkpoint")
    width = max((len(k) for k in ctx.reports), default=4)
    for key, report in ctx.reports.items():
        verdict = "loads" if report.ok else "REJECTED"
        ctx.say(f"  {key:<{width}}  {verdict:<8}  {report.summary}", wrap=False)
    ctx.say()
    ctx.say(
        "Try it on your own checkpoint: `kvquant doctor /path/to/model` "
        "(add --json for machines, --scale-format per-tensor to see a lossy reduction)."
    )


DEMO_STEPS: list[DemoStep] = [
    DemoStep("Write one tiny checkpoint per producer", _step_build),
    DemoStep("Ask the doctor about each", _step_doctor),
    DemoStep("Summary", _step_summary),
]
"""The demo's steps, run in order. Append with :func:`add_demo_step`."""


def add_demo_step(
    title: str, run: Callable[[DemoContext], None], *, before: str | None = None
) -> DemoStep:
    """Add a step to ``kvquant demo`` (at the end, or before the step titled ``before``).

    Args:
        title: heading printed before the step.
        run: the step function; receives the shared :class:`DemoContext`.
        before: title of an existing step to insert before (e.g. ``"Summary"``).

    Returns:
        The new step.

    Raises:
        ValueError: ``before`` names no step.
    """
    step = DemoStep(title, run)
    if before is None:
        DEMO_STEPS.append(step)
        return step
    for i, existing in enumerate(DEMO_STEPS):
        if existing.title == before:
            DEMO_STEPS.insert(i, step)
            return step
    raise ValueError(f"no demo step titled {before!r}; steps are {[s.title for s in DEMO_STEPS]}")


def run_demo(
    out: TextIO | None = None,
    *,
    workdir: Path | None = None,
    steps: Sequence[DemoStep] | None = None,
) -> DemoContext:
    """Run the demo steps and print the story.

    Args:
        out: where to print (default stdout).
        workdir: keep the checkpoints in this folder (default: a temporary
            folder deleted afterwards).
        steps: the steps to run (default :data:`DEMO_STEPS`).

    Returns:
        The context after the last step (checkpoint paths may be gone when
        ``workdir`` was not given).
    """
    stream = out if out is not None else sys.stdout
    chosen = list(steps if steps is not None else DEMO_STEPS)
    started = time.perf_counter()

    def _run(folder: Path) -> DemoContext:
        ctx = DemoContext(workdir=folder, out=stream)
        for i, step in enumerate(chosen, 1):
            ctx.say()
            ctx.say(f"== Step {i}/{len(chosen)}: {step.title} ==")
            step.run(ctx)
        ctx.say()
        ctx.say(f"(demo finished in {time.perf_counter() - started:.1f} s)")
        return ctx

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        return _run(workdir)
    with tempfile.TemporaryDirectory(prefix="kvquant-demo-") as tmp:
        return _run(Path(tmp))


def _demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    run_demo(out, workdir=args.keep)
    return EXIT_OK


# ---------------------------------------------------------------------------
# parser


class _Parser(argparse.ArgumentParser):
    """argparse with exit code 2 and the message on the given stream (the argparse default)."""


def build_parser() -> argparse.ArgumentParser:
    """Build the ``kvquant`` argument parser (one subparser per subcommand).

    Returns:
        The parser; ``parse_args`` sets ``func`` to the subcommand handler.
    """
    parser = _Parser(
        prog="kvquant",
        description="A real FP8 paged KV cache for Hugging Face transformers: checkpoint KV "
        "scales, strict normalisation, Triton kernels.",
    )
    from kvquant import __version__

    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = sub.add_parser(
        "doctor",
        help="show, per layer, what kvquant would do with a checkpoint's KV scales",
        description="Read a checkpoint's KV scales (config, safetensors headers and the scale "
        "tensors only; never the weights) and print, per layer, the producer convention, the "
        "format chosen, the raw shape/dtype/range and the action: use, convert or reject, "
        "and why. Exit code: 0 the checkpoint would load, 1 a layer (or the checkpoint) "
        "would be rejected, 2 usage error (missing path, not a checkpoint).",
    )
    doctor.add_argument("path", help="checkpoint folder (holding config.json and *.safetensors)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--scale-format",
        dest="scale_format",
        default=None,
        help="scale format to resolve to: auto (default), per-tensor, per-head, fp32-group, "
        "or a registered format's name",
    )
    doctor.add_argument(
        "--missing-scales",
        dest="missing_scales",
        default=None,
        choices=("dynamic", "error", "unit"),
        help="when the checkpoint has no KV scales: dynamic fp32-group scales (default), "
        "error, or unit (1.0, warned)",
    )
    doctor.add_argument(
        "--missing-kv",
        dest="missing_kv",
        default=None,
        choices=("error", "reuse"),
        help="when a layer has only K or only V: error (default) or reuse the one present",
    )
    doctor.add_argument(
        "--group-size",
        dest="group_size",
        type=int,
        default=None,
        help="fp32-group group size (a divisor of head_dim; default 64 capped at head_dim)",
    )
    doctor.add_argument(
        "--rope-policy",
        dest="rope_policy",
        default=None,
        choices=("widen", "keep"),
        help="for K scales calibrated before RoPE (Quark default): widen by sqrt(2) (default) "
        "or keep as stored",
    )
    doctor.set_defaults(func=_doctor)

    demo = sub.add_parser(
        "demo",
        help="build tiny checkpoints in every producer convention and explain each",
        description="Write tiny random Llama checkpoints, one per producer convention (plus "
        "broken ones), into a temporary folder and run the doctor on each, as a story.",
    )
    demo.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the checkpoints into DIR and keep them (default: a temporary folder)",
    )
    demo.set_defaults(func=_demo)

    export = sub.add_parser(
        "export",
        help="write a copy of a checkpoint whose KV scales a serving engine's loader accepts",
        description="Read the checkpoint's KV scales (discovery + the registry), then write a "
        "copy into OUT whose KV-scale tensors (names, shapes, fp32) and quantization config "
        "follow the engine's loader. Weight shards without KV scales are hard-linked (or "
        "copied); shards holding scales are re-saved with every other tensor unchanged. "
        "Exit code: 0 written, 1 refused (nothing written), 2 usage error.",
    )
    export.add_argument("path", help="source checkpoint folder (config.json + *.safetensors)")
    export.add_argument(
        "--engine", required=True, choices=("vllm", "sglang", "tensorrt-llm"), help="target engine"
    )
    export.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    export.add_argument(
        "--granularity",
        default="per-tensor",
        choices=("per-tensor", "per-head"),
        help="per-tensor (every engine; per-head scales reduced with max, cost reported) or "
        "per-head (vLLM compressed-tensors attn_head only)",
    )
    export.add_argument(
        "--per-head", action="store_true", help="same as --granularity per-head (vLLM only)"
    )
    export.add_argument(
        "--rope-policy",
        dest="rope_policy",
        default="widen",
        choices=("widen", "keep"),
        help="K scales calibrated before RoPE (Quark default): widen by sqrt(2) (default) or "
        "export as stored (warned)",
    )
    export.add_argument(
        "--missing-kv",
        dest="missing_kv",
        default="error",
        choices=("error", "reuse"),
        help="a layer with only K or only V: error (default) or reuse the one present",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists (after the new copy is complete)",
    )
    export.add_argument(
        "--copy", action="store_true", help="copy unchanged files instead of hard-linking them"
    )
    export.add_argument("--json", action="store_true", help="print the export report as JSON")
    export.set_defaults(func=_export)

    cal = sub.add_parser(
        "calibrate",
        help="calibrate static FP8 KV scales for a checkpoint and write a copy carrying them",
        description="Run the model over real calibration text (default: a licence text found "
        "on this machine), collect post-RoPE K/V statistics per layer and KV head (amax and a "
        "fixed-size |x| histogram), choose per layer (per-tensor) or per layer and head "
        "(per-head) the clipping ratio r in [0.5, 1] that minimises the expected FP8 e4m3 "
        "MSE of K and of V, and write a copy of the checkpoint with scale = r * amax / 448 in "
        "a producer convention. Exit code: 0 written, 1 refused (nothing written), 2 usage "
        "error.",
    )
    cal.add_argument(
        "path", metavar="MODEL_DIR", help="checkpoint folder (config, weights, tokenizer)"
    )
    cal.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    cal.add_argument(
        "--format",
        dest="granularity",
        default="per-tensor",
        choices=("per-tensor", "per-head"),
        help="per-tensor (one K and one V scale per layer) or per-head (one per KV head; "
        "compressed-tensors attn_head)",
    )
    cal.add_argument(
        "--text",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="calibration text file(s) (UTF-8); default: kvquant.testing.texts' calibration text",
    )
    cal.add_argument(
        "--convention",
        default="compressed-tensors",
        choices=("compressed-tensors", "modelopt", "quark"),
        help="producer convention of the written scales (default compressed-tensors)",
    )
    cal.add_argument(
        "--max-tokens",
        dest="max_tokens",
        type=_at_least_two,
        default=8192,
        help="calibration tokens at most (default 8192)",
    )
    cal.add_argument(
        "--window", type=_at_least_two, default=2048, help="tokens per forward pass (default 2048)"
    )
    cal.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="keep the largest ratio whose expected MSE is within this relative margin of the "
        "minimum (default 0: the argmin)",
    )
    cal.add_argument(
        "--objective",
        default="mse",
        choices=("mse", "attention"),
        help="mse: expected FP8 MSE of K and of V, every value counted once (default); "
        "attention: errors weighted by their first-order effect on the attention output",
    )
    cal.add_argument("--force", action="store_true", help="replace OUT if it exists")
    cal.add_argument("--json", action="store_true", help="print the calibration report as JSON")
    cal.set_defaults(func=_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvquant`` script.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 a checkpoint would be rejected, 2 usage error.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace, TextIO, TextIO], int] = args.func
    return handler(args, sys.stdout, sys.stderr)
