"""kvquant.calibrate.pipeline: calibrate() on a real model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvquant.calibrate import (
    choose_scales,
    collect_statistics,
    write_calibrated_checkpoint,
)

pytest.importorskip("transformers")

E4M3_MAX = 448.0


@pytest.mark.slow
def test_smollm2_calibrated_perplexity(tmp_path: Path, smollm2_dir: Path) -> None:
    """Calibrated scales, written and read back through ``kvquant.patch``, cost no more than amax/448.

    Every written checkpoint is patched and its resolved scales must equal the calibration's
    exactly; perplexity is then measured by simulating FP8 K/V with those scales, whose
    rounding is kvquant's (tests/realmodel/test_smollm2_accuracy.py checks kvquant's cache
    against the simulation position by position) and which runs several times faster on
    CPU than the paged torch backend.
    """
    import benchmarks.harness.accuracy as E
    import kvquant
    from benchmarks.harness.smollm2 import load_smollm2
    from benchmarks.harness.texts import calibration_ids, evaluation_ids

    model, tokenizer = load_smollm2(smollm2_dir)
    heads = int(model.config.num_key_value_heads)
    # one 768-token window per pinned evaluation text: FP8 rounding is chaotic, more tokens
    # narrow the noise
    ids = evaluation_ids(tokenizer, 768)
    # the first 512 tokens of each calibration text (the statistics cost the most per token)
    stats = collect_statistics(model, calibration_ids(tokenizer, 512), progress=False)
    with E.simulate_fp8_kv(model, "none"):
        reference = E.teacher_forced(model, ids)
    deltas: dict[str, float] = {}
    for granularity in ("per-tensor", "per-head"):
        for name, ratios in (("amax", (1.0,)), ("calibrated", None)):
            res = (
                choose_scales(stats, granularity, ratios=ratios)
                if ratios
                else choose_scales(stats, granularity)
            )
            folder = write_calibrated_checkpoint(
                smollm2_dir, res, tmp_path / f"{granularity}-{name}"
            )
            handle = kvquant.patch(model, scales=folder, backend="torch")
            try:
                layers = list(handle.scales.layers)
            finally:
                handle.remove()
            for i, ls in enumerate(layers):
                k, v = res.layer_scales(i)
                assert torch.equal(ls.k, k) and torch.equal(ls.v, v), (granularity, name, i)
            amax = {
                kind: torch.stack(
                    [getattr(ls, kind).float().reshape(-1).expand(heads) for ls in layers]
                )
                * E.FP8_E4M3_MAX
                for kind in ("k", "v")
            }
            scales = E.CalibratedScales(amax["k"], amax["v"], num_tokens=res.num_tokens)
            with E.simulate_fp8_kv(model, granularity, scales):
                stats_run = E.teacher_forced(model, ids)
            deltas[f"{granularity} {name}"] = E.evaluate(name, stats_run, reference).delta_pct
    print(deltas)
    # FP8 rounding over 30 layers is chaotic (scale changes of 1 % move perplexity by up to a
    # point, docs/calibration.md): calibrated may not lose more than that noise to amax/448.
    # Measured: per-tensor amax +0.88 %, calibrated +0.84 %; per-head +1.51 %, +1.03 %.
    for granularity in ("per-tensor", "per-head"):
        calibrated = deltas[f"{granularity} calibrated"]
        assert calibrated <= deltas[f"{granularity} amax"] + 0.75
        assert calibrated < 2.0
    assert not math.isnan(sum(deltas.values()))
