"""The rules every ``kvquant`` subcommand shares: exit codes, PATH, errors and JSON output.

Exit codes: 0 ok, 1 refused (:data:`EXIT_REJECTED`), 2 usage error, 3 an
unexpected exception (a bug), 141 stdout's reader went away. With ``--json`` an
error is a JSON object on stdout (``{"error": type, "message": ..., "exit_code":
..., "command": ...}``); every object starts with ``"schema_version"``
(:data:`JSON_SCHEMA_VERSION`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "DTYPES",
    "EXIT_CLOSED_PIPE",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_USAGE",
    "JSON_SCHEMA_VERSION",
    "PATH_HELP",
    "at_least",
    "checkpoint_dir",
    "fail",
    "print_json",
    "print_json_error",
    "width",
]

PATH_HELP = (
    "checkpoint folder (config.json + *.safetensors), a file inside it such as "
    "config.json or model.safetensors (its folder is used), or a hub id in the local "
    "Hugging Face cache"
)
"""The help of every subcommand's PATH argument."""

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_CLOSED_PIPE = 141
"""The reader of stdout closed it early (128 + SIGPIPE, what a shell reports for such a command)."""

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""``--dtype`` choices of the subcommands that load a model."""

JSON_SCHEMA_VERSION = 1
"""``schema_version`` of every JSON object the command line prints (raised when a key changes
meaning or goes away; new keys may appear without it)."""


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


def fail(args: argparse.Namespace, exc: BaseException, code: int, out: TextIO, err: TextIO) -> int:
    """Report a failed subcommand: text on stderr, or a JSON object on stdout with ``--json``."""
    label = "refused" if code == EXIT_REJECTED else "error"
    if getattr(args, "json", False):
        print_json_error(type(exc).__name__, str(exc), code, out, command=args.command)
    else:
        print(f"kvquant {args.command}: {label}: {exc}", file=err)
    return code


def print_json_error(
    kind: str, message: str, code: int, out: TextIO, *, command: str | None
) -> None:
    """Print an error as the JSON object ``--json`` promises."""
    print_json({"error": kind, "message": message, "exit_code": code, "command": command}, out)


def print_json(payload: dict[str, Any], out: TextIO) -> None:
    """Print one strict JSON object (no NaN literals), ``schema_version`` first."""
    import json

    print(
        json.dumps({"schema_version": JSON_SCHEMA_VERSION, **payload}, indent=2, allow_nan=False),
        file=out,
    )


def width(out: TextIO) -> int:
    """The width text output is laid out for (:func:`kvquant.tables.output_width`)."""
    from kvquant.tables import output_width

    return output_width(out)


def at_least(minimum: int) -> Callable[[str], int]:
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
