"""One pipeline, four doors: every entry point reaches the same decision on the same folder.

``kvquant doctor`` (:func:`kvquant.report.inspect_checkpoint`), :func:`kvquant.patch`
on a plainly loaded model, :func:`kvquant.from_pretrained`, and transformers'
``from_pretrained(..., quantization_config=KVQuantConfig())`` are run on every
checkpoint of :data:`kvquant.testing.checkpoints.CATALOGUE`; their decisions,
findings and canonical scales must be identical, and the decision must be the
one the catalogue expects. A refusing door must leave nothing patched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvquant.integrations.hf as kvhf
from kvquant.cli import main as cli_main
from kvquant.errors import CheckpointError, KVQuantError, ScaleFormatError
from kvquant.integrations.hf import KVQuantConfig
from kvquant.report import inspect_checkpoint
from kvquant.testing.checkpoints import CATALOGUE

transformers = pytest.importorskip("transformers")

# quant_method values transformers dispatches to its own quantizer: a second
# quantization_config is refused by transformers itself, so that door passes
# the config without it (what kvquant.from_pretrained does).
_TRANSFORMERS_QUANTIZERS = ("compressed-tensors", "quark")


@dataclass
class Outcome:
    decision: str
    findings: tuple[tuple[str, str, str], ...] = ()
    granularity: str | None = None
    group_size: int | None = None
    scales: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...] = ()
    error: str = ""
    k_transform: Any = None
    offsets: tuple[torch.Tensor | None, ...] = ()


def _from_scales(decision: str, found: Any, model_scales: Any) -> Outcome:
    return Outcome(
        decision,
        tuple((f.severity, f.code, f.message) for f in found.findings),
        model_scales.granularity,
        model_scales.group_size,
        tuple((layer.k, layer.v) for layer in model_scales.layers),
        k_transform=model_scales.k_transform,
        offsets=tuple(layer.k_offset for layer in model_scales.layers),
    )


def _refused(exc: KVQuantError) -> Outcome:
    decision = "unreadable" if isinstance(exc, CheckpointError) else "refuse"
    assert isinstance(exc, (CheckpointError, ScaleFormatError)), repr(exc)
    return Outcome(decision, error=str(exc))


def _doctor(path: Path, capsys: pytest.CaptureFixture[str]) -> Outcome:
    code = cli_main(["doctor", str(path)])
    assert "Traceback" not in capsys.readouterr().err
    try:
        report = inspect_checkpoint(path)
    except CheckpointError as exc:
        assert code == 2
        return _refused(exc)
    assert code == report.exit_code
    if not report.ok:
        return Outcome("refuse", error="; ".join(report.problems))
    return _from_scales("load", report.discovered, report.scales)


def _config_without_producer(path: Path) -> Any:
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    if isinstance(getattr(cfg, "text_config", None), dict):
        # a leftover the Llama config class does not use: transformers cannot build the causal
        # LM with it (get_text_config() returns the dict), so a user deletes it, as here
        del cfg.text_config
    return cfg


def _check_patched(model: Any) -> Outcome:
    state = model._kvquant_state
    ms = state.model_scales
    found = state.raw_context["discovered"]
    for layer, site in zip(ms.layers, state.sites, strict=True):
        for attr in ("k_scale", "v_scale", "k_offset"):
            canonical = getattr(layer, "k_offset" if attr == "k_offset" else attr[0])
            installed = getattr(site.module, attr, None)
            if canonical is None:
                assert installed is None
            else:
                assert installed.dtype == torch.float32
                assert torch.equal(installed.cpu(), canonical)
    return _from_scales("load", found, ms)


def _load_door(load: Callable[[], Any]) -> Outcome:
    try:
        model = load()
    except (CheckpointError, ScaleFormatError) as exc:
        return _refused(exc)
    return _check_patched(model)


def _patch(path: Path) -> Outcome:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), config=_config_without_producer(path)
    )
    try:
        kvhf.patch(model, backend="torch")
    except (CheckpointError, ScaleFormatError) as exc:
        assert model.config._attn_implementation != "kvquant"
        assert not hasattr(model, "_kvquant_state")
        return _refused(exc)
    return _check_patched(model)


def _kvquant_from_pretrained(path: Path) -> Outcome:
    return _load_door(
        lambda: kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    )


def _transformers_from_pretrained(path: Path) -> Outcome:
    import json

    raw = json.loads((path / "config.json").read_text())
    qcfg = raw.get("quantization_config") or {}
    kwargs: dict[str, Any] = {}
    if qcfg.get("quant_method") in _TRANSFORMERS_QUANTIZERS or "text_config" in raw:
        kwargs["config"] = _config_without_producer(path)
    return _load_door(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(
            str(path), quantization_config=KVQuantConfig(backend="torch"), **kwargs
        )
    )


DOORS = {
    "patch": _patch,
    "kvquant.from_pretrained": _kvquant_from_pretrained,
    "transformers.from_pretrained": _transformers_from_pretrained,
}


def _same(a: Outcome, b: Outcome, door: str) -> None:
    assert a.decision == b.decision, (door, a.decision, b.decision, b.error)
    if a.decision != "load":
        return
    assert a.findings == b.findings, door
    assert (a.granularity, a.group_size) == (b.granularity, b.group_size), door
    assert a.k_transform == b.k_transform, door
    assert len(a.offsets) == len(b.offsets), door
    for x, y in zip(a.offsets, b.offsets, strict=True):
        assert (x is None) == (y is None), door
        if x is not None:
            assert x.dtype == y.dtype == torch.float32
            assert torch.equal(x, y), door
    assert len(a.scales) == len(b.scales)
    for (ak, av), (bk, bv) in zip(a.scales, b.scales, strict=True):
        for x, y in ((ak, bk), (av, bv)):
            assert (x is None) == (y is None), door
            if x is not None:
                assert x.dtype == y.dtype == torch.float32
                assert torch.equal(x, y), door


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_four_doors_agree(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    entry = CATALOGUE[name]
    path = entry.write(tmp_path / name)
    reference = _doctor(path, capsys)
    assert reference.decision == entry.expect, reference.error
    for door, run in DOORS.items():
        _same(reference, run(path), door)
    if reference.decision == "load" and reference.granularity != "fp32-group":
        for k, v in reference.scales:
            for t in (k, v):
                assert t is not None and bool(torch.isfinite(t).all()) and bool((t > 0).all())
    is_transform = entry.options.get("convention") == "kvquant-k-transform"
    if reference.decision == "load" and is_transform:
        assert reference.granularity == "k-transform"
        assert reference.k_transform is not None
        assert all(o is not None and bool(torch.isfinite(o).all()) for o in reference.offsets)
    elif reference.decision == "load":
        assert reference.k_transform is None and all(o is None for o in reference.offsets)


_MODEL: list[Any] = []


def _shared_tiny_llama() -> Any:
    if not _MODEL:
        from hf_tiny import build

        _MODEL.append(build("llama"))
    return _MODEL[0]


def test_fuzzed_checkpoints_patch_agrees_with_the_doctor() -> None:
    """patch(model, scales=folder) on fuzzed folders: same decision and scales as the doctor."""
    import tempfile

    from fuzz_checkpoints import checkpoints, write_spec
    from hypothesis import HealthCheck, given, settings

    from kvquant.checkpoint.discovery import discover_scales
    from kvquant.types import LayerGeometry

    model = _shared_tiny_llama()
    geometry = LayerGeometry(2, 4, 2, 16)

    @settings(
        max_examples=60,
        deadline=None,  # patches a model per example: wall time on a shared machine is no signal
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(spec=checkpoints(num_layers=2, num_kv_heads=2))
    def run(spec: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            write_spec(root, spec)
            try:
                report = inspect_checkpoint(root)
                same_geometry = discover_scales(root).geometry == geometry
            except CheckpointError:
                report, same_geometry = None, True
            try:
                handle = kvhf.patch(model, scales=root, backend="torch")
            except KVQuantError as exc:
                assert not hasattr(model, "_kvquant_state")
                if not same_geometry:
                    return
                if report is None:
                    assert isinstance(exc, CheckpointError)
                else:
                    assert isinstance(exc, ScaleFormatError) and not report.ok
                return
            try:
                assert report is not None and report.ok and same_geometry
                for layer, spec_ in zip(
                    report.scales.layers, handle.state.layer_specs, strict=True
                ):
                    for want, got in ((layer.k, spec_.k_scale), (layer.v, spec_.v_scale)):
                        assert (want is None) == (got is None)
                        if want is not None:
                            assert torch.equal(want, got)
            finally:
                handle.remove()

    run()
