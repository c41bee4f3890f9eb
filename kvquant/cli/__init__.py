"""The ``kvquant`` command line (also ``python -m kvquant``): one module per subcommand.

``doctor``, ``demo``, ``export``, ``calibrate`` and ``serve`` each live in a module
of this package that declares its arguments beside its handler (``NAME``,
``HELP``, ``DESCRIPTION``, ``add_arguments(parser)``, ``run(args, out, err)``);
:mod:`kvquant.cli.common` holds what they share: exit codes, the PATH rule
(:func:`checkpoint_dir`), errors and ``--json`` output; :mod:`kvquant.cli.options` the
scale and kernel option flags and the one value they build. Text output is laid out
for the terminal's width (:func:`kvquant.tables.output_width`); when stdout's
reader goes away early (``| head``) a command stops quietly with 141, and an
exception no subcommand expects (a bug) exits with 3, its traceback on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

from kvquant.cli import calibrate, demo, doctor, export, serve
from kvquant.cli.common import (
    EXIT_CLOSED_PIPE,
    EXIT_INTERNAL,
    EXIT_USAGE,
    JSON_SCHEMA_VERSION,
    checkpoint_dir,
    print_json_error,
)

__all__ = [
    "JSON_SCHEMA_VERSION",
    "build_parser",
    "checkpoint_dir",
    "main",
]

_SUBCOMMANDS = (doctor, demo, export, calibrate, serve)
"""In the order ``kvquant --help`` lists them."""

_COMMANDS = tuple(command.NAME for command in _SUBCOMMANDS)


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
    for command in _SUBCOMMANDS:
        subparser = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(subparser)
        subparser.set_defaults(func=command.run)
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
            print_json_error("UsageError", str(exc), EXIT_USAGE, sys.stdout, command=command)
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
            print_json_error(
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
