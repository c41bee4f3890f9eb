"""kvquant.calibrate.report: the recommendation and who reads each format."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


def test_the_recommendation_names_what_was_written_and_who_reads_each_format() -> None:
    from kvquant.calibrate.report import READERS, CalibrationReport

    names = ("per-tensor", "per-head", "fp32-group G=32", "k-transform (hadamard, first tokens)")
    errors = torch.tensor([0.06, 0.05, 0.045, 0.03], dtype=torch.float64).view(4, 1, 1)
    zeros = torch.zeros(1, 1, dtype=torch.float64)

    def report(chosen: str, error: torch.Tensor = errors) -> CalibrationReport:
        return CalibrationReport(
            candidates=names,
            static=(True, True, False, True),
            error=error.expand(4, 3, 2).clone(),
            k_clip=zeros,
            k_subnormal=zeros,
            v_clip=zeros,
            v_subnormal=zeros,
            near_constant=zeros,
            chosen=chosen,
            held_out_tokens=64,
            held_out_windows=1,
        )

    text = report("per-tensor").recommendation
    assert text.startswith(
        "Written: per-tensor scales, error 6.00%, read by kvquant, vLLM, SGLang."
    )
    # the best of each group of readers that beats it, with how to get it and who reads it
    assert "per-head 5.00% (--format per-head; read by kvquant, vLLM)" in text
    assert "k-transform 3.00% (--format k-transform; read by kvquant)" in text
    assert "dynamic" not in text  # kvquant reads the k-transform, which does better still
    text = report("k-transform (hadamard, first tokens)").recommendation
    assert text.endswith("No other format measured here does better.")
    assert set(READERS) >= set(names)
