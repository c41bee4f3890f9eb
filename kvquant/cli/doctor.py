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

from kvquant.choices import KVFormat
from kvquant.cli.common import EXIT_USAGE, PATH_HELP, checkpoint_dir, fail, print_json, width
from kvquant.cli.options import add_option_flags, config_from_args
from kvquant.errors import KVQuantError, OptionError

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
    parser.add_argument(
        "--kv-format",
        dest="kv_format",
        default=None,
        metavar="FORMAT|MAP",
        help="also show each layer's K/V format under kvquant.patch's kv_format: a word ("
        + ", ".join(KVFormat.values())
        + ") or a per-layer map 'LAYER=FORMAT,...' with 'default=FORMAT' for the layers not "
        "listed (negative layers count from the last), e.g. '0=fp8,-1=fp8,default=nvfp4'",
    )


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant doctor``; return its exit code."""
    from kvquant.registry.options import ResolveOptions
    from kvquant.report import inspect_checkpoint

    try:
        options = config_from_args(args, ResolveOptions)
        kv_format = None if args.kv_format is None else kv_format_arg(args.kv_format)
        report = inspect_checkpoint(checkpoint_dir(args.path), options=options, kv_format=kv_format)
    except KVQuantError as exc:
        # CheckpointError (not a checkpoint) or an option the registry refuses
        return fail(args, exc, EXIT_USAGE, out, err)
    if args.json:
        print_json(report.to_dict(), out)
    else:
        print(report.render(full=True if args.full else None, width=width(out), cli=True), file=out)
    return report.exit_code


def kv_format_arg(text: str) -> str | dict[str, str]:
    """``--kv-format``'s text as :func:`kvquant.patch`'s ``kv_format``: a word, or
    ``'LAYER=FORMAT,...'`` as a map (checked against the checkpoint's layers by the report).

    Raises:
        OptionError: an entry without ``=``.
    """
    if "=" not in text:
        return text.strip()
    entries: dict[str, str] = {}
    for part in text.split(","):
        key, sep, fmt = part.partition("=")
        if not sep or not key.strip():
            raise OptionError(
                f"--kv-format {text!r}: the entry {part!r} is not LAYER=FORMAT. Fix: e.g. "
                "--kv-format '0=fp8,-1=fp8,default=nvfp4'."
            )
        entries[key.strip()] = fmt.strip()
    return entries
