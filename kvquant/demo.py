"""``kvquant demo``: a story a newcomer can follow, on CPU, in a temporary folder.

The demo writes tiny random Llama checkpoints carrying FP8 KV scales in each
producer's convention (plus two broken ones), asks the doctor about each, then
loads one with plain transformers, patches it with :func:`kvquant.patch`,
generates, and compares tokens, logits and KV memory with the unpatched model;
a second checkpoint loads through the quantizer plugin
(``from_pretrained(..., quantization_config=kvquant.KVQuantConfig())``).

The demo is a list of steps (:data:`DEMO_STEPS`); add steps with :func:`add_demo_step`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "DEMO_CHECKPOINTS",
    "DEMO_STEPS",
    "DemoCheckpoint",
    "DemoContext",
    "DemoStep",
    "add_demo_step",
    "check_workdir",
    "run_demo",
]


@dataclass(frozen=True)
class DemoCheckpoint:
    """One checkpoint the demo builds.

    Attributes:
        key: short identifier (``"ct-tensor"``, ...).
        title: one line naming the producer and variant.
        story: what a newcomer should learn from it.
        options: keyword arguments of
            :func:`kvquant.testing.checkpoints.write_checkpoint`.
        plain_loadable: whether plain transformers ``from_pretrained`` gives a
            correct model (False for ModelOpt FP8 weights, which it upcasts
            without their weight scales). Later steps that load models skip the others.
    """

    key: str
    title: str
    story: str
    options: dict[str, Any]
    plain_loadable: bool = True


@dataclass
class DemoContext:
    """State shared by the demo steps.

    Attributes:
        workdir: the temporary folder the checkpoints live in.
        out: where the story is printed.
        width: the columns the story is laid out for.
        checkpoints: key -> (demo checkpoint, its folder), filled by the build step.
        reports: key -> :class:`kvquant.report.CheckpointReport`, filled by the doctor step.
        extra: free space for later steps.
    """

    workdir: Path
    out: TextIO
    width: int = 100
    checkpoints: dict[str, tuple[DemoCheckpoint, Path]] = field(default_factory=dict)
    reports: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def say(self, text: str = "", *, wrap: bool = True) -> None:
        """Print one paragraph of the story (wrapped at :attr:`width` columns unless ``wrap=False``)."""
        if wrap and "\n" not in text and len(text) > self.width:
            indent = text[: len(text) - len(text.lstrip(" "))]
            text = textwrap.fill(
                text.lstrip(" "),
                width=self.width,
                initial_indent=indent,
                subsequent_indent=indent + ("    " if indent else ""),
                break_on_hyphens=False,
            )
        print(text, file=self.out)


@dataclass(frozen=True)
class DemoStep:
    """A titled step of ``kvquant demo``.

    Attributes:
        title: shown as a heading.
        run: the step; reads and fills the :class:`DemoContext`.
    """

    title: str
    run: Callable[[DemoContext], None]


def _broken_per_query_head() -> dict[str, Any]:
    import torch

    # layer 0's K scale exported per *query* head (4) instead of per KV head (2)
    return {
        "convention": "compressed-tensors",
        "scales": {(0, "k"): torch.full((4,), 0.02, dtype=torch.bfloat16)},
    }


def _broken_nan() -> dict[str, Any]:
    import torch

    return {"convention": "modelopt", "scales": {(1, "v"): torch.tensor(float("nan"))}}


DEMO_CHECKPOINTS: tuple[DemoCheckpoint, ...] = (
    DemoCheckpoint(
        "ct-tensor",
        "llm-compressor / compressed-tensors, strategy 'tensor'",
        "One bf16 scale of shape (1,) per K and per V: kvquant casts it to fp32 and uses it.",
        {"convention": "compressed-tensors"},
    ),
    DemoCheckpoint(
        "ct-attn_head",
        "llm-compressor / compressed-tensors, strategy 'attn_head'",
        "One bf16 scale per KV head, shape (Hkv, 1, 1): kvquant keeps one fp32 scale per head.",
        {"convention": "compressed-tensors", "granularity": "per-head"},
    ),
    DemoCheckpoint(
        "modelopt",
        "NVIDIA ModelOpt, FP8 KV only",
        "0-dim fp32 scales named k_proj.k_scale / v_proj.v_scale: used exactly as stored.",
        {"convention": "modelopt"},
    ),
    DemoCheckpoint(
        "modelopt-fp8",
        "NVIDIA ModelOpt, FP8 weights + FP8 KV",
        "Same KV scales, but the Linear weights are FP8 with weight_scale / input_scale beside "
        "them. Those are not KV scales and discovery skips them; the doctor warns that plain "
        "transformers would load these weights without their scales (a silently broken model).",
        {"convention": "modelopt", "fp8_weights": True},
        plain_loadable=False,
    ),
    DemoCheckpoint(
        "quark",
        "AMD Quark, default export (pre-RoPE, merged)",
        "Quark measures K before RoPE and stores max(K, V) in both tensors; RoPE can push keys "
        "up to sqrt(2) higher, so kvquant's policy decides whether to widen K.",
        {"convention": "quark"},
    ),
    DemoCheckpoint(
        "legacy",
        "legacy single kv_scale",
        "One scale per layer serves both K and V; kvquant says so.",
        {"convention": "legacy-kv_scale"},
    ),
    DemoCheckpoint(
        "broken-shape",
        "broken: a K scale per query head",
        "Layer 0's K scale has 4 values but the model has 2 KV heads: other engines keep element "
        "[0] or crash obscurely; kvquant rejects it and says what it expected.",
        {},
    ),
    DemoCheckpoint(
        "broken-nan",
        "broken: a NaN V scale",
        "A calibration that diverged left NaN in layer 1's V scale; kvquant rejects it instead of "
        "filling the cache with NaN.",
        {},
    ),
)


def _demo_options(ckpt: DemoCheckpoint) -> dict[str, Any]:
    if ckpt.key == "broken-shape":
        return _broken_per_query_head()
    if ckpt.key == "broken-nan":
        return _broken_nan()
    return dict(ckpt.options)


def _step_build(ctx: DemoContext) -> None:
    from tqdm import tqdm

    from kvquant.testing.checkpoints import write_checkpoint

    ctx.say(
        "kvquant reads the FP8 KV-cache scales that quantization tools store in a checkpoint. "
        "Each tool names, shapes and types them differently. This demo writes tiny random "
        f"Llama checkpoints (2 layers, 4 query heads, 2 KV heads, head_dim 16) under {ctx.workdir}, "
        "one per producer convention, plus two broken ones."
    )
    for ckpt in tqdm(DEMO_CHECKPOINTS, desc="writing checkpoints", unit="ckpt", file=sys.stderr):
        folder = ctx.workdir / ckpt.key
        try:
            folder.mkdir()  # a new folder, or refuse: never write over a user's files
        except FileExistsError as exc:
            from kvquant.errors import ExportTargetExistsError

            raise ExportTargetExistsError(
                f"{folder} already exists; the demo writes its checkpoints into new folders "
                "only. Fix: pass a new folder for --keep, or remove it."
            ) from exc
        path = write_checkpoint(folder, **_demo_options(ckpt))
        ctx.checkpoints[ckpt.key] = (ckpt, path)


def _step_doctor(ctx: DemoContext) -> None:
    from kvquant.report import inspect_checkpoint

    ctx.say(
        "For each checkpoint, `kvquant doctor PATH` reads config.json and the safetensors headers, "
        "loads only the scale tensors (never the weights) and shows what kvquant would do with "
        "every layer's K and V scale: use it as is, convert it (e.g. bf16 -> fp32), or reject it."
    )
    for key, (ckpt, path) in ctx.checkpoints.items():
        report = inspect_checkpoint(path)
        ctx.reports[key] = report
        ctx.say()
        ctx.say(f"--- {ckpt.title} ({key}) ---")
        ctx.say(ckpt.story)
        ctx.say(f"$ kvquant doctor {path}", wrap=False)
        ctx.say(report.render(width=ctx.width, cli=True), wrap=False)
        ctx.say(f"(exit code {report.exit_code})")


def _step_summary(ctx: DemoContext) -> None:
    ctx.say("Summary: what kvquant would do with each checkpoint")
    width = max((len(k) for k in ctx.reports), default=4)
    for key, report in ctx.reports.items():
        verdict = "loads" if report.ok else "REJECTED"
        ctx.say(f"  {key:<{width}}  {verdict:<8}  {report.summary}")
    ctx.say()
    ctx.say(
        "Try it on your own checkpoint: `kvquant doctor /path/to/model` "
        "(add --json for machines, --scale-format per-tensor to see a lossy reduction)."
    )


NEW_TOKENS = 24


def _cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _greedy(model: Any, ids: Any) -> Any:
    return model.generate(
        ids,
        attention_mask=ids.new_ones(ids.shape),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def _cache_of(out: Any) -> Any:
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _step_generate(ctx: DemoContext) -> None:
    """Load a demo checkpoint, generate with and without kvquant, and compare.

    Uses the ``legacy`` checkpoint through plain transformers + ``kvquant.patch``
    and the ``modelopt`` one through the load-time hook
    (``from_pretrained(..., quantization_config=kvquant.KVQuantConfig())``).
    """
    from kvquant.integrations.hf.quantizer import quiet_loading

    logger = logging.getLogger("kvquant")
    level = logger.level
    logger.setLevel(logging.WARNING)  # the story says what patch decided
    try:
        with quiet_loading():  # no load bars, no UNEXPECTED-keys report in the story
            _generate_story(ctx)
    finally:
        logger.setLevel(level)


def _generate_story(ctx: DemoContext) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import kvquant

    _, legacy = ctx.checkpoints["legacy"]
    _, modelopt = ctx.checkpoints["modelopt"]

    ctx.say(
        "Now the real thing, on CPU. Plain transformers loads the legacy checkpoint but drops its "
        "kv_scale tensors as unexpected keys; kvquant.patch(model) reads them back from the "
        "checkpoint folder, checks them, and routes attention through kvquant's FP8 paged cache."
    )
    model = AutoModelForCausalLM.from_pretrained(legacy, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=gen)

    ref = _greedy(model, ids)
    ref_cache = _cache_of(ref)
    ctx.say("$ python -c 'handle = kvquant.patch(model); model.generate(...)'", wrap=False)
    handle = kvquant.patch(model)
    out = _greedy(model, ids)
    cache = _cache_of(out)
    new_ref = ref.sequences[:, ids.shape[1] :]
    new_out = out.sequences[:, ids.shape[1] :]
    agree = float((new_ref == new_out).float().mean())
    cos = min(_cosine(a, b) for a, b in zip(ref.logits, out.logits, strict=True))
    ctx.say(f"  scales in use: {handle.scales.granularity} (from {legacy.name}/)")
    ctx.say(f"  cache object:  {type(cache).__name__}", wrap=False)
    ctx.say(
        f"  {NEW_TOKENS} greedy tokens x 2 sequences: {agree:.0%} identical to unpatched; "
        f"lowest per-step logit cosine {cos:.5f}"
    )

    held = cache.memory_bytes()
    ring, pool = held["recent"], held["total"] - held["recent"]
    slots = sum(layer.storage.num_pages * layer.storage.page_size for layer in cache.layers)
    tokens = int(ref_cache.layers[0].keys.shape[2])
    stored = tokens * ids.shape[0] * len(cache.layers)  # token slots in use, all layers
    fp8 = pool * stored // slots
    bf16 = sum(2 * layer.keys.numel() * 2 for layer in ref_cache.layers)
    newest = cache.layers[0].storage.recent
    ctx.say(
        f"  KV memory for {ids.shape[0]} x {tokens} tokens: {fp8:,} bytes in FP8 pages "
        f"(scales included) vs {bf16:,} bytes in a bf16 DynamicCache ({fp8 / bf16:.0%}); "
        f"the page pool reserves {pool:,} bytes up front"
        + (
            f", and each sequence's {newest.length} newest tokens are also kept at full "
            f"precision ({ring:,} bytes in all, however long the sequences grow)"
            if newest is not None
            else ""
        )
    )
    handle.remove()
    after = _greedy(model, ids)
    same = bool(torch.equal(after.sequences, ref.sequences))
    ctx.extra["generate"] = {
        "token_agreement": agree,
        "min_logit_cosine": cos,
        "fp8_bytes": fp8,
        "bf16_bytes": bf16,
        "recent_bytes": ring,
        "restored": same,
    }
    ctx.say(f"  handle.remove(): tokens identical to before patching: {same}")

    ctx.say()
    ctx.say(
        "The ModelOpt checkpoint loads with its scales in one call, through transformers' "
        "quantizer plugin: from_pretrained(path, quantization_config=kvquant.KVQuantConfig())."
    )
    loaded = AutoModelForCausalLM.from_pretrained(
        modelopt, dtype=torch.float32, quantization_config=kvquant.KVQuantConfig()
    ).eval()
    out2 = _greedy(loaded, ids)
    scales = kvquant.patch(loaded).scales  # already patched: returns the load-time handle
    ctx.extra["generate"]["load_time_granularity"] = scales.granularity
    ctx.say(
        f"  patched at load: {scales.granularity} scales for {len(scales.layers)} layers; "
        f"generated {out2.sequences.shape[1] - ids.shape[1]} tokens with "
        f"{type(_cache_of(out2)).__name__}"
    )


DEMO_STEPS: list[DemoStep] = [
    DemoStep("Write one tiny checkpoint per producer", _step_build),
    DemoStep("Ask the doctor about each", _step_doctor),
    DemoStep("Load, patch and generate", _step_generate),
    DemoStep("Summary", _step_summary),
]
"""The demo's steps, run in order. Append with :func:`add_demo_step`."""


def add_demo_step(
    title: str, run: Callable[[DemoContext], None], *, before: str | None = None
) -> DemoStep:
    """Add a step to ``kvquant demo`` (at the end, or before the step titled ``before``).

    Args:
        title: heading printed before the step.
        run: the step function; receives the shared :class:`DemoContext`.
        before: title of an existing step to insert before (e.g. ``"Summary"``).

    Returns:
        The new step.

    Raises:
        ValueError: ``before`` names no step.
    """
    step = DemoStep(title, run)
    if before is None:
        DEMO_STEPS.append(step)
        return step
    for i, existing in enumerate(DEMO_STEPS):
        if existing.title == before:
            DEMO_STEPS.insert(i, step)
            return step
    raise ValueError(f"no demo step titled {before!r}; steps are {[s.title for s in DEMO_STEPS]}")


def check_workdir(workdir: Path, option: str = "workdir") -> None:
    """Refuse a demo folder the demo cannot write into without touching a user's file.

    The demo writes one new subfolder per checkpoint (``quark/``, ...) into
    ``workdir``, which may exist; an existing entry of one of those names is
    refused, never written over.

    Args:
        workdir: the folder the demo would keep its checkpoints in.
        option: how the message names it (``--keep`` on the command line).

    Raises:
        ExportTargetExistsError: a file stands at ``workdir`` or one of its
            parents, or ``workdir`` already holds one of the demo's checkpoint
            folder names (nothing is written).
    """
    from kvquant.errors import ExportTargetExistsError

    blocker = next((p for p in (workdir, *workdir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ExportTargetExistsError(
            f"{option} {workdir}: {blocker} is a file, not a folder; the demo writes its "
            f"checkpoints into a folder. Fix: pass a folder (new or existing) for {option}."
        )
    taken = [c.key for c in DEMO_CHECKPOINTS if os.path.lexists(workdir / c.key)]
    if taken:
        raise ExportTargetExistsError(
            f"{option} {workdir}: it already holds {', '.join(taken[:4])}"
            f"{' ...' if len(taken) > 4 else ''}; the demo writes its checkpoints into new "
            f"folders of those names and never writes over existing files. Fix: pass a new "
            f"folder for {option}, or remove those entries."
        )


def run_demo(
    out: TextIO | None = None,
    *,
    workdir: Path | None = None,
    steps: Sequence[DemoStep] | None = None,
    width: int = 100,
) -> DemoContext:
    """Run the demo steps and print the story.

    Args:
        out: where to print (default stdout).
        workdir: keep the checkpoints in this folder (default: a temporary
            folder deleted afterwards).
        steps: the steps to run (default :data:`DEMO_STEPS`).
        width: the columns the story is laid out for (``kvquant demo``: the terminal's).

    Returns:
        The context after the last step (checkpoint paths may be gone when
        ``workdir`` was not given).

    Raises:
        ExportTargetExistsError: ``workdir`` is, or lies under, a file
            (:func:`check_workdir`; nothing written).
    """
    stream = out if out is not None else sys.stdout
    chosen = list(steps if steps is not None else DEMO_STEPS)
    started = time.perf_counter()

    def _run(folder: Path) -> DemoContext:
        ctx = DemoContext(workdir=folder, out=stream, width=width)
        for i, step in enumerate(chosen, 1):
            ctx.say()
            ctx.say(f"== Step {i}/{len(chosen)}: {step.title} ==")
            step.run(ctx)
        ctx.say()
        ctx.say(f"(demo finished in {time.perf_counter() - started:.1f} s)")
        return ctx

    if workdir is not None:
        check_workdir(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return _run(workdir)
    with tempfile.TemporaryDirectory(prefix="kvquant-demo-") as tmp:
        return _run(Path(tmp))
