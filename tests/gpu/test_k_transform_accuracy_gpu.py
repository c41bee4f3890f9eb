"""The calibrated k-transform on SmolLM2-135M through the Triton kernels, against its simulation.

Run through the device tool: ``PYTHONPATH=. pytest -m gpu tests/gpu/test_k_transform_accuracy_gpu.py``
(the model is fetched and converted on first use, see ``benchmarks/harness/smollm2.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("transformers")


def test_k_transform_triton_matches_simulation(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import DynamicCache

    import kvquant
    from benchmarks.harness import accuracy as A
    from benchmarks.harness.smollm2 import load_smollm2
    from benchmarks.harness.texts import calibration_texts, evaluation_texts
    from kvquant.calibrate import calibrate, write_calibrated_checkpoint

    model, tokenizer = load_smollm2(smollm2_dir)
    model.to("cuda")
    texts = [t.text for t in calibration_texts()]
    res = calibrate(
        model, texts, tokenizer=tokenizer, granularity="k-transform", window=1024,
        max_tokens=4096, progress=False,
    )  # fmt: skip
    assert res.report is not None
    assert res.report.best_static == "k-transform (hadamard, first tokens)"
    folder = write_calibrated_checkpoint(smollm2_dir, res, tmp_path / "kt", "kvquant")
    ids = A.tokenize(tokenizer, evaluation_texts()[0].text, 1024)
    with A.simulate_fp8_kv(model, "none"):
        exact = A.teacher_forced(model, ids)
    kt = A.KTransformScales.from_result(res)
    with A.simulate_fp8_kv(model, "k-transform", kt, exact_prompt=True):
        sim = A.teacher_forced(model, ids, cache_factory=DynamicCache)
    handle = kvquant.patch(model, scales=folder, backend="triton")
    try:
        assert handle.scales.granularity == "k-transform"
        real = A.teacher_forced(
            model, ids, cache_factory=lambda: handle.new_cache(max_cache_tokens=2048)
        )
    finally:
        handle.remove()
    assert torch.isfinite(real.nll).all()
    row_sim = A.evaluate("sim", sim, exact)
    row_real = A.evaluate("triton", real, exact)
    # the simulation's own accuracy (CPU table: +0.27 % perplexity, 97.1 % top-1 pooled)
    assert row_sim.top1_agreement >= 0.95 and abs(row_sim.delta_pct) < 2.0
    # Triton computes what the simulation computes, up to the chaos of 30 layers
    assert row_real.top1_agreement >= 0.95 and abs(row_real.delta_pct) < 2.0
    assert abs(row_real.perplexity / row_sim.perplexity - 1) < 0.01
    assert float((real.argmax == sim.argmax).double().mean()) >= 0.97
