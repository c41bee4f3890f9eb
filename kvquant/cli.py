"""The ``kvquant`` command line (also ``python -m kvquant``).

Subcommands:

* ``kvquant doctor PATH``: read a checkpoint's KV scales (headers and scale
  tensors only, never the weights) and print, per layer, what kvquant would do
  with them: use, convert or reject, and why. Exit code 0 when the checkpoint
  would load, 1 when any layer (or the checkpoint) would be rejected, 2 on a
  usage error (missing path, not a checkpoint, bad option).
* ``kvquant demo``: build tiny checkpoints in each producer's convention in a
  temporary folder, walk through what the doctor says about each, then load,
  patch and generate on CPU (see :mod:`kvquant.demo`). Exit code 2 when
  ``--keep DIR`` is (or lies under) a file.
* ``kvquant export PATH --engine vllm|sglang|tensorrt-llm --out DIR``: write a
  copy of the checkpoint whose KV scales follow that engine's loader (names,
  shapes, fp32, config keys); see :mod:`kvquant.export`. Exit code 0 when
  written, 1 when the checkpoint cannot be exported for that engine (nothing is
  written), 2 on a usage error (not a checkpoint, ``--out`` exists without
  ``--force``).
* ``kvquant calibrate MODEL_DIR --out DIR (--dataset NAME | --text FILE)``: run
  the model (``--device``, ``--device-map``, ``--dtype``; its own dtype by
  default) over calibration data, choose static FP8 K/V scales by the expected quantization
  error they cause and write a copy of the checkpoint carrying them in a
  producer convention, or the static K transform (``--format k-transform``) in
  kvquant's own convention (see :mod:`kvquant.calibrate`); print the
  calibration report (:mod:`kvquant.calibration_report`: clipping and subnormal
  fractions, K energy in near-constant channels, every candidate format's
  error on held-out samples, a recommendation). Exit code 0 when written,
  1 when the model or the requested convention cannot be calibrated (nothing
  is written), 2 on a usage error (no data source, not a checkpoint, no
  tokenizer, unreadable text, ``--out`` exists without ``--force``).

Every subcommand takes ``--json``: its result, or its error as a JSON object
(``{"error": type, "message": ..., "exit_code": ..., "command": ...}`` on stdout,
same exit codes); every object starts with ``"schema_version"``
(:data:`JSON_SCHEMA_VERSION`). An exception no subcommand expects (a bug) exits with 3,
never 1, its traceback on stderr (``"error": "InternalError"`` with ``--json``). When
stdout's reader goes away early (``| head``) the command stops quietly with 141.
Text output is laid out for the terminal's width (:func:`kvquant.tables.output_width`). Every PATH follows one rule (:func:`checkpoint_dir`): a
checkpoint folder, or a file inside it (``config.json``, ``model.safetensors``)
for its folder. ``doctor`` prints one row per distinct decision above 8 layers
(``--full`` for every row).

* ``kvquant serve MODEL``: run transformers' OpenAI-compatible server
  (``/v1/chat/completions`` and the rest) with continuous batching, the model
  patched by :func:`kvquant.patch` (see :mod:`kvquant.serve`); it serves until
  stopped. Exit code 1 when kvquant refuses the model or its scales, 2 when the
  serving extras are missing or an option is bad.

The demo's story lives in :mod:`kvquant.demo`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from kvquant.errors import KVQuantError

__all__ = [
    "build_parser",
    "checkpoint_dir",
    "main",
]

_PATH_HELP = (
    "checkpoint folder (config.json + *.safetensors), a file inside it such as "
    "config.json or model.safetensors (its folder is used), or a hub id in the local "
    "Hugging Face cache"
)

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_CLOSED_PIPE = 141
"""The reader of stdout closed it early (128 + SIGPIPE, what a shell reports for such a command)."""

_COMMANDS = ("doctor", "demo", "export", "calibrate", "serve")

_DOCTOR_OPTIONS = ("scale_format", "missing_scales", "missing_kv", "group_size", "rope_policy")


# ---------------------------------------------------------------------------
# doctor


def _doctor(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.registry.options import ResolveOptions
    from kvquant.report import inspect_checkpoint

    options: dict[str, Any] = {
        name: getattr(args, name) for name in _DOCTOR_OPTIONS if getattr(args, name) is not None
    }
    try:
        report = inspect_checkpoint(checkpoint_dir(args.path), options=ResolveOptions(**options))
    except KVQuantError as exc:
        # CheckpointError (not a checkpoint) or an option the registry refuses
        return _fail(args, exc, EXIT_USAGE, out, err)
    if args.json:
        _print_json(report.to_dict(), out)
    else:
        print(
            report.render(full=True if args.full else None, width=_width(out), cli=True), file=out
        )
    return report.exit_code


# ---------------------------------------------------------------------------
# export


def _export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.errors import CheckpointError
    from kvquant.export import ExportTargetExistsError, export_checkpoint

    granularity = "per-head" if args.per_head else args.granularity
    try:
        report = export_checkpoint(
            checkpoint_dir(args.path),
            args.out,
            engine=args.engine,
            granularity=granularity,
            rope_policy=args.rope_policy,
            missing_kv=args.missing_kv,
            force=args.force,
            link=not args.copy,
            progress=not args.json,
        )
    except (CheckpointError, ExportTargetExistsError) as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:
        # ExportError (the engine cannot take it) or the registry's ScaleFormatError
        return _fail(args, exc, EXIT_REJECTED, out, err)
    if args.json:
        _print_json(report.to_dict(), out)
    else:
        print(report.render(width=_width(out)), file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# serve


def _serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.errors import BackendError, CheckpointError, OptionError
    from kvquant.serve import serve

    try:
        serve(
            args.model,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            scales=args.scales,
            scale_format=args.scale_format,
            missing_scales=args.missing_scales,
            backend=args.backend,
            page_size=args.page_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_memory_percent=args.max_memory_percent,
            log_level=args.log_level,
        )
    except (BackendError, CheckpointError, OptionError) as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:  # kvquant.patch refused the model or its scales
        return _fail(args, exc, EXIT_REJECTED, out, err)
    return EXIT_OK


# ---------------------------------------------------------------------------
# calibrate


_DTYPES = ("auto", "bfloat16", "float16", "float32")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files one of which a checkpoint folder with a tokenizer holds."""


def _load_tokenizer(path: str, folder: Path) -> Any:
    """The checkpoint's tokenizer, loaded before the model (a missing one fails fast)."""
    from transformers import AutoTokenizer

    from kvquant.errors import CalibrationError

    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise CalibrationError(
            f"{folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); calibrate "
            "turns the calibration text into tokens with the model's own tokenizer. Fix: copy "
            "the tokenizer files of the model this checkpoint comes from into the folder "
            "(kvquant demo's checkpoints are random models without one: calibrate a real model)."
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CalibrationError(
            f"{folder}: its tokenizer files do not load ({first}). Fix: copy the complete "
            "tokenizer files of the model this checkpoint comes from into the folder."
        ) from exc


def _load_for_calibration(args: argparse.Namespace, path: str) -> Any:
    """Load the model (its quantization_config dropped), placed as asked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvquant.errors import CalibrationError
    from kvquant.integrations.hf.quantizer import quiet_loading

    config = AutoConfig.from_pretrained(path)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            del holder.quantization_config  # KV scales are replaced; weights load as floats
    dtype: Any = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "attn_implementation": "sdpa"}
    if args.device_map is not None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise CalibrationError(
                f"--device-map {args.device_map} needs the accelerate library, which is not "
                "installed. Fix: pip install accelerate, or pass --device cuda (one device)."
            )
        kwargs["device_map"] = args.device_map
    with quiet_loading():  # no load bars or UNEXPECTED-keys report amid the command's output
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if args.device_map is None:
        model.to(_device(args.device))
    model.eval()
    return model


def _device(name: str | None) -> Any:
    """``--device``: a torch device that exists here (default: CUDA when present, else CPU)."""
    import torch

    from kvquant.errors import CalibrationError

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise CalibrationError(
            f"--device {name!r} is not a torch device ({exc}). Fix: pass cpu, cuda or cuda:N."
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CalibrationError(
            f"--device {name} was requested but torch sees no CUDA device here. Fix: pass "
            "--device cpu, or run on a machine with a GPU."
        )
    return device


def _calibration_data(args: argparse.Namespace, tokenizer: Any) -> Any:
    from kvquant.calibrate import load_dataset_samples, load_text_files

    if args.dataset is not None:
        return load_dataset_samples(
            args.dataset,
            tokenizer,
            config=args.dataset_config,
            split=args.split,
            text_column=args.text_column,
            num_samples=args.num_samples if args.num_samples is not None else 512,
            max_seq_length=args.max_seq_length,
            progress=not args.json,
        )
    return load_text_files(
        args.text,
        tokenizer,
        num_samples=args.num_samples,
        max_seq_length=args.max_seq_length,
        progress=not args.json,
    )


def _at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small; expected at least {minimum}")
        return value

    return parse


def _calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvquant.calibrate import calibrate, check_text_file, write_calibrated_checkpoint
    from kvquant.checkpoint.discovery import discover_scales
    from kvquant.checkpoint.writer import check_output_path
    from kvquant.errors import CalibrationError, CheckpointError, ExportError
    from kvquant.export import ExportTargetExistsError

    path = checkpoint_dir(args.path)
    try:
        if args.granularity == "k-transform":
            if args.convention not in (None, "kvquant"):
                raise CalibrationError(
                    f"--format k-transform is stored only in kvquant's own convention (k_offset "
                    f"tensors and kvquant_kv_transform.json), not {args.convention}: no serving "
                    "engine reads it. Fix: drop --convention, or calibrate --format per-head "
                    "for a producer convention."
                )
            args.convention = "kvquant"
        elif args.convention == "kvquant":
            raise CalibrationError(
                f"--convention kvquant holds only the k-transform, not --format "
                f"{args.granularity}. Fix: pass --format k-transform, or drop --convention."
            )
        elif args.convention is None:
            args.convention = "compressed-tensors"
        if args.granularity == "per-head" and args.convention != "compressed-tensors":
            raise CalibrationError(
                f"--format per-head is stored by the compressed-tensors convention only "
                f"(strategy attn_head), not {args.convention}. Fix: drop --convention or use "
                "--format per-tensor."
            )
        if args.dataset is None and not args.text:
            raise CalibrationError(
                "no calibration data given; expected --dataset NAME (the datasets library: "
                "with --dataset-config, --split, --text-column, --num-samples, "
                "--max-seq-length) or --text FILE (repeatable). Fix: e.g. --dataset wikitext "
                "--dataset-config wikitext-2-raw-v1, or --text my_corpus.txt."
            )
        if args.dataset is not None and args.text:
            raise CalibrationError(
                "both --dataset and --text were given; expected one data source. Fix: drop "
                "one of them."
            )
        for text in args.text or ():  # before the model loads: a FIFO or a device never hangs
            check_text_file(text)
        found = discover_scales(path)
    except KVQuantError as exc:  # CheckpointError, CalibrationError
        return _fail(args, exc, EXIT_USAGE, out, err)
    try:  # before the model runs, by the rule the write applies (as kvquant export does)
        check_output_path(found.path, args.out, args.force)
    except ExportTargetExistsError as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    except ExportError as exc:  # --out is the source, inside it, or holds it
        return _fail(args, exc, EXIT_REJECTED, out, err)
    try:  # the tokenizer and the data first: a missing one fails before the model loads
        tokenizer = _load_tokenizer(path, found.path)
        data = _calibration_data(args, tokenizer)
    except KVQuantError as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    try:
        model = _load_for_calibration(args, path)
    except KVQuantError as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        wrapped = CheckpointError(
            f"transformers could not load the model of {path} ({type(exc).__name__}: {first}). "
            "Fix: pass a folder AutoModelForCausalLM loads."
        )
        return _fail(args, wrapped, EXIT_USAGE, out, err)
    try:
        result = calibrate(
            model,
            list(data.samples),
            granularity=args.granularity,
            window=data.max_seq_length,
            max_tokens=args.max_tokens,
            tolerance=args.tolerance,
            objective=args.objective,
            progress=not args.json,
            text_names=(data.source,),
            rotation=None if args.rotation == "none" else args.rotation,
            first_tokens=args.first_tokens,
            centre=args.k_centre,
            held_out_tokens=args.held_out_tokens,
        )
        written = write_calibrated_checkpoint(
            path,
            result,
            args.out,
            args.convention,
            force=args.force,
            link=args.link,
            progress=not args.json,
        )
    except (CheckpointError, ExportTargetExistsError) as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:  # CalibrationError, UnsupportedModelError, ExportError
        return _fail(args, exc, EXIT_REJECTED, out, err)
    if args.json:
        _print_json({"out": str(written), "convention": args.convention, **result.to_dict()}, out)
    else:
        from kvquant.calibrate.report import READERS

        width = _width(out)
        print(result.render(full=args.full, width=width, cli=True), file=out)
        readers = READERS.get(result.granularity, "kvquant")
        import textwrap

        text = (
            f"wrote {written}: {result.granularity} scales in the {args.convention} "
            f"convention, read by {readers}"
        )
        print("\n" + textwrap.fill(text, width=width, subsequent_indent="  "), file=out)
    return EXIT_OK


def _demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import io

    from kvquant.demo import check_workdir, run_demo

    try:
        if args.keep is not None:
            check_workdir(args.keep, "--keep")
    except KVQuantError as exc:
        return _fail(args, exc, EXIT_USAGE, out, err)
    if not args.json:
        run_demo(out, workdir=args.keep, width=_width(out))
        return EXIT_OK
    ctx = run_demo(io.StringIO(), workdir=args.keep)
    payload = {
        "checkpoints": {
            key: {
                "path": str(path),
                "title": ckpt.title,
                "ok": ctx.reports[key].ok,
                "summary": ctx.reports[key].summary,
            }
            for key, (ckpt, path) in ctx.checkpoints.items()
        },
        "generate": ctx.extra.get("generate"),
    }
    _print_json(payload, out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# shared rules


def checkpoint_dir(path: str | Path) -> str:
    """The checkpoint folder a command-line PATH names, by the same rule in every subcommand.

    A folder is itself; a checkpoint's own file (``config.json``,
    ``model.safetensors``, ``model.safetensors.index.json``, a shard) names its
    folder (:func:`kvquant.checkpoint.files.folder_named_by`, the rule of every
    door); anything else (a missing path, another file, a Hugging Face hub id)
    is passed on unchanged for discovery to resolve or refuse.

    Args:
        path: the PATH argument.

    Returns:
        The path to hand to discovery.
    """
    from kvquant.checkpoint.files import folder_named_by

    return str(folder_named_by(path))


def _fail(args: argparse.Namespace, exc: BaseException, code: int, out: TextIO, err: TextIO) -> int:
    """Report a failed subcommand: text on stderr, or a JSON object on stdout with ``--json``."""
    label = "refused" if code == EXIT_REJECTED else "error"
    if getattr(args, "json", False):
        _print_json_error(type(exc).__name__, str(exc), code, out, command=args.command)
    else:
        print(f"kvquant {args.command}: {label}: {exc}", file=err)
    return code


def _print_json_error(
    kind: str, message: str, code: int, out: TextIO, *, command: str | None
) -> None:
    _print_json({"error": kind, "message": message, "exit_code": code, "command": command}, out)


JSON_SCHEMA_VERSION = 1
"""``schema_version`` of every JSON object the command line prints (raised when a key changes
meaning or goes away; new keys may appear without it)."""


def _print_json(payload: dict[str, Any], out: TextIO) -> None:
    """Print one strict JSON object (no NaN literals), ``schema_version`` first."""
    import json

    print(
        json.dumps({"schema_version": JSON_SCHEMA_VERSION, **payload}, indent=2, allow_nan=False),
        file=out,
    )


def _width(out: TextIO) -> int:
    from kvquant.tables import output_width

    return output_width(out)


# ---------------------------------------------------------------------------
# parser


class _UsageError(Exception):
    """An argparse usage error, raised instead of exiting so ``--json`` can report it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`_UsageError` on a usage error (exit code 2 in :func:`main`)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


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
    doctor.add_argument("path", help=_PATH_HELP)
    doctor.add_argument(
        "--json", action="store_true", help="print the report (or the error) as JSON"
    )
    doctor.add_argument(
        "--full",
        action="store_true",
        help="one row per layer and K/V (default for up to 8 layers; above, one row per "
        "distinct decision with its layer ranges)",
    )
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
    demo.add_argument(
        "--json",
        action="store_true",
        help="print each checkpoint's verdict and the generation comparison as JSON",
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
    export.add_argument("path", help=_PATH_HELP)
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
    export.add_argument(
        "--json", action="store_true", help="print the export report (or the error) as JSON"
    )
    export.set_defaults(func=_export)

    cal = sub.add_parser(
        "calibrate",
        help="calibrate static FP8 KV scales for a checkpoint and write a copy carrying them",
        description="Run the model over calibration data (a dataset of the datasets library, "
        "or text files), collect post-RoPE K/V statistics per layer and KV head (amax and a "
        "fixed-size |x| histogram), choose per layer (per-tensor) or per layer and head "
        "(per-head) the clipping ratio r in [0.5, 1] that minimises the expected FP8 e4m3 "
        "MSE of K and of V, and write a copy of the checkpoint with scale = r * amax / 448 in "
        "a producer convention. Exit code: 0 written, 1 refused (nothing written), 2 usage "
        "error (no data source, not a checkpoint, --out exists).",
    )
    cal.add_argument("path", metavar="MODEL_DIR", help=_PATH_HELP + "; tokenizer files included")
    cal.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    data = cal.add_argument_group("calibration data (one source is required)")
    data.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="a dataset of the datasets library: a hub name (wikitext), a save_to_disk folder "
        "or a local .json/.jsonl/.csv/.parquet file (pip install datasets)",
    )
    data.add_argument(
        "--dataset-config", dest="dataset_config", default=None, help="the dataset's configuration"
    )
    data.add_argument("--split", default="train", help="the split to read (default train)")
    data.add_argument(
        "--text-column",
        dest="text_column",
        default="text",
        help="the column holding the text (default text)",
    )
    data.add_argument(
        "--text",
        type=Path,
        nargs="+",
        action="extend",
        default=None,
        metavar="FILE",
        help="UTF-8 text file(s) instead of a dataset (repeatable); each is cut into "
        "--max-seq-length windows",
    )
    data.add_argument(
        "--num-samples",
        dest="num_samples",
        type=_at_least(1),
        default=None,
        help="calibration samples (default: 512 dataset rows; every window of the text files)",
    )
    data.add_argument(
        "--max-seq-length",
        dest="max_seq_length",
        type=_at_least(2),
        default=2048,
        help="tokens per sample at most (default 2048)",
    )
    data.add_argument(
        "--max-tokens",
        dest="max_tokens",
        type=_at_least(2),
        default=None,
        help="stop after this many tokens in total (default: all samples)",
    )
    placement = cal.add_argument_group("model placement")
    placement.add_argument(
        "--device",
        default=None,
        help="torch device to run on: cpu, cuda, cuda:1 (default: cuda when present, else cpu)",
    )
    placement.add_argument(
        "--device-map",
        dest="device_map",
        default=None,
        help="transformers device_map (e.g. auto: spread over the GPUs; needs accelerate); "
        "replaces --device",
    )
    placement.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="compute dtype (default auto: the model's own, e.g. bfloat16)",
    )
    cal.add_argument(
        "--format",
        dest="granularity",
        default="per-tensor",
        choices=("per-tensor", "per-head", "k-transform"),
        help="per-tensor (one K and one V scale per layer), per-head (one per KV head; "
        "compressed-tensors attn_head) or k-transform (per-head scales of a rotated, offset "
        "K plus per-channel K offsets, first tokens at full precision; kvquant's own "
        "convention, read by kvquant only)",
    )
    cal.add_argument(
        "--convention",
        default=None,
        choices=("compressed-tensors", "modelopt", "quark", "kvquant"),
        help="convention of the written scales (default compressed-tensors; kvquant for "
        "--format k-transform)",
    )
    kt = cal.add_argument_group("k-transform (--format k-transform)")
    kt.add_argument(
        "--rotation",
        default="hadamard",
        choices=("hadamard", "none"),
        help="rotate K (and the query) by the normalised Hadamard matrix before the offset "
        "(default; head_dim must be a power of two) or not (offset only)",
    )
    kt.add_argument(
        "--first-tokens",
        dest="first_tokens",
        type=_at_least(0),
        default=1,
        help="first tokens of every sequence attended at full precision and left out of the "
        "offsets and K scales (default 1: the attention sink; 0: none)",
    )
    kt.add_argument(
        "--k-centre",
        dest="k_centre",
        default="mean",
        choices=("mean", "midrange"),
        help="per-channel K offset: the mean (default) or (min + max) / 2 over the tokens",
    )
    cal.add_argument(
        "--held-out-tokens",
        dest="held_out_tokens",
        type=_at_least(0),
        default=512,
        help="calibration tokens (the last samples) held out to measure every candidate format "
        "for the report (default 512; 0: no measured report); at least one sample is kept to "
        "calibrate on",
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
    cal.add_argument(
        "--link",
        action="store_true",
        help="hard-link the unchanged weight shards instead of copying them (configs and "
        "tokenizer files are always copied)",
    )
    cal.add_argument("--force", action="store_true", help="replace OUT if it exists")
    cal.add_argument(
        "--full",
        action="store_true",
        help="print the per-layer tables (scales, and every format's error per layer)",
    )
    cal.add_argument(
        "--json", action="store_true", help="print the calibration report (or the error) as JSON"
    )
    cal.set_defaults(func=_calibrate)

    srv = sub.add_parser(
        "serve",
        help="serve a model on kvquant's FP8 cache with transformers' OpenAI-compatible server",
        description="Run transformers' server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) with continuous batching, the model patched by kvquant.patch: "
        "every request runs on kvquant's FP8 pages. Needs transformers' serving extras.",
    )
    srv.add_argument("model", help="checkpoint folder or hub id (as transformers serve takes)")
    srv.add_argument("--host", default="localhost", help="address to listen on (localhost)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    srv.add_argument("--device", default="auto", help="auto, cpu, cuda:0, ... (auto)")
    srv.add_argument(
        "--dtype", choices=_DTYPES, default="auto", help="model dtype (auto: the checkpoint's)"
    )
    srv.add_argument(
        "--scales",
        default=None,
        metavar="PATH",
        help="a checkpoint folder holding the KV scales (default: the model's own)",
    )
    srv.add_argument("--scale-format", default="auto", help="registry scale format (auto)")
    srv.add_argument(
        "--missing-scales",
        choices=("dynamic", "error", "unit"),
        default="dynamic",
        help="no KV scales: dynamic fp32-group scales (default), refuse, or unit scales",
    )
    srv.add_argument(
        "--backend", choices=("auto", "triton", "torch"), default="auto", help="kernels (auto)"
    )
    srv.add_argument(
        "--page-size", type=int, default=None, help="tokens per cache block (transformers: 256)"
    )
    srv.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="cache budget in blocks of the model's dtype; FP8 holds about twice as many "
        "(default: sized from free memory)",
    )
    srv.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step")
    srv.add_argument(
        "--max-memory-percent", type=float, default=None, help="share of free memory (0-1)"
    )
    srv.add_argument("--log-level", default="warning", help="transformers' log level")
    srv.add_argument("--json", action="store_true", help="report a refusal as JSON")
    srv.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvquant`` script.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 a checkpoint would be rejected, 2 usage error, 3 an
        internal error (a bug; its traceback on stderr).
    """
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and --version exit 0
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    except _UsageError as exc:
        if "--json" in argv:
            command = next((a for a in argv if a in _COMMANDS), None)
            _print_json_error("UsageError", str(exc), EXIT_USAGE, sys.stdout, command=command)
        else:
            exc.parser.print_usage(sys.stderr)
            print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace, TextIO, TextIO], int] = args.func
    try:
        code = handler(args, sys.stdout, sys.stderr)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # the reader went away (``kvquant doctor ... | head``)
        return _closed_pipe()
    except Exception as exc:  # a bug must not exit 1 ("refused"), nor break --json
        import traceback

        traceback.print_exc(file=sys.stderr)
        message = (
            f"{type(exc).__name__}: {exc}; kvquant did not expect it, so this is a kvquant bug "
            "or an error it should have explained. Fix: report it with the traceback printed "
            "on stderr."
        )
        if args.json:
            _print_json_error(
                "InternalError", message, EXIT_INTERNAL, sys.stdout, command=args.command
            )
        else:
            print(f"kvquant {args.command}: internal error: {message}", file=sys.stderr)
        return EXIT_INTERNAL


def _closed_pipe() -> int:
    """Stop quietly when stdout's reader has gone: no traceback, nothing more written there."""
    import os

    try:  # Python would flush stdout again at exit and report the same error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (a test's buffer)
        pass
    return EXIT_CLOSED_PIPE
