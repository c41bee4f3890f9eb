"""``kvquant calibrate MODEL_DIR --out DIR (--dataset NAME | --text FILE)``: calibrate and write.

Runs the model (``--device``, ``--device-map``, ``--dtype``) over calibration
data, chooses static FP8 K/V scales by the expected quantization error they
cause (or the k-transform, ``--format k-transform``), writes a copy of the
checkpoint carrying them (see :mod:`kvquant.calibrate`) and prints the
calibration report; with ``--kv-budget X`` it also measures the 4-bit formats and proposes a
per-layer K/V format map taking at most the share X of FP8's KV bytes (printed, and recorded
in the copy's ``kvquant-calibration.json``; the copy's config does not apply it). Exit code 0 when written, 1 when the model or the requested
convention cannot be calibrated (nothing is written), 2 on a usage error (no
data source, not a checkpoint, no tokenizer, unreadable text, ``--out`` exists).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from kvquant.cli.common import (
    DTYPES,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    PATH_HELP,
    at_least,
    checkpoint_dir,
    fail,
    print_json,
    width,
)
from kvquant.errors import KVQuantError

NAME = "calibrate"

HELP = "calibrate static FP8 KV scales for a checkpoint and write a copy carrying them"

DESCRIPTION = (
    "Run the model over calibration data (a dataset of the datasets library, or text files), "
    "collect post-RoPE K/V statistics per layer and KV head (amax and a fixed-size |x| "
    "histogram), choose per layer (per-tensor) or per layer and head (per-head) the clipping "
    "ratio r in [0.5, 1] that minimises the expected FP8 e4m3 MSE of K and of V, and write a "
    "copy of the checkpoint with scale = r * amax / 448 in a producer convention. Exit code: "
    "0 written, 1 refused (nothing written), 2 usage error (no data source, not a checkpoint,"
    " --out exists)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvquant calibrate``'s arguments."""
    parser.add_argument("path", metavar="MODEL_DIR", help=PATH_HELP + "; tokenizer files included")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    _data_arguments(parser.add_argument_group("calibration data (one source is required)"))
    _placement_arguments(parser.add_argument_group("model placement"))
    parser.add_argument(
        "--format",
        dest="granularity",
        default="per-tensor",
        choices=("per-tensor", "per-head", "k-transform"),
        help="per-tensor (one K and one V scale per layer), per-head (one per KV head; "
        "compressed-tensors attn_head) or k-transform (per-head scales of a rotated, offset "
        "K plus per-channel K offsets, first tokens at full precision; kvquant's own "
        "convention, read by kvquant only)",
    )
    parser.add_argument(
        "--convention",
        default=None,
        choices=("compressed-tensors", "modelopt", "quark", "kvquant"),
        help="convention of the written scales (default compressed-tensors; kvquant for "
        "--format k-transform)",
    )
    _k_transform_arguments(parser.add_argument_group("k-transform (--format k-transform)"))
    parser.add_argument(
        "--held-out-tokens",
        dest="held_out_tokens",
        type=at_least(0),
        default=512,
        help="calibration tokens (the last samples) held out to measure every candidate format "
        "for the report (default 512; 0: no measured report); at least one sample is kept to "
        "calibrate on",
    )
    parser.add_argument(
        "--kv-budget",
        dest="kv_budget",
        type=float,
        default=None,
        metavar="X",
        help="also measure the 4-bit formats (nvfp4, mxfp4, fp8-k-nvfp4-v) on the held-out "
        "tokens and propose a per-layer K/V format map taking at most X, in (0, 1], of the KV "
        "bytes FP8 takes in every layer (e.g. 0.6), with the least summed error; printed with "
        "why each layer got its format and the kv_format= to pass to kvquant.patch",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="keep the largest ratio whose expected MSE is within this relative margin of the "
        "minimum (default 0: the argmin)",
    )
    parser.add_argument(
        "--objective",
        default="mse",
        choices=("mse", "attention"),
        help="mse: expected FP8 MSE of K and of V, every value counted once (default); "
        "attention: errors weighted by their first-order effect on the attention output",
    )
    parser.add_argument(
        "--link",
        action="store_true",
        help="hard-link the unchanged weight shards instead of copying them (configs and "
        "tokenizer files are always copied)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--full",
        action="store_true",
        help="print the per-layer tables (scales, and every format's error per layer)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the calibration report (or the error) as JSON"
    )


def _data_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="a dataset of the datasets library: a hub name (wikitext), a save_to_disk folder "
        "or a local .json/.jsonl/.csv/.parquet file (pip install datasets)",
    )
    group.add_argument(
        "--dataset-config", dest="dataset_config", default=None, help="the dataset's configuration"
    )
    group.add_argument("--split", default="train", help="the split to read (default train)")
    group.add_argument(
        "--text-column",
        dest="text_column",
        default="text",
        help="the column holding the text (default text)",
    )
    group.add_argument(
        "--text",
        type=Path,
        nargs="+",
        action="extend",
        default=None,
        metavar="FILE",
        help="UTF-8 text file(s) instead of a dataset (repeatable); each is cut into "
        "--max-seq-length windows",
    )
    group.add_argument(
        "--num-samples",
        dest="num_samples",
        type=at_least(1),
        default=None,
        help="calibration samples (default: 512 dataset rows; every window of the text files)",
    )
    group.add_argument(
        "--max-seq-length",
        dest="max_seq_length",
        type=at_least(2),
        default=2048,
        help="tokens per sample at most (default 2048)",
    )
    group.add_argument(
        "--max-tokens",
        dest="max_tokens",
        type=at_least(2),
        default=None,
        help="stop after this many tokens in total (default: all samples)",
    )


def _placement_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--device",
        default=None,
        help="torch device to run on: cpu, cuda, cuda:1 (default: cuda when present, else cpu)",
    )
    group.add_argument(
        "--device-map",
        dest="device_map",
        default=None,
        help="transformers device_map (e.g. auto: spread over the GPUs; needs accelerate); "
        "replaces --device",
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="compute dtype (default auto: the model's own, e.g. bfloat16)",
    )


def _k_transform_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--rotation",
        default="hadamard",
        choices=("hadamard", "none"),
        help="rotate K (and the query) by the normalised Hadamard matrix before the offset "
        "(default; head_dim must be a power of two) or not (offset only)",
    )
    group.add_argument(
        "--first-tokens",
        dest="first_tokens",
        type=at_least(0),
        default=1,
        help="first tokens of every sequence attended at full precision and left out of the "
        "offsets and K scales (default 1: the attention sink; 0: none)",
    )
    group.add_argument(
        "--k-centre",
        dest="k_centre",
        default="mean",
        choices=("mean", "midrange"),
        help="per-channel K offset: the mean (default) or (min + max) / 2 over the tokens",
    )


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


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvquant calibrate``; return its exit code."""
    from kvquant.calibrate import calibrate, check_text_file, write_calibrated_checkpoint
    from kvquant.checkpoint.discovery import discover_scales
    from kvquant.checkpoint.writer import check_output_path
    from kvquant.errors import CheckpointError, ExportError
    from kvquant.export import ExportTargetExistsError

    path = checkpoint_dir(args.path)
    try:
        _check_request(args)
        for text in args.text or ():  # before the model loads: a FIFO or a device never hangs
            check_text_file(text)
        found = discover_scales(path)
    except KVQuantError as exc:  # CheckpointError, CalibrationError
        return fail(args, exc, EXIT_USAGE, out, err)
    try:  # before the model runs, by the rule the write applies (as kvquant export does)
        check_output_path(found.path, args.out, args.force)
    except ExportTargetExistsError as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    except ExportError as exc:  # --out is the source, inside it, or holds it
        return fail(args, exc, EXIT_REJECTED, out, err)
    try:  # the tokenizer and the data first: a missing one fails before the model loads
        tokenizer = _load_tokenizer(path, found.path)
        data = _calibration_data(args, tokenizer)
    except KVQuantError as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    try:
        model = _load_for_calibration(args, path)
        if args.kv_budget is not None:  # a budget the model's formats cannot meet: usage
            from kvquant.calibrate.pipeline import check_kv_budget

            check_kv_budget(model, args.kv_budget, args.granularity)
    except KVQuantError as exc:
        return fail(args, exc, EXIT_USAGE, out, err)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        wrapped = CheckpointError(
            f"transformers could not load the model of {path} ({type(exc).__name__}: {first}). "
            "Fix: pass a folder AutoModelForCausalLM loads."
        )
        return fail(args, wrapped, EXIT_USAGE, out, err)
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
            kv_budget=args.kv_budget,
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
        return fail(args, exc, EXIT_USAGE, out, err)
    except KVQuantError as exc:  # CalibrationError, UnsupportedModelError, ExportError
        return fail(args, exc, EXIT_REJECTED, out, err)
    _print_result(args, result, written, out)
    return EXIT_OK


def _check_request(args: argparse.Namespace) -> None:
    """Check the format, convention and data source asked for; settle ``args.convention``.

    Raises:
        CalibrationError: a convention that cannot hold the format, or not exactly one
            data source.
    """
    from kvquant.calibrate.options import Convention, Granularity
    from kvquant.checkpoint.producers import producer_for
    from kvquant.errors import CalibrationError

    k_transform = args.granularity == Granularity.K_TRANSFORM
    if (
        args.convention is None
    ):  # the k-transform has one home; the rest defaults to llm-compressor's
        default = Convention.KVQUANT if k_transform else Convention.COMPRESSED_TENSORS
        args.convention = default.value
    producer = producer_for(args.convention)
    if k_transform:
        if not producer.stores_k_transform:
            raise CalibrationError(
                f"--format k-transform is stored only in kvquant's own convention (k_offset "
                f"tensors and kvquant_kv_transform.json), not {args.convention}: no serving "
                "engine reads it. Fix: drop --convention, or calibrate --format per-head "
                "for a producer convention."
            )
    elif producer.stores_k_transform:
        raise CalibrationError(
            f"--convention {args.convention} holds only the k-transform, not --format "
            f"{args.granularity}. Fix: pass --format k-transform, or drop --convention."
        )
    if args.granularity == Granularity.PER_HEAD and not producer.per_head:
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
            "both --dataset and --text were given; expected one data source. Fix: drop one of them."
        )
    if args.kv_budget is not None:
        from kvquant.calibrate.layer_map import check_budget

        check_budget(args.kv_budget, "--kv-budget")
        if args.held_out_tokens == 0:
            raise CalibrationError(
                "--kv-budget with --held-out-tokens 0; the map is chosen by each layer's "
                "error measured on held-out tokens. Fix: drop --held-out-tokens (512) or pass "
                "a token count."
            )


def _print_result(args: argparse.Namespace, result: Any, written: Path, out: TextIO) -> None:
    """The report and what was written: text, or the JSON object with ``--json``."""
    if args.json:
        print_json({"out": str(written), "convention": args.convention, **result.to_dict()}, out)
        return
    import textwrap

    from kvquant.calibrate.report import READERS

    columns = width(out)
    print(result.render(full=args.full, width=columns, cli=True), file=out)
    readers = READERS.get(result.granularity, "kvquant")
    text = (
        f"wrote {written}: {result.granularity} scales in the {args.convention} "
        f"convention, read by {readers}"
    )
    print("\n" + textwrap.fill(text, width=columns, subsequent_indent="  "), file=out)
    if result.layer_map is not None:
        note = (
            "The per-layer format map is recorded in kvquant-calibration.json but not applied by "
            "the copy's config: pass kv_format= (above) to kvquant.patch or KVQuantConfig when "
            "you load it."
        )
        print(textwrap.fill(note, width=columns, subsequent_indent="  "), file=out)
