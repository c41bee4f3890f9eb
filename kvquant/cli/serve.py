"""``kvquant serve MODEL``: transformers' OpenAI-compatible server on kvquant's FP8 cache.

Runs ``/v1/chat/completions`` and the rest with continuous batching, the model
patched by :func:`kvquant.patch` (see :mod:`kvquant.serve`); it serves until
stopped. Exit code 1 when kvquant refuses the model or its scales, 2 when the
serving extras are missing or an option is bad.
"""

from __future__ import annotations

import argparse
from typing import TextIO

from kvquant.choices import KVFormat
from kvquant.cli.common import DTYPES, EXIT_OK, EXIT_REJECTED, EXIT_USAGE, fail
from kvquant.cli.options import add_option_flags, config_from_args
from kvquant.errors import KVQuantError

NAME = "serve"

HELP = "serve a model on kvquant's FP8 cache with transformers' OpenAI-compatible server"

DESCRIPTION = (
    "Run transformers' server (/v1/chat/completions, /v1/completions, /v1/models, /health) "
    "with continuous batching, the model patched by kvquant.patch: every request runs on "
    "kvquant's FP8 pages (or 4-bit ones with --kv-format). Needs transformers' serving extras."
)

OPTIONS = ("scale_format", "missing_scales", "backend", "recent_tokens")
"""The shared option flags serve takes (options of the patch the served model gets)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvquant serve``'s arguments."""
    parser.add_argument("model", help="checkpoint folder or hub id (as transformers serve takes)")
    parser.add_argument("--host", default="localhost", help="address to listen on (localhost)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda:0, ... (auto)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="model dtype (auto: the checkpoint's)"
    )
    parser.add_argument(
        "--scales",
        default=None,
        metavar="PATH",
        help="a checkpoint folder holding the KV scales (default: the model's own)",
    )
    add_option_flags(parser, OPTIONS)
    parser.add_argument(
        "--kv-format",
        choices=KVFormat.values(),
        default=None,
        help="how the cache stores K and V: fp8 (default), or a 4-bit format: nvfp4, mxfp4, "
        "fp8-k-nvfp4-v (one format for every layer under continuous batching)",
    )
    parser.add_argument(
        "--page-size", type=int, default=None, help="tokens per cache block (transformers: 256)"
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="cache budget in blocks of the model's dtype; FP8 holds about twice as many "
        "(default: sized from free memory)",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step")
    parser.add_argument(
        "--max-memory-percent", type=float, default=None, help="share of free memory (0-1)"
    )
    parser.add_argument("--log-level", default="warning", help="transformers' log level")
    parser.add_argument("--json", action="store_true", help="report a refusal as JSON")


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant serve``; return its exit code."""
    from kvquant.errors import BackendError, CheckpointError, OptionError
    from kvquant.integrations.hf import KVQuantConfig
    from kvquant.serve import serve

    try:
        kv_format = {} if args.kv_format is None else {"kv_format": args.kv_format}
        config = config_from_args(args, lambda **given: KVQuantConfig(**given, **kv_format))
        serve(
            args.model,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            scales=args.scales,
            scale_format=config.scale_format,
            missing_scales=config.missing_scales,
            backend=config.backend,
            kv_format=config.kv_format,
            recent_tokens=config.recent_tokens,
            page_size=args.page_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_memory_percent=args.max_memory_percent,
            log_level=args.log_level,
        )
    except (BackendError, CheckpointError, OptionError) as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:  # kvquant.patch refused the model or its scales
        return fail(args, exc, EXIT_REJECTED, out, err)
    return EXIT_OK
