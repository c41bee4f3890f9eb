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
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from fuzz_checkpoints import checkpoints, write_spec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvquant.checkpoint.discovery import discover_scales
from kvquant.cli import main as cli_main
from kvquant.errors import CheckpointError, KVQuantError
from kvquant.registry import MAX_SCALE, MIN_SCALE, resolve_scales
from kvquant.report import inspect_checkpoint


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
