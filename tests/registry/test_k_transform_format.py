"""The ``k-transform`` target of the registry, and kvquant's convention as discovery reads it.

Registry level: :class:`RawKTransform` in, :class:`ModelScales` with offsets and settings
out, or problems naming the tensor, the value and the fix; the doctor's report and JSON.
Fresh random offsets per test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvquant.checkpoint.discovery import discover_scales
from kvquant.checkpoint.producers import KV_TRANSFORM_FILE, kv_transform_config
from kvquant.checkpoint.producers.kvquant import k_transform_from_mapping
from kvquant.errors import ScaleFormatError
from kvquant.registry import (
    KTransform,
    KTransformFormat,
    LayerGeometry,
    RawKTransform,
    RawOffset,
    RawScale,
    analyze_scales,
    check_format_contract,
    get_scale_format,
    resolve_scales,
)
from kvquant.registry.policy import MAX_OFFSET
from kvquant.report import inspect_checkpoint
from kvquant.testing.checkpoints import K_TRANSFORM, write_checkpoint

GEOMETRY = LayerGeometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _raw_scales(per_head: bool = True) -> list[RawScale]:
    out = []
    for layer in range(2):
        for kind, base in (("k", 0.02), ("v", 0.01)):
            value = base * (layer + 1) + (
                0.001 * torch.arange(2.0) if per_head else torch.zeros(())
            )
            out.append(
                RawScale(
                    layer, kind, f"model.layers.{layer}.self_attn.{kind}_scale", "kvquant", value
                )
            )
    return out


def _transform(
    offsets: dict[int, torch.Tensor] | None = None,
    rotation: str | None = "hadamard",
    first_tokens: int = 1,
) -> RawKTransform:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    offsets = (
        offsets if offsets is not None else {i: torch.randn(2, 16, generator=gen) for i in range(2)}
    )
    raws = tuple(
        RawOffset(layer, f"model.layers.{layer}.self_attn.k_offset", t)
        for layer, t in offsets.items()
    )
    return RawKTransform(KTransform(rotation, first_tokens), raws, "test.json")


def test_the_format_is_a_registered_target_with_per_head_scales() -> None:
    fmt = get_scale_format("k-transform")
    assert isinstance(fmt, KTransformFormat) and fmt.granularity == "k-transform"
    check_format_contract(fmt)
    raw = RawScale(0, "k", "x", "kvquant", torch.tensor(0.5))
    assert torch.equal(fmt.normalize(raw, GEOMETRY), torch.full((2,), 0.5))


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("scale_format", ["auto", "k-transform"])
def test_resolution_carries_offsets_and_settings(per_head: bool, scale_format: str) -> None:
    transform = _transform(rotation=None, first_tokens=3)
    scales = resolve_scales(
        _raw_scales(per_head), GEOMETRY, scale_format=scale_format, k_transform=transform
    )
    assert scales.granularity == "k-transform"
    assert scales.k_transform == KTransform(rotation=None, first_tokens=3)
    for layer, raw in zip(scales.layers, transform.offsets, strict=True):
        assert layer.k is not None and tuple(layer.k.shape) == (2,)  # scalars broadcast
        assert layer.k_offset is not None and layer.k_offset.dtype == torch.float32
        assert torch.equal(layer.k_offset, raw.tensor)
        assert layer.k_offset is not raw.tensor
    data = json.loads(json.dumps(scales.to_dict(), allow_nan=False))
    assert data["k_transform"] == {"rotation": None, "first_tokens": 3}
    summary = data["layers"][1]["k_offset"]
    assert summary["tensor"] == "model.layers.1.self_attn.k_offset" and summary["shape"] == [2, 16]
    assert summary["max"] == pytest.approx(float(transform.offsets[1].tensor.max()))
    assert "rotation none, first_tokens 3" in scales.report()


@pytest.mark.parametrize(
    ("offsets", "rotation", "first_tokens", "match"),
    [
        ({0: torch.zeros(2, 16)}, "hadamard", 1, "layer 1 has no k_offset"),
        ({0: torch.zeros(2, 16), 1: torch.zeros(16, 2)}, None, 1, r"has shape \(16, 2\)"),
        ({0: torch.zeros(2, 16), 1: torch.full((2, 16), float("inf"))}, None, 1, "is inf"),
        ({0: torch.zeros(2, 16), 1: torch.full((2, 16), 2 * MAX_OFFSET)}, None, 1, "beyond"),
        ({0: torch.zeros(2, 16, dtype=torch.int32), 1: torch.zeros(2, 16)}, None, 1, "floating"),
        ({0: torch.zeros(2, 16), 1: torch.zeros(2, 16), 5: torch.zeros(2, 16)}, None, 1, "layer 5"),
        (None, "givens", 1, "rotation is 'givens'"),
        (None, None, -1, "first_tokens is -1"),
        (None, None, 4096, "first_tokens is 4096"),
    ],
)
def test_bad_transforms_are_problems_naming_the_tensor_and_the_fix(
    offsets: dict[int, torch.Tensor] | None, rotation: str | None, first_tokens: int, match: str
) -> None:
    transform = _transform(offsets, rotation, first_tokens)
    scales = analyze_scales(_raw_scales(), GEOMETRY, k_transform=transform)
    assert not scales.ok
    assert any(re.search(match, p) for p in scales.problems), scales.problems
    assert all("Fix:" in p for p in scales.problems)
    with pytest.raises(ScaleFormatError, match=match):
        resolve_scales(_raw_scales(), GEOMETRY, k_transform=transform)


def test_hadamard_needs_a_power_of_two_head_dim() -> None:
    geometry = LayerGeometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=80)
    offsets = {i: torch.zeros(2, 80) for i in range(2)}
    scales = analyze_scales(_raw_scales(), geometry, k_transform=_transform(offsets))
    assert any("power-of-two head_dim" in p and "rotation=None" in p for p in scales.problems)
    ok = analyze_scales(_raw_scales(), geometry, k_transform=_transform(offsets, rotation=None))
    assert ok.ok


def test_static_formats_refuse_and_the_dynamic_one_ignores_the_transform() -> None:
    transform = _transform()
    for name in ("per-head", "per-tensor"):
        scales = analyze_scales(_raw_scales(), GEOMETRY, scale_format=name, k_transform=transform)
        assert any("calibrated for the offset keys" in p for p in scales.problems)
    dynamic = analyze_scales(
        _raw_scales(), GEOMETRY, scale_format="fp32-group", k_transform=transform
    )
    assert dynamic.ok and dynamic.granularity == "fp32-group" and dynamic.k_transform is None
    assert any("K transform" in n and "ignored" in n for n in dynamic.notes)
    missing = analyze_scales(_raw_scales(), GEOMETRY, scale_format="k-transform")
    assert any("needs a K transform" in p for p in missing.problems)
    unscaled = analyze_scales([], GEOMETRY, k_transform=transform)
    assert any("no K/V scales" in p for p in unscaled.problems)


def test_a_mapping_carries_offsets_and_settings() -> None:
    settings = kv_transform_config(
        rotation="hadamard", first_tokens=2, head_dim=16, num_kv_heads=2, num_layers=2
    )
    mapping = {f"model.layers.{i}.self_attn.k_offset": torch.randn(2, 16) for i in range(2)}
    found = k_transform_from_mapping({**mapping, KV_TRANSFORM_FILE: settings}, GEOMETRY)
    assert found is not None and found.settings == KTransform("hadamard", 2)
    assert [o.layer for o in found.offsets] == [0, 1]
    assert (
        k_transform_from_mapping({"model.layers.0.self_attn.k_scale": torch.ones(1)}, GEOMETRY)
        is None
    )
    with pytest.raises(ScaleFormatError, match=r"no 'kvquant_kv_transform\.json' entry"):
        k_transform_from_mapping(mapping, GEOMETRY)
    with pytest.raises(ScaleFormatError, match="num_kv_heads is 4"):
        k_transform_from_mapping(
            {**mapping, KV_TRANSFORM_FILE: {**settings, "num_kv_heads": 4}}, GEOMETRY
        )


def test_discovery_and_the_doctor_report_the_convention(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path,
        convention=K_TRANSFORM,
        weights="none",
        kv_transform={"first_tokens": 4, "extra": 1},
    )
    found = discover_scales(path)
    assert found.producer == "kvquant" and found.k_transform is not None
    assert found.k_transform.settings == KTransform("hadamard", 4)
    codes = {f.code: f.severity for f in found.findings}
    assert codes["kv-transform"] == "info" and codes["kv-transform-unknown-entry"] == "warning"
    report = inspect_checkpoint(path)
    assert report.ok and report.granularity == "k-transform"
    data = json.loads(report.to_json())
    assert data["k_transform"] == {"rotation": "hadamard", "first_tokens": 4}
    assert [o["tensor"] for o in data["k_offsets"]] == [
        f"model.layers.{i}.self_attn.k_offset" for i in range(2)
    ]
    assert "rotation hadamard, first 4 token(s)" in report.render()


def test_an_unreadable_settings_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    from kvquant.errors import CheckpointError

    path = write_checkpoint(tmp_path, convention=K_TRANSFORM, weights="none")
    (path / KV_TRANSFORM_FILE).write_text("[1, 2")
    with pytest.raises(CheckpointError, match=r"kvquant_kv_transform\.json"):
        discover_scales(path)
