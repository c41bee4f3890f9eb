"""The ``kvquant`` command line (also ``python -m kvquant``).

Subcommands:

* ``kvquant doctor PATH``: read a checkpoint's KV scales (headers and scale
  tensors only, never the weights) and print, per layer, what kvquant would do
  with them: use, convert or reject, and why. Exit code 0 when the checkpoint
  would load, 1 when any layer (or the checkpoint) would be rejected, 2 on a
  usage error (missing path, not a checkpoint, bad option).
* ``kvquant demo``: build tiny checkpoints in each producer's convention in a
  temporary folder, walk through what the doctor says about each, then load,
  patch and generate on CPU (see :mod:`kvquant.demo`).
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

The demo's story lives in :mod:`kvquant.demo`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvquant.errors import KVQuantError

__all__ = [
    "build_parser",
    "main",
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
    from kvquant.errors import CalibrationError, CheckpointError

    if not files:
        raise CalibrationError(
            "no calibration text given; expected at least one --text FILE. Fix: pass --text "
            "with plain-text files like the model's real inputs."
        )
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
    except KVQuantError as exc:  # CheckpointError, ExportTargetExistsError, CalibrationError
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


def _demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.demo import run_demo

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
        description="Run the model over real calibration text (--text FILE ...), collect "
        "post-RoPE K/V statistics per layer and KV head (amax and a "
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
        help="calibration text file(s) (UTF-8), required",
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
