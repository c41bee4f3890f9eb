"""``kvquant demo``: tiny checkpoints in each producer's convention, and what the doctor says.

Builds them in a temporary folder (``--keep DIR`` keeps them), walks through the
doctor's verdict on each, then loads, patches and generates on CPU (the story
lives in :mod:`kvquant.demo`). Exit code 2 when ``--keep DIR`` is (or lies
under) a file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from kvquant.cli.common import EXIT_OK, EXIT_USAGE, fail, print_json, width
from kvquant.errors import KVQuantError

NAME = "demo"

HELP = "build tiny checkpoints in every producer convention and explain each"

DESCRIPTION = (
    "Write tiny random Llama checkpoints, one per producer convention (plus broken ones), "
    "into a temporary folder and run the doctor on each, as a story."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvquant demo``'s arguments."""
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the checkpoints into DIR and keep them (default: a temporary folder)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print each checkpoint's verdict and the generation comparison as JSON",
    )


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant demo``; return its exit code."""
    import io

    from kvquant.demo import check_workdir, run_demo

    try:
        if args.keep is not None:
            check_workdir(args.keep, "--keep")
    except KVQuantError as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    if not args.json:
        run_demo(out, workdir=args.keep, width=width(out))
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
    print_json(payload, out)
    return EXIT_OK
