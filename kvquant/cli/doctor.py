"""``kvquant doctor PATH``: what kvquant would do with a checkpoint's KV scales, per layer.

Reads headers and scale tensors only, never the weights, and prints per layer
the producer convention, the format chosen, the raw shape/dtype/range and the
action (use, convert or reject) and why; one row per distinct decision above 8
layers (``--full`` for every row). Exit code 0 when the checkpoint would load, 1
when any layer (or the checkpoint) would be rejected, 2 on a usage error.
"""

from __future__ import annotations

import argparse
from typing import TextIO

from kvquant.cli.common import EXIT_USAGE, PATH_HELP, checkpoint_dir, fail, print_json, width
from kvquant.cli.options import add_option_flags, config_from_args
from kvquant.errors import KVQuantError

NAME = "doctor"

HELP = "show, per layer, what kvquant would do with a checkpoint's KV scales"

DESCRIPTION = (
    "Read a checkpoint's KV scales (config, safetensors headers and the scale tensors only; "
    "never the weights) and print, per layer, the producer convention, the format chosen, the"
    " raw shape/dtype/range and the action: use, convert or reject, and why. Exit code: 0 the"
    " checkpoint would load, 1 a layer (or the checkpoint) would be rejected, 2 usage error "
    "(missing path, not a checkpoint)."
)

OPTIONS = ("scale_format", "missing_scales", "missing_kv", "group_size", "rope_policy")
"""The shared option flags doctor takes: the registry's resolve options."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvquant doctor``'s arguments."""
    parser.add_argument("path", help=PATH_HELP)
    parser.add_argument(
        "--json", action="store_true", help="print the report (or the error) as JSON"
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="one row per layer and K/V (default for up to 8 layers; above, one row per "
        "distinct decision with its layer ranges)",
    )
    add_option_flags(parser, OPTIONS)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant doctor``; return its exit code."""
    from kvquant.registry.options import ResolveOptions
    from kvquant.report import inspect_checkpoint

    try:
        options = config_from_args(args, ResolveOptions)
        report = inspect_checkpoint(checkpoint_dir(args.path), options=options)
    except KVQuantError as exc:
        # CheckpointError (not a checkpoint) or an option the registry refuses
        return fail(args, exc, EXIT_USAGE, out, err)
    if args.json:
        print_json(report.to_dict(), out)
    else:
        print(report.render(full=True if args.full else None, width=width(out), cli=True), file=out)
    return report.exit_code
