"""Synthetic producer checkpoints for tests, demos and benchmarks.

:func:`write_checkpoint` writes a tiny Llama checkpoint whose KV scales are named, shaped, typed
and configured as one producer exports them (docs/dev/checkpoint.md, "Synthetic checkpoints").

Example:
    >>> import tempfile, torch
    >>> from kvquant.testing.checkpoints import write_checkpoint
    >>> with tempfile.TemporaryDirectory() as d:
    ...     nan = {(0, "k"): torch.tensor([float("nan")])}
    ...     path = write_checkpoint(d, convention="compressed-tensors", weights="none",
    ...                             drop=[(1, "v")], scales=nan)
    ...     sorted(p.name for p in path.iterdir())
    ['config.json', 'model.safetensors']
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from kvquant.checkpoint import producers as conventions
from kvquant.checkpoint.producers import NO_PRODUCER, PRODUCERS, Producer
from kvquant.checkpoint.producers.base import stored_scheme
from kvquant.schemes import PerTensorScales

__all__ = [
    "CONVENTIONS",
    "K_TRANSFORM",
    "default_k_offsets",
    "default_scale_values",
    "producer_checkpoint",
    "scale_tensor_name",
    "write_checkpoint",
    "write_hf_cache_entry",
]


K_TRANSFORM = "kvquant-k-transform"
"""kvquant's own k-transform convention (per-head scales, K offsets, the settings file)."""

CONVENTIONS: tuple[str, ...] = (
    *(p.name for p in PRODUCERS if not p.stores_k_transform),
    K_TRANSFORM,
    NO_PRODUCER,
)
"""The producer conventions :func:`write_checkpoint` can write (every registered producer)."""

_PRODUCER_OF: dict[str, Producer] = {
    (K_TRANSFORM if p.stores_k_transform else p.name): p for p in PRODUCERS
}

_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def scale_tensor_name(convention: str, layer: int, kind: str) -> str:
    """Return the tensor name a producer uses for one KV scale.

    Args:
        convention: one of :data:`CONVENTIONS` (not ``"none"``).
        layer: decoder layer index.
        kind: ``"k"`` or ``"v"`` (``"kv"`` for ``"legacy-kv_scale"``).

    Returns:
        The name, e.g. ``model.layers.0.self_attn.k_proj.k_scale``.

    Raises:
        ValueError: unknown convention or a kind the convention does not use
            (:class:`~kvquant.errors.ConventionError`).
    """
    return conventions.producer_for(convention).tensor_name(layer, kind)


def default_scale_values(
    num_layers: int, num_kv_heads: int, *, per_head: bool = False
) -> dict[tuple[int, str], torch.Tensor]:
    """Deterministic, distinct, positive fp32 K/V scales (before producer shaping).

    K of layer ``l`` is ``0.02 * (l + 1)``, V is ``0.01 * (l + 1)``; per-head
    values add ``0.001 * h`` for head ``h``.

    Args:
        num_layers: decoder layers.
        num_kv_heads: KV heads.
        per_head: return ``[num_kv_heads]`` tensors instead of scalars.

    Returns:
        ``{(layer, "k"|"v"): fp32 tensor [] or [num_kv_heads]}``.
    """
    out: dict[tuple[int, str], torch.Tensor] = {}
    for layer in range(num_layers):
        for kind, base in (("k", 0.02), ("v", 0.01)):
            value = base * (layer + 1)
            if per_head:
                out[(layer, kind)] = value + 0.001 * torch.arange(num_kv_heads, dtype=torch.float32)
            else:
                out[(layer, kind)] = torch.tensor(value, dtype=torch.float32)
    return out


def default_k_offsets(
    num_layers: int, num_kv_heads: int, head_dim: int, *, seed: int = 0
) -> dict[int, torch.Tensor]:
    """Deterministic fp32 ``[Hkv, head_dim]`` K offsets (``0.5 * N(0, 1)``), one per layer."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return {
        layer: 0.5 * torch.randn(num_kv_heads, head_dim, generator=gen)
        for layer in range(num_layers)
    }


def _k_transform_tensors(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    scales: Mapping[tuple[int, str], float | torch.Tensor] | None,
    k_offsets: Mapping[int, torch.Tensor] | None,
    drop: set[tuple[int, str]],
    seed: int,
) -> dict[str, torch.Tensor]:
    """kvquant's k-transform tensors: fp32 ``[Hkv]`` K/V scales and fp32 ``[Hkv, D]`` K offsets."""
    values: dict[tuple[int, str], float | torch.Tensor] = dict(
        default_scale_values(num_layers, num_kv_heads, per_head=True)
    )
    values.update(scales or {})
    offsets: dict[int, torch.Tensor] = default_k_offsets(
        num_layers, num_kv_heads, head_dim, seed=seed
    )
    offsets.update(k_offsets or {})
    out: dict[str, torch.Tensor] = {}
    for layer in range(num_layers):
        for kind in ("k", "v"):
            if (layer, kind) in drop:
                continue
            value = values[(layer, kind)]
            if not isinstance(value, torch.Tensor):
                value = torch.full((num_kv_heads,), float(value), dtype=torch.float32)
            out[f"model.layers.{layer}.self_attn.{kind}_scale"] = value.clone()
        if (layer, "k_offset") not in drop:
            out[conventions.k_offset_tensor_name(layer)] = offsets[layer].clone()
    return out


def _merged_kv_value(
    layer: int, values: Mapping[tuple[int, str], float | torch.Tensor]
) -> float | torch.Tensor:
    """The one scale a single-``kv`` producer stores: ``max(K, V)`` unless given."""
    k, v = values[(layer, "k")], values[(layer, "v")]
    kt = k if isinstance(k, torch.Tensor) else torch.tensor(float(k))
    vt = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return float(torch.maximum(kt.float().amax(), vt.float().amax()))


def _kv_scale_tensors(
    producer: Producer,
    granularity: str,
    num_layers: int,
    num_kv_heads: int,
    scale_dtype: torch.dtype,
    post_rope: bool,
    scales: Mapping[tuple[int, str], float | torch.Tensor] | None,
    drop: set[tuple[int, str]],
) -> dict[str, torch.Tensor]:
    values: dict[tuple[int, str], float | torch.Tensor] = dict(
        default_scale_values(num_layers, num_kv_heads, per_head=stored_scheme(granularity).per_head)
    )
    explicit = dict(scales or {})
    stored_as_given: dict[tuple[int, str], torch.Tensor] = {}
    for key, value in explicit.items():
        if isinstance(value, torch.Tensor) and key[1] != "kv":
            stored_as_given[key] = value
        values[key] = value
    out: dict[str, torch.Tensor] = {}
    if set(producer.suffixes) == {"kv"}:  # one scale serves K and V
        for layer in range(num_layers):
            if (layer, "kv") in drop:
                continue
            given = explicit.get((layer, "kv"))
            name = producer.tensor_name(layer, "kv")
            if isinstance(given, torch.Tensor):
                out[name] = given.clone()
                continue
            if given is None:
                given = _merged_kv_value(layer, values)
            out[name] = producer.stored_scale(given, PerTensorScales, num_kv_heads, scale_dtype)
        return out
    merged = producer.writes_merged(post_rope=post_rope)
    for layer in range(num_layers):
        shaped: dict[str, torch.Tensor] = {}
        for kind in ("k", "v"):
            shaped[kind] = producer.stored_scale(
                values[(layer, kind)], granularity, num_kv_heads, scale_dtype
            )
        if merged:
            both = torch.maximum(shaped["k"].float(), shaped["v"].float()).to(scale_dtype)
            shaped = {kind: both.clone() for kind in shaped}
        for kind in ("k", "v"):
            if (layer, kind) in drop:
                continue
            tensor = stored_as_given.get((layer, kind), shaped[kind])
            out[producer.tensor_name(layer, kind)] = tensor.clone()
    return out


def _llama_config_dict(
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    vocab_size: int,
    multimodal: bool,
) -> dict[str, Any]:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    data = cfg.to_dict()
    data["dtype"] = "bfloat16"
    data.pop("torch_dtype", None)
    if multimodal:
        text = {k: v for k, v in data.items() if k not in ("architectures", "transformers_version")}
        data = {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "text_config": text,
        }
    return data


def _random_weights(
    config: Mapping[str, Any], seed: int, fp8_weights: bool
) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if not fp8_weights:
        return state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.split("layers.")[-1].split(".", 1)[-1] in _LINEARS:
            amax = tensor.float().abs().amax().clamp_min(1e-12)
            scale = (amax / 448.0).to(torch.float32)
            q = (tensor.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            out[name] = q
            out[f"{module}.weight_scale"] = scale.reshape(())
            out[f"{module}.input_scale"] = torch.tensor(0.05, dtype=torch.float32)
        else:
            out[name] = tensor
    return out


def _write_shards(root: Path, tensors: Mapping[str, torch.Tensor], shards: int) -> list[Path]:
    from safetensors.torch import save_file

    names = sorted(tensors)
    if shards == 1:
        file = root / "model.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(file), metadata={"format": "pt"})
        return [file]
    if len(names) < shards:
        raise ValueError(f"cannot split {len(names)} tensors into {shards} non-empty shards")
    base, extra = divmod(len(names), shards)
    bounds = [0]
    for i in range(shards):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    chunks = [names[bounds[i] : bounds[i + 1]] for i in range(shards)]
    weight_map: dict[str, str] = {}
    files = []
    total = 0
    for i, chunk in enumerate(chunks):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in chunk}
        save_file(part, str(root / fname), metadata={"format": "pt"})
        files.append(root / fname)
        for n in chunk:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def write_checkpoint(
    path: str | Path,
    *,
    convention: str,
    granularity: Literal["per-tensor", "per-head"] = "per-tensor",
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int | None = None,
    vocab_size: int = 128,
    scale_dtype: torch.dtype | None = None,
    scales: Mapping[tuple[int, str], float | torch.Tensor] | None = None,
    drop: Iterable[tuple[int, str]] = (),
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    weights: Literal["tiny-random", "none"] = "tiny-random",
    shards: int = 1,
    fp8_weights: bool = False,
    post_rope: bool = False,
    quant_config_updates: Mapping[str, Any] | None = None,
    multimodal: bool = False,
    seed: int = 0,
    k_offsets: Mapping[int, torch.Tensor] | None = None,
    kv_transform: Mapping[str, Any] | None = None,
    kv_transform_file: bool = True,
) -> Path:
    """Write a tiny Llama checkpoint whose KV scales follow one producer's convention.

    The folder gets ``config.json`` (a ``LlamaConfig`` and the producer's ``quantization_config``),
    ``hf_quant_config.json`` for ModelOpt, and ``model.safetensors`` (or ``shards`` files and the
    index). Each convention's tensors: docs/dev/checkpoint.md ("Synthetic checkpoints").

    Args:
        path: the folder to write (created; existing files of the same names are replaced).
        convention: one of :data:`CONVENTIONS`.
        granularity: ``"per-head"``: compressed-tensors ``attn_head`` scales (that one only).
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: KV heads.
        head_dim: elements per head.
        hidden_size: model width; default ``num_heads * head_dim``.
        vocab_size: vocabulary size of the random model.
        scale_dtype: dtype of the stored scales; default the producer's.
        scales: values keyed ``(layer, "k"|"v"|"kv")`` (default :func:`default_scale_values`).
            A float is shaped, typed and merged as the producer would; a tensor is stored
            exactly as given, unmerged (to corrupt: NaN, zero, shape ``(num_heads,)``, int...).
        drop: ``(layer, kind)`` pairs whose tensor is left out (e.g. ``[(1, "v")]``).
        extra_tensors: more tensors to store by name (zero points, ``q_scale``, ...).
        weights: ``"tiny-random"``: a random bf16 ``LlamaForCausalLM``; ``"none"``: the
            scales only (fast; not loadable as a model).
        shards: number of safetensors files (``> 1`` also writes the index).
        fp8_weights: ModelOpt only: FP8 decoder Linear weights (``weight_scale``, ``input_scale``).
        post_rope: Quark only: ``kv_cache_post_rope: true`` (separate, post-RoPE K and V).
        quant_config_updates: keys merged into ``quantization_config``.
        multimodal: nest the Llama config under ``text_config`` (a Llava-style config).
        seed: seed of the random weights (and of the default K offsets).
        k_offsets: ``"kvquant-k-transform"`` only: per-layer K offsets stored as given
            (default :func:`default_k_offsets`); ``drop`` takes ``(layer, "k_offset")`` too.
        kv_transform: ``"kvquant-k-transform"`` only: entries merged into
            ``kvquant_kv_transform.json`` (default: rotation ``"hadamard"``, first_tokens 1).
        kv_transform_file: ``"kvquant-k-transform"`` only: False writes offsets without that file.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: an unknown convention or an option the convention does not support.
    """
    producer = _check_options(
        convention, granularity, weights, fp8_weights, post_rope, shards, num_heads, num_kv_heads
    )
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    hidden = hidden_size if hidden_size is not None else num_heads * head_dim
    geometry = (num_layers, num_heads, num_kv_heads, head_dim, hidden, vocab_size)
    dtype = scale_dtype or (producer.default_dtype if producer is not None else torch.float32)
    text_config = _llama_config_dict(*geometry, multimodal=False)
    tensors = _random_weights(text_config, seed, fp8_weights) if weights == "tiny-random" else {}
    tensors.update(
        _scale_tensors(convention, producer, granularity, num_layers, num_kv_heads, head_dim,
                       dtype, post_rope, scales, set(drop), k_offsets, seed)
    )  # fmt: skip
    tensors.update({k: v.detach().clone() for k, v in (extra_tensors or {}).items()})
    if not tensors:  # safetensors needs at least one tensor for a valid file
        tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    config = _llama_config_dict(*geometry, multimodal=True) if multimodal else text_config
    qcfg, hf_quant = _quant_configs(
        convention, producer, granularity, fp8_weights, post_rope, dtype, quant_config_updates
    )
    if qcfg is not None:
        config["quantization_config"] = qcfg
    settings = None
    if convention == K_TRANSFORM and kv_transform_file:
        settings = _kv_transform_settings(num_layers, num_kv_heads, head_dim, kv_transform)
    _write_folder(root, config, tensors, shards, hf_quant, settings)
    return root


def _scale_tensors(
    convention: str,
    producer: Producer | None,
    granularity: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    scale_dtype: torch.dtype,
    post_rope: bool,
    scales: Mapping[tuple[int, str], float | torch.Tensor] | None,
    drop: set[tuple[int, str]],
    k_offsets: Mapping[int, torch.Tensor] | None,
    seed: int,
) -> dict[str, torch.Tensor]:
    """The KV-scale (and K-offset) tensors of ``convention``; none for ``"none"``."""
    if convention == K_TRANSFORM:
        return _k_transform_tensors(
            num_layers, num_kv_heads, head_dim, scales, k_offsets, drop, seed
        )
    if producer is not None:
        return _kv_scale_tensors(
            producer, granularity, num_layers, num_kv_heads, scale_dtype, post_rope, scales, drop
        )
    if scales:
        raise ValueError(
            "write_checkpoint(convention='none') stores no KV scales; pass a producer "
            "convention to write scales, or extra_tensors for arbitrary tensors"
        )
    return {}


def _kv_transform_settings(
    num_layers: int, num_kv_heads: int, head_dim: int, updates: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``kvquant_kv_transform.json``: a Hadamard rotation, one first token, ``updates`` merged."""
    settings = conventions.kv_transform_config(
        rotation="hadamard", first_tokens=1, head_dim=head_dim, num_kv_heads=num_kv_heads,
        num_layers=num_layers,
    )  # fmt: skip
    settings.update(updates or {})
    return settings


def _quant_configs(
    convention: str,
    producer: Producer | None,
    granularity: str,
    fp8_weights: bool,
    post_rope: bool,
    scale_dtype: torch.dtype,
    updates: Mapping[str, Any] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(quantization_config, hf_quant_config.json)`` of the producer, ``updates`` merged."""
    qcfg, hf_quant = None, None
    if producer is not None and convention != K_TRANSFORM:
        qcfg, hf_quant = producer.configs(
            granularity=granularity, fp8_weights=fp8_weights, post_rope=post_rope,
            scale_dtype=scale_dtype,
        )  # fmt: skip
    if updates:
        qcfg = dict(qcfg or {})
        qcfg.update(updates)
    return qcfg, hf_quant


_OPTION_TEXT = {
    "fp8_weights": "the FP8-weight export",
    "post_rope": "Quark's kv_cache_post_rope",
}


def _check_options(
    convention: str,
    granularity: str,
    weights: str,
    fp8_weights: bool,
    post_rope: bool,
    shards: int,
    num_heads: int,
    num_kv_heads: int,
) -> Producer | None:
    """The producer :func:`write_checkpoint` writes (None for ``"none"``), or ValueError."""
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; expected one of {CONVENTIONS}")
    producer = _PRODUCER_OF.get(convention)  # None: NO_PRODUCER
    scheme = stored_scheme(granularity)  # ConventionError (a ValueError) for any other word
    per_head = producer is not None and (producer.per_head or producer.stores_k_transform)
    if scheme.per_head and not per_head:
        raise ValueError(
            f"granularity='per-head' is a compressed-tensors (attn_head) export; {convention} "
            "writes per-tensor scales (pass explicit tensors in scales= to store other shapes)"
        )
    for option, on in (("fp8_weights", fp8_weights), ("post_rope", post_rope)):
        if on and (producer is None or option not in producer.write_options):
            names = " or ".join(repr(p.name) for p in PRODUCERS if option in p.write_options)
            raise ValueError(
                f"{option}=True is supported for convention={names} only ({_OPTION_TEXT[option]})"
            )
    if fp8_weights and weights != "tiny-random":
        raise ValueError("fp8_weights=True needs weights='tiny-random'")
    if weights not in ("tiny-random", "none"):
        raise ValueError(f"weights must be 'tiny-random' or 'none', got {weights!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return producer


def _write_folder(
    root: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    shards: int,
    hf_quant: Mapping[str, Any] | None,
    settings: Mapping[str, Any] | None,
) -> None:
    """Write the shards, config.json and the side files, replacing stale ones of the same names."""
    for stale in root.glob("*.safetensors"):
        stale.unlink()
    index = root / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    _write_shards(root, tensors, shards)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, content in (
        ("hf_quant_config.json", hf_quant),
        (conventions.KV_TRANSFORM_FILE, settings),
    ):
        if content is not None:
            (root / name).write_text(json.dumps(content, indent=2) + "\n")
        elif (root / name).exists():
            (root / name).unlink()


def producer_checkpoint(path: str | Path, producer: Producer, **options: Any) -> Path:
    """:func:`write_checkpoint` in ``producer``'s convention (kvquant's own: the k-transform).

    Args:
        path: the folder to write.
        producer: a registered producer (:data:`kvquant.checkpoint.producers.PRODUCERS`).
        options: more :func:`write_checkpoint` keyword arguments.

    Returns:
        The checkpoint folder.
    """
    convention = K_TRANSFORM if producer.stores_k_transform else producer.name
    return write_checkpoint(path, convention=convention, **options)


def write_hf_cache_entry(
    cache_dir: str | Path,
    repo_id: str,
    folder: str | Path,
    *,
    commit: str = "0" * 40,
    ref: str | None = "main",
) -> Path:
    """Put a checkpoint folder into a Hugging Face hub cache, laid out as ``huggingface_hub`` does.

    ``models--{org}--{name}/blobs/`` holds the files, ``snapshots/{commit}/``
    symlinks to them (subfolders too), ``refs/{ref}`` names the commit. Point
    ``HF_HUB_CACHE`` at ``cache_dir`` (and set ``HF_HUB_OFFLINE=1``) to load
    ``repo_id`` from it.

    Args:
        cache_dir: the hub cache folder.
        repo_id: ``"org/name"``.
        folder: the checkpoint to store.
        commit: the 40-hex-digit commit the snapshot is filed under.
        ref: the branch or tag naming the commit (``None``: no ref, as after
            a download at a commit hash).

    Returns:
        The snapshot folder.
    """
    import hashlib
    import os
    import shutil

    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    source = Path(folder)
    for file in sorted(source.rglob("*")):
        if not file.is_file():
            continue
        rel = file.relative_to(source)
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
