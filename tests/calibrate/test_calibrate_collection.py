"""kvquant.calibrate.collection: what the attention hook sees."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.calibrate import (
    choose_scales,
    collect_statistics,
)

pytest.importorskip("transformers")


def test_collected_amax_matches_eval_calibrate(tiny: Any) -> None:
    import benchmarks.harness.accuracy as E

    model, _ = tiny
    ids = torch.randint(0, 128, (1, 200))
    stats = collect_statistics(model, ids, progress=False)
    ref = E.calibrate(model, ids)
    torch.testing.assert_close(stats.k_amax, ref.k_amax, rtol=0, atol=0)
    torch.testing.assert_close(stats.v_amax, ref.v_amax, rtol=0, atol=0)
    plain = choose_scales(stats, "per-head", ratios=(1.0,))
    k_ref, v_ref = ref.per_head()
    torch.testing.assert_close(plain.k_scales, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(plain.v_scales, v_ref, rtol=0, atol=0)
    # the model's attention implementation is restored
    assert model.config._attn_implementation == "sdpa"
