"""Hypothesis strategies of on-disk checkpoints (random names, dtypes, shapes, configs, shards,
header byte flips) and their writer, shared by the checkpoint and hf fuzz tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvquant.checkpoint.producers import KV_TRANSFORM_FILE, k_offset_tensor_name
from kvquant.testing.checkpoints import scale_tensor_name

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
    torch.int8,
    torch.bool,
)

VALUES = st.one_of(
    st.floats(min_value=1e-4, max_value=1.0),
    st.floats(min_value=1e-4, max_value=1.0),
    st.floats(min_value=1e-4, max_value=1.0),
    st.floats(min_value=1e-4, max_value=1.0),
    st.sampled_from([0.0, -1.0, 1e-10, 1e-45, float("nan"), float("inf"), 448.0, 3e38]),
)

JUNK = st.one_of(
    st.integers(-(10**12), 10**12),
    st.sampled_from([10**9, 10**6, 4097, 0, -1, True, None, 2.0, "8", [], {}]),
)

CONFIGS: list[dict[str, Any] | None] = [
    None,
    {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
    {"quant_method": "modelopt", "kv_cache_scheme": {"dynamic": False}},
    {"quant_method": "quark", "kv_cache_post_rope": False},
    {"quant_method": "kvquant"},
    {"quant_method": "compressed-tensors", "kv_cache_scheme": {"symmetric": False}},
    {"quant_method": "nonsense"},
]


def _names(layers: int) -> st.SearchStrategy[str]:
    layer = st.integers(0, layers + 1)
    known = st.builds(
        scale_tensor_name,
        st.sampled_from(["compressed-tensors", "modelopt", "quark"]),
        layer,
        st.sampled_from(["k", "v"]),
    )
    legacy = st.builds(lambda n: scale_tensor_name("legacy-kv_scale", n, "kv"), layer)
    extras = st.builds(
        lambda n, s: f"model.layers.{n}.self_attn.{s}",
        layer,
        st.sampled_from(["k_zero_point", "q_scale", "k_proj.weight", "k_proj.k_bias"]),
    )
    junk = st.text(st.characters(codec="ascii", exclude_characters="\x00"), min_size=1, max_size=12)
    offsets = st.builds(k_offset_tensor_name, layer)  # kvquant's k-transform
    return st.one_of(known, known, known, legacy, extras, junk, offsets)


@st.composite
def checkpoints(
    draw: st.DrawFn, num_layers: int | None = None, num_kv_heads: int | None = None
) -> dict[str, Any]:
    """A random checkpoint folder's contents (config, tensors, sharding, stray file, byte flip)."""
    layers = num_layers or draw(st.integers(1, 3))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": num_kv_heads or draw(st.sampled_from([1, 2, 4])),
        "head_dim": 16,
        "hidden_size": 64,
    }
    if draw(st.integers(0, 3)) == 3:
        for key in draw(st.sets(st.sampled_from(sorted(config)[2:]), min_size=1, max_size=2)):
            config[key] = draw(JUNK)
    qcfg = draw(st.sampled_from(CONFIGS))
    if qcfg is not None:
        config["quantization_config"] = qcfg
    if draw(st.integers(0, 3)) == 3:
        config = {"model_type": "llava", "text_config": config}
    tensors: dict[str, torch.Tensor] = {}
    names: list[str] = []
    complete = not draw(st.booleans())
    if complete:  # every layer's K and V in one convention, then a few extra tensors
        convention = draw(st.sampled_from(["compressed-tensors", "modelopt", "quark"]))
        names = [scale_tensor_name(convention, n, k) for n in range(layers) for k in "kv"]
    extra = draw(st.lists(_names(layers), min_size=0 if complete else 1, max_size=4))
    names += [n for n in extra if n not in names]
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        if complete or draw(st.booleans()):
            kv = config.get("num_key_value_heads")
            kv = kv if isinstance(kv, int) and not isinstance(kv, bool) and 0 < kv < 8 else 2
            shape = draw(st.sampled_from([(), (1,), (kv,), (kv, 1, 1), (2,), (4, 1, 1), (kv, 16)]))
        values = draw(st.lists(VALUES, min_size=math.prod(shape), max_size=math.prod(shape)))
        dtype = draw(st.sampled_from(DTYPES[:4] if complete else DTYPES))
        t = torch.tensor(values, dtype=torch.float64).reshape(shape)
        if dtype == torch.bool:
            t = t != 0
        elif not dtype.is_floating_point:
            t = torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-100, 100).to(dtype)
        else:
            t = t.to(dtype)
        tensors[name] = t
    transform: dict[str, Any] | None = None
    if draw(st.integers(0, 3)) == 3:  # kvquant_kv_transform.json, maybe with a bad entry
        transform = {
            "format": "k-transform",
            "version": 1,
            "rotation": draw(st.sampled_from(["hadamard", None])),
            "first_tokens": draw(st.sampled_from([0, 1, 2])),
            "head_dim": 16,
            "num_kv_heads": config.get("num_key_value_heads"),
            "num_layers": layers,
        }
        if draw(st.booleans()):
            key = draw(st.sampled_from(sorted(transform)))
            if draw(st.booleans()):
                del transform[key]
            else:
                transform[key] = draw(JUNK)
    return {
        "config": config,
        "tensors": tensors,
        "transform": transform,
        "shards": draw(st.sampled_from([1, 1, 2])),
        "stray": draw(st.integers(0, 3)) == 3,
        "flip": draw(st.integers(0, 3)) == 3
        and draw(st.tuples(st.integers(0, 400), st.integers(1, 255))),
    }


def write_spec(root: Path, spec: dict[str, Any]) -> None:
    """Write a :func:`checkpoints` example into the folder ``root``."""
    (root / "config.json").write_text(json.dumps(spec["config"]))
    names = sorted(spec["tensors"])
    if spec["shards"] == 1 or len(names) < 2:
        files = {"model.safetensors": names}
    else:
        files = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        weight_map = {n: f for f, ns in files.items() for n in ns}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for file, ns in files.items():
        save_file({n: spec["tensors"][n].contiguous() for n in ns}, str(root / file))
    if spec.get("transform") is not None:
        (root / KV_TRANSFORM_FILE).write_text(json.dumps(spec["transform"]))
    if spec["stray"]:
        save_file(
            {n: torch.full_like(spec["tensors"][n], 7) for n in names}, str(root / "zz.safetensors")
        )
    if spec["flip"]:
        pos, xor = spec["flip"]
        target = root / sorted(files)[0]
        raw = bytearray(target.read_bytes())
        raw[pos % len(raw)] ^= xor
        target.write_bytes(bytes(raw))
