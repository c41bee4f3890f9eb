"""Every registered producer: write a tiny checkpoint with it, discover it, round-trip its scales.

Parametrized over :data:`kvquant.checkpoint.producers.PRODUCERS`, so a producer added
to the registry is tested here without touching this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvquant.checkpoint.discovery import discover_scales, match_scale_name
from kvquant.checkpoint.producers import PRODUCERS, Producer, convention_of, reported
from kvquant.registry.resolve import resolve_scales
from kvquant.testing.checkpoints import default_scale_values, producer_checkpoint

LAYERS, HEADS = 2, 2


def _granularities(producer: Producer) -> list[str]:
    return ["per-head"] if producer.stores_k_transform else list(producer.granularities)


CASES = [pytest.param(p, g, id=f"{p.name}-{g}") for p in PRODUCERS for g in _granularities(p)]


def _expected(producer: Producer, granularity: str, layer: int) -> dict[str, torch.Tensor]:
    """The canonical K and V a reader should get back: merged where the producer merges."""
    values = default_scale_values(LAYERS, HEADS, per_head=granularity == "per-head")
    k, v = values[(layer, "k")], values[(layer, "v")]
    if set(producer.suffixes) == {"kv"} or producer.writes_merged():
        k = v = torch.maximum(k.amax(), v.amax())
    return {"k": k, "v": v}


def test_the_registry_names_each_convention_once() -> None:
    names = [p.name for p in PRODUCERS]
    assert len(names) == len(set(names))
    for producer in PRODUCERS:
        assert reported(producer.producer) is not None
        # whatever reads a producer's own names under its own config is that producer
        assert convention_of(producer.naming, reported(producer.producer)).producer == (
            producer.producer
        )


def test_each_4bit_layout_is_declared_by_its_own_producer() -> None:
    """A producer's NVFP4 layout (``fp4``) names that producer; the 4-bit-only ones are never
    decided by discovery, and the 4-bit registry reads exactly what the producers declare."""
    from kvquant.checkpoint.producers import FOUR_BIT_ONLY, fp4_layout
    from kvquant.registry import fp4

    declared = [p for p in (*PRODUCERS, *FOUR_BIT_ONLY) if p.fp4 is not None]
    for producer in declared:
        assert producer.fp4 is not None and producer.fp4.name == producer.producer
        assert fp4_layout(producer.producer) is producer.fp4
        assert fp4.PRODUCERS[producer.producer] is producer.fp4
    assert set(fp4.PRODUCERS) == {p.producer for p in declared}
    for producer in FOUR_BIT_ONLY:
        assert producer not in PRODUCERS and reported(producer.producer) is None
        assert not producer.writable and not producer.owns_names


@pytest.mark.parametrize(("producer", "granularity"), CASES)
def test_write_discover_round_trip(producer: Producer, granularity: str, tmp_path: Path) -> None:
    path = producer_checkpoint(
        tmp_path / "ckpt",
        producer,
        granularity=granularity,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        weights="none",
    )
    found = discover_scales(path)
    assert found.producer == producer.producer
    assert not found.has_errors, [f.message for f in found.findings]
    kinds = sorted(producer.suffixes)
    assert [(r.layer, r.kind) for r in found.scales] == [
        (layer, kind) for layer in range(LAYERS) for kind in kinds
    ]
    for raw in found.scales:
        assert raw.convention == producer.producer
        assert match_scale_name(raw.name) is not None
        if not producer.stores_k_transform:
            assert raw.name == producer.tensor_name(raw.layer, raw.kind)
            assert raw.tensor.dtype == producer.default_dtype
            assert tuple(raw.tensor.shape) == producer.stored_shape(granularity, HEADS)

    transform = found.k_transform if producer.stores_k_transform else None
    scales = resolve_scales(found.scales, found.geometry, rope_policy="keep", k_transform=transform)
    for layer in scales.layers:
        want = _expected(producer, granularity, layer.layer)
        for kind, got in (("k", layer.k), ("v", layer.v)):
            assert got is not None and got.dtype == torch.float32
            expect = want[kind].to(producer.default_dtype).float()
            torch.testing.assert_close(got.reshape(-1), expect.expand(got.numel()).reshape(-1))


@pytest.mark.parametrize("producer", [p for p in PRODUCERS if p.writable], ids=lambda p: p.name)
def test_configs_are_detected_as_their_producer(producer: Producer) -> None:
    from kvquant.checkpoint.producers import detect_producer

    qcfg, hf_quant = producer.configs()
    decided = detect_producer(qcfg, hf_quant)
    if qcfg is None and hf_quant is None:
        assert decided is None  # read from its tensor names alone
    else:
        assert decided is not None and decided.producer == producer.producer
