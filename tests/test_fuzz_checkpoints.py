"""Fuzz on-disk checkpoints: random names, dtypes, shapes, configs, shards and header byte flips.

Properties, for every generated folder:

* only :class:`~kvquant.errors.KVQuantError` subclasses escape discovery, the
  doctor's report and the registry; ``kvquant doctor`` exits 0, 1 or 2 and its
  ``--json`` output parses;
* an accepted static scale is fp32, finite, positive and inside
  ``[MIN_SCALE, MAX_SCALE]``;
* the entry points agree: the doctor's analysis accepts exactly when the
  raising pipeline used by :func:`kvquant.patch` and the load-time quantizer
  (discovery, error findings, :func:`~kvquant.registry.resolve_scales`)
  accepts, with bit-identical canonical scales; discovery is deterministic.

Bounded for CI: ``max_examples`` and a per-example ``deadline`` are set.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvquant.checkpoint.discovery import discover_scales
from kvquant.checkpoint.producers import KV_TRANSFORM_FILE, k_offset_tensor_name
from kvquant.cli import main as cli_main
from kvquant.errors import CheckpointError, KVQuantError
from kvquant.registry import MAX_SCALE, MIN_SCALE, resolve_scales
from kvquant.report import inspect_checkpoint
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


def _doctor_exit(path: Path) -> int:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["doctor", str(path), "--json"])
    assert "Traceback" not in err.getvalue()
    if code in (0, 1):
        json.loads(out.getvalue())
    return code


def _accepted_scales_are_sane(layers: Any) -> None:
    for layer in layers:
        for t in (layer.k, layer.v):
            if t is None:
                continue
            assert t.dtype == torch.float32
            assert bool(torch.isfinite(t).all())
            assert bool((t >= MIN_SCALE).all()) and bool((t <= MAX_SCALE).all())


@settings(
    max_examples=120,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=checkpoints())
def test_untrusted_checkpoints(spec: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write_spec(root, spec)
        code = _doctor_exit(root)
        assert code in (0, 1, 2)
        try:
            report = inspect_checkpoint(root)
        except KVQuantError as exc:
            assert code == 2 and isinstance(exc, CheckpointError)
            event("not a readable checkpoint")
            return
        assert code == report.exit_code
        found = discover_scales(root)
        assert [(s.name, s.layer, s.kind) for s in found.scales] == [
            (s.name, s.layer, s.kind) for s in report.discovered.scales
        ]
        try:
            if found.has_errors:
                raise CheckpointError("error findings")  # what patch() and the quantizer do
            resolved = resolve_scales(
                list(found.scales), found.geometry, k_transform=found.k_transform
            )
        except KVQuantError:
            assert not report.ok
            event("refused")
            return
        assert report.ok
        event(f"accepted {report.granularity}")
        _accepted_scales_are_sane(resolved.layers)
        assert resolved.k_transform == report.scales.k_transform
        for a, b in zip(resolved.layers, report.scales.layers, strict=True):
            if a.k_offset is not None:
                assert a.k_offset.dtype == torch.float32 and bool(torch.isfinite(a.k_offset).all())
            for x, y in ((a.k, b.k), (a.v, b.v), (a.k_offset, b.k_offset)):
                assert (x is None) == (y is None)
                if x is not None:
                    assert torch.equal(x, y)


def _odd_tensor(t: torch.Tensor, how: str) -> Any:
    if how == "sparse" and t.dim() > 0 and t.dtype in (torch.float32, torch.float16, torch.int32):
        return t.to_sparse()
    if how == "meta":
        return t.to("meta")
    if how == "expanded" and t.numel() == 1:
        return t.reshape(1).expand(2)
    if how == "transposed" and t.dim() == 2:
        return t.t()
    if how == "grad" and t.is_floating_point():
        return t.float().requires_grad_()
    if how == "float":
        return 0.02
    return t


@settings(
    max_examples=150,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=checkpoints(),
    hows=st.lists(
        st.sampled_from(
            ["dense"] * 6 + ["sparse", "meta", "expanded", "transposed", "grad", "float"]
        ),
        min_size=8,
        max_size=8,
    ),
    layer=st.sampled_from([None, -1, True, 10**6]),
)
def test_registry_api_takes_odd_tensors(spec: dict[str, Any], hows: list[str], layer: Any) -> None:
    """RawScale objects built by hand (odd layouts, devices, types, layers): KVQuantErrors only."""
    from kvquant.checkpoint.discovery import match_scale_name
    from kvquant.registry import LayerGeometry, RawScale, analyze_scales

    geometry = LayerGeometry(2, 4, 2, 16)
    raws = []
    for i, (name, tensor) in enumerate(sorted(spec["tensors"].items())):
        hit = match_scale_name(name)
        if hit is None:
            continue
        n, kind, _family = hit
        if layer is not None and i == 0:
            n = layer
        raws.append(RawScale(n, kind, name, "fuzz", _odd_tensor(tensor, hows[i % len(hows)])))
    analysis = analyze_scales(raws, geometry)  # never raises for contents
    try:
        resolved = resolve_scales(raws, geometry)
    except KVQuantError:
        assert not analysis.ok
        return
    assert analysis.ok and resolved.ok
    _accepted_scales_are_sane(resolved.layers)
