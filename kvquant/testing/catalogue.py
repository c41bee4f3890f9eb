"""The catalogue of odd checkpoints the doors must handle: a stray file, a name in two shards, a
stale index, a FIFO beside the weights, NaN scales, ... each with the outcome it must get."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from kvquant.testing.synthetic import K_TRANSFORM, scale_tensor_name, write_checkpoint

__all__ = [
    "CATALOGUE",
    "CatalogueEntry",
]


# ---------------------------------------------------------------------------
# the catalogue: one small checkpoint per behaviour every entry point must agree on


def _stray_file(root: Path) -> Path:
    """A stale ``zz-stale.safetensors`` whose K scale (7.0) must never win over model.safetensors."""
    from safetensors.torch import save_file

    name = scale_tensor_name("compressed-tensors", 0, "k")
    save_file({name: torch.tensor([7.0], dtype=torch.bfloat16)}, str(root / "zz-stale.safetensors"))
    return root


def _name_in_two_shards(root: Path) -> Path:
    """A sharded checkpoint where a second shard also holds layer 0's K scale (value 7.0)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((root / "model.safetensors.index.json").read_text())
    name = scale_tensor_name("compressed-tensors", 0, "k")
    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})[0]
    tensors = load_file(str(root / other))
    tensors[name] = torch.tensor([7.0], dtype=torch.bfloat16)
    save_file(tensors, str(root / other), metadata={"format": "pt"})
    return root


def _index_names_the_wrong_shard(root: Path) -> Path:
    """An index whose weight_map sends every tensor to the first shard (the second's are lost)."""
    path = root / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = dict.fromkeys(index["weight_map"], first)
    path.write_text(json.dumps(index, indent=2))
    return root


def _unreadable_hf_quant_config(root: Path) -> Path:
    (root / "hf_quant_config.json").write_text("{ not json")
    return root


def _nan_scales_checkpoint(path: Path, **options: Any) -> Path:
    """A decoy copy of the default catalogue checkpoint whose layer-0 K scale is NaN."""
    return write_checkpoint(
        path, convention="compressed-tensors", scales={(0, "k"): torch.tensor([float("nan")])},
        **options,
    )  # fmt: skip


def _shards_in_a_subfolder(root: Path) -> Path:
    """Move the shards into ``weights/`` (the index names them there) and leave a decoy
    ``config.json`` and ``model.safetensors`` with a NaN K scale beside them."""
    import shutil
    import tempfile

    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    sub = root / "weights"
    sub.mkdir()
    for shard in sorted(set(index["weight_map"].values())):
        (root / shard).rename(sub / shard)
    index["weight_map"] = {k: f"weights/{v}" for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2))
    with tempfile.TemporaryDirectory() as tmp:
        decoy = _nan_scales_checkpoint(Path(tmp) / "decoy")
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(decoy / name, sub / name)
    return root


def _stale_index_beside_single_file(root: Path) -> Path:
    """Add a stale index and shards holding a NaN K scale beside ``model.safetensors``:
    transformers loads ``model.safetensors`` and ignores the index."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        decoy = _nan_scales_checkpoint(Path(tmp) / "decoy", shards=2)
        for file in decoy.iterdir():
            if file.name != "config.json":
                shutil.copyfile(file, root / file.name)
    return root


def _weights_named_by_config(root: Path) -> Path:
    """Move the weights to ``weights/kv.safetensors``, named by config.json's
    ``transformers_weights``; a decoy ``model.safetensors`` with a NaN K scale stays."""
    import shutil
    import tempfile

    (root / "weights").mkdir()
    (root / "model.safetensors").rename(root / "weights" / "kv.safetensors")
    config = json.loads((root / "config.json").read_text())
    config["transformers_weights"] = "weights/kv.safetensors"
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    with tempfile.TemporaryDirectory() as tmp:
        decoy = _nan_scales_checkpoint(Path(tmp) / "decoy")
        shutil.copyfile(decoy / "model.safetensors", root / "model.safetensors")
    return root


def _leftover_text_config(root: Path) -> Path:
    """A Llama config.json that also carries a stale ``text_config`` of another geometry."""
    config = json.loads((root / "config.json").read_text())
    config["text_config"] = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "hidden_size": 256,
        "head_dim": 32,
    }
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return root


def _fifo_beside_the_weights(root: Path) -> Path:
    """A FIFO named ``tokenizer.model`` in the folder: no reader may open it (it would block).

    (On a system without FIFOs the folder is left as it is.)
    """
    import os

    if hasattr(os, "mkfifo"):
        os.mkfifo(root / "tokenizer.model")
    return root


def _kvquant_saved_scales() -> dict[str, torch.Tensor]:
    """The fp32 ``()`` K/V scales ``save_pretrained`` writes for a patched model."""
    return {
        f"model.layers.{i}.self_attn.{k}_scale": torch.tensor(
            0.01 * (i + 1) + (0.002 if k == "v" else 0)
        )
        for i in range(2)
        for k in "kv"
    }


def _zero_points() -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.{k}_zero_point": torch.zeros(1, dtype=torch.int8)
        for i in range(2)
        for k in "kv"
    }


@dataclass(frozen=True)
class CatalogueEntry:
    """One checkpoint of :data:`CATALOGUE`.

    Attributes:
        description: what the checkpoint exercises.
        expect: ``"load"`` (every entry point loads it with the same scales),
            ``"refuse"`` (every entry point refuses its KV scales:
            :class:`~kvquant.errors.ScaleFormatError`, ``kvquant doctor`` exit 1)
            or ``"unreadable"`` (not a readable checkpoint:
            :class:`~kvquant.errors.CheckpointError`, ``kvquant doctor`` exit 2).
        options: :func:`write_checkpoint` keyword arguments.
        edit: a change made to the written folder (a stray file, a broken file).
    """

    description: str
    expect: Literal["load", "refuse", "unreadable"]
    options: Mapping[str, Any]
    edit: Callable[[Path], Path] | None = None

    def write(self, path: str | Path) -> Path:
        """Write the checkpoint (tiny random Llama weights) into ``path``; return the folder."""
        root = write_checkpoint(path, **self.options)
        return self.edit(root) if self.edit is not None else root


CATALOGUE: Mapping[str, CatalogueEntry] = {
    "compressed-tensors": CatalogueEntry(
        "per-tensor bf16 (1,) scales", "load", {"convention": "compressed-tensors"}
    ),
    "compressed-tensors-per-head": CatalogueEntry(
        "attn_head (Hkv,1,1) scales",
        "load",
        {"convention": "compressed-tensors", "granularity": "per-head"},
    ),
    "compressed-tensors-sharded": CatalogueEntry(
        "three shards and an index", "load", {"convention": "compressed-tensors", "shards": 3}
    ),
    "modelopt": CatalogueEntry("fp32 () scales", "load", {"convention": "modelopt"}),
    "modelopt-fp16": CatalogueEntry(
        "fp16 () scales", "load", {"convention": "modelopt", "scale_dtype": torch.float16}
    ),
    "quark": CatalogueEntry("pre-RoPE max(K, V) in both", "load", {"convention": "quark"}),
    "quark-post-rope": CatalogueEntry(
        "separate post-RoPE K and V", "load", {"convention": "quark", "post_rope": True}
    ),
    "quark-fp8": CatalogueEntry("Quark fp8-mode names", "load", {"convention": "quark-fp8"}),
    "quark-mixed-dtypes": CatalogueEntry(
        "bf16 K and float8_e4m3fn V scales",
        "load",
        {
            "convention": "quark",
            "post_rope": True,
            "scales": {
                (layer, "v"): torch.tensor(0.01 * (layer + 1)).to(torch.float8_e4m3fn)
                for layer in range(2)
            },
        },
    ),
    "legacy-kv_scale": CatalogueEntry(
        "one kv_scale per layer", "load", {"convention": "legacy-kv_scale"}
    ),
    "none": CatalogueEntry("no KV scales: dynamic fp32-group", "load", {"convention": "none"}),
    "stray-safetensors": CatalogueEntry(
        "a stale zz-stale.safetensors beside model.safetensors is ignored",
        "load",
        {"convention": "compressed-tensors"},
        _stray_file,
    ),
    "name-in-two-shards": CatalogueEntry(
        "a tensor held by two shards: the index decides",
        "load",
        {"convention": "compressed-tensors", "shards": 2},
        _name_in_two_shards,
    ),
    "index-shards-in-a-subfolder": CatalogueEntry(
        "an index whose shards lie in weights/, beside a decoy config.json and NaN scales there",
        "load",
        {"convention": "compressed-tensors", "shards": 2},
        _shards_in_a_subfolder,
    ),
    "stale-index-beside-single-file": CatalogueEntry(
        "model.safetensors wins over a stale index (whose shards hold a NaN K scale)",
        "load",
        {"convention": "compressed-tensors"},
        _stale_index_beside_single_file,
    ),
    "weights-named-by-config": CatalogueEntry(
        "config.json's transformers_weights names the weights file; model.safetensors is a "
        "decoy with a NaN K scale",
        "load",
        {"convention": "compressed-tensors"},
        _weights_named_by_config,
    ),
    "leftover-text-config": CatalogueEntry(
        "a Llama config with a stale text_config of another geometry: the top level decides",
        "load",
        {"convention": "modelopt"},
        _leftover_text_config,
    ),
    "kvquant-saved": CatalogueEntry(
        "what save_pretrained writes for a patched model: fp32 () scales, quant_method kvquant",
        "load",
        {
            "convention": "none",
            "extra_tensors": _kvquant_saved_scales(),
            "quant_config_updates": {"quant_method": "kvquant", "scale_format": "auto"},
        },
    ),
    "fifo-beside-the-weights": CatalogueEntry(
        "a FIFO among the folder's files (never opened; the doctor warns that export would "
        "refuse to copy it)",
        "load",
        {"convention": "compressed-tensors"},
        _fifo_beside_the_weights,
    ),
    "declared-kv-scheme-without-scales": CatalogueEntry(
        "a kv_cache_scheme in config.json but no scale tensors: dynamic fp32-group, warned",
        "load",
        {"convention": "compressed-tensors", "drop": [(i, k) for i in range(2) for k in "kv"]},
    ),
    "index-names-the-wrong-shard": CatalogueEntry(
        "an index placing tensors in a shard that does not hold them",
        "refuse",
        {"convention": "compressed-tensors", "shards": 2},
        _index_names_the_wrong_shard,
    ),
    "scales-for-an-absent-layer": CatalogueEntry(
        "K/V scales for layer 5 of a 2-layer model",
        "refuse",
        {
            "convention": "modelopt",
            "extra_tensors": {
                "model.layers.5.self_attn.k_proj.k_scale": torch.tensor(0.02),
                "model.layers.5.self_attn.v_proj.v_scale": torch.tensor(0.01),
            },
        },
    ),
    "int32-scales": CatalogueEntry(
        "int32 scales of value 1",
        "refuse",
        {
            "convention": "compressed-tensors",
            "scales": {
                (layer, kind): torch.ones(1, dtype=torch.int32)
                for layer in range(2)
                for kind in "kv"
            },
        },
    ),
    "bool-scales": CatalogueEntry(
        "bool scales",
        "refuse",
        {
            "convention": "modelopt",
            "scales": {(0, "k"): torch.tensor(True)},
        },
    ),
    "nan-scale": CatalogueEntry(
        "a NaN K scale",
        "refuse",
        {"convention": "compressed-tensors", "scales": {(1, "k"): torch.tensor([float("nan")])}},
    ),
    "zero-scale": CatalogueEntry(
        "a zero V scale",
        "refuse",
        {"convention": "modelopt", "scales": {(0, "v"): torch.tensor(0.0)}},
    ),
    "missing-v": CatalogueEntry(
        "layer 1 has a K scale only", "refuse", {"convention": "modelopt", "drop": [(1, "v")]}
    ),
    "wrong-shape": CatalogueEntry(
        "a K scale with one entry per query head",
        "refuse",
        {"convention": "compressed-tensors", "scales": {(0, "k"): torch.full((4, 1, 1), 0.02)}},
    ),
    "zero-points": CatalogueEntry(
        "asymmetric K/V zero points",
        "refuse",
        {"convention": "compressed-tensors", "extra_tensors": _zero_points()},
    ),
    "zero-points-broken-hf-quant-config": CatalogueEntry(
        "zero points plus an unreadable hf_quant_config.json",
        "unreadable",
        {"convention": "compressed-tensors", "extra_tensors": _zero_points()},
        _unreadable_hf_quant_config,
    ),
    "kvquant-k-transform": CatalogueEntry(
        "kvquant's k-transform: per-head fp32 scales, K offsets, Hadamard rotation",
        "load",
        {"convention": K_TRANSFORM},
    ),
    "kvquant-k-transform-offset-only": CatalogueEntry(
        "k-transform without rotation, two first tokens",
        "load",
        {"convention": K_TRANSFORM, "kv_transform": {"rotation": None, "first_tokens": 2}},
    ),
    "k-offsets-without-settings": CatalogueEntry(
        "K offsets but no kvquant_kv_transform.json",
        "refuse",
        {"convention": K_TRANSFORM, "kv_transform_file": False},
    ),
    "k-transform-settings-without-offsets": CatalogueEntry(
        "kvquant_kv_transform.json but no K offsets",
        "refuse",
        {"convention": K_TRANSFORM, "drop": [(0, "k_offset"), (1, "k_offset")]},
    ),
    "k-transform-missing-layer-offset": CatalogueEntry(
        "layer 1 has no K offset",
        "refuse",
        {"convention": K_TRANSFORM, "drop": [(1, "k_offset")]},
    ),
    "k-offset-wrong-shape": CatalogueEntry(
        "a K offset of shape (Hkv, head_dim / 2)",
        "refuse",
        {"convention": K_TRANSFORM, "k_offsets": {0: torch.zeros(2, 8)}},
    ),
    "k-offset-nan": CatalogueEntry(
        "a NaN K offset element",
        "refuse",
        {
            "convention": K_TRANSFORM,
            "k_offsets": {1: torch.zeros(2, 16).index_fill_(1, torch.tensor([3]), float("nan"))},
        },
    ),
    "k-transform-rotation-head-dim-80": CatalogueEntry(
        "a Hadamard rotation for head_dim 80 (not a power of two)",
        "refuse",
        {"convention": K_TRANSFORM, "head_dim": 80},
    ),
    "k-transform-bad-settings": CatalogueEntry(
        "kvquant_kv_transform.json with version 2 and first_tokens -1",
        "refuse",
        {"convention": K_TRANSFORM, "kv_transform": {"version": 2, "first_tokens": -1}},
    ),
    "k-transform-settings-other-model": CatalogueEntry(
        "kvquant_kv_transform.json written for another head_dim",
        "refuse",
        {"convention": K_TRANSFORM, "kv_transform": {"head_dim": 64}},
    ),
}
"""Named checkpoints for agreement tests: ``kvquant doctor``, :func:`kvquant.patch`,
:func:`kvquant.from_pretrained` and ``from_pretrained(..., quantization_config=KVQuantConfig())``
must reach the same decision, findings and canonical scales on each."""
