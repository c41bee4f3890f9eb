"""``kvquant export PATH --engine vllm|sglang|tensorrt-llm --out DIR``: a copy for a serving engine.

Writes a copy of the checkpoint whose KV scales follow that engine's loader
(names, shapes, fp32, config keys; see :mod:`kvquant.export`). Exit code 0 when
written, 1 when the checkpoint cannot be exported for that engine (nothing is
written), 2 on a usage error (not a checkpoint, ``--out`` exists without ``--force``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from kvquant.cli.common import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    PATH_HELP,
    checkpoint_dir,
    fail,
    print_json,
    width,
)
from kvquant.cli.options import add_option_flags, config_from_args
from kvquant.errors import KVQuantError

NAME = "export"

HELP = "write a copy of a checkpoint whose KV scales a serving engine's loader accepts"

DESCRIPTION = (
    "Read the checkpoint's KV scales (discovery + the registry), then write a copy into OUT "
    "whose KV-scale tensors (names, shapes, fp32) and quantization config follow the engine's"
    " loader. Weight shards without KV scales are hard-linked (or copied); shards holding "
    "scales are re-saved with every other tensor unchanged. Exit code: 0 written, 1 refused "
    "(nothing written), 2 usage error."
)

OPTIONS = ("rope_policy", "missing_kv")
"""The shared option flags export takes (the rest of the resolve options are the engine's)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvquant export``'s arguments."""
    parser.add_argument("path", help=PATH_HELP)
    parser.add_argument(
        "--engine", required=True, choices=("vllm", "sglang", "tensorrt-llm"), help="target engine"
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    parser.add_argument(
        "--granularity",
        default="per-tensor",
        choices=("per-tensor", "per-head"),
        help="per-tensor (every engine; per-head scales reduced with max, cost reported) or "
        "per-head (vLLM compressed-tensors attn_head only)",
    )
    parser.add_argument(
        "--per-head", action="store_true", help="same as --granularity per-head (vLLM only)"
    )
    add_option_flags(parser, OPTIONS)
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists (after the new copy is complete)",
    )
    parser.add_argument(
        "--copy", action="store_true", help="copy unchanged files instead of hard-linking them"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the export report (or the error) as JSON"
    )


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant export``; return its exit code."""
    from kvquant.errors import CheckpointError
    from kvquant.export import ExportTargetExistsError, export_checkpoint
    from kvquant.registry.options import ResolveOptions

    granularity = "per-head" if args.per_head else args.granularity
    options = config_from_args(args, ResolveOptions)
    try:
        report = export_checkpoint(
            checkpoint_dir(args.path),
            args.out,
            engine=args.engine,
            granularity=granularity,
            rope_policy=options.rope_policy,
            missing_kv=options.missing_kv,
            force=args.force,
            link=not args.copy,
            progress=not args.json,
        )
    except (CheckpointError, ExportTargetExistsError) as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:
        # ExportError (the engine cannot take it) or the registry's ScaleFormatError
        return fail(args, exc, EXIT_REJECTED, out, err)
    if args.json:
        print_json(report.to_dict(), out)
    else:
        print(report.render(width=width(out)), file=out)
    return EXIT_OK
