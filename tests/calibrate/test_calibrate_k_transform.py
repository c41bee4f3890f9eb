"""kvquant.calibrate.k_transform: offsets, rotation and scales of the k-transform."""

from __future__ import annotations

import math

import pytest
import torch
from calibration_models import planted

from kvquant.calibrate import (
    ChannelStatistics,
    KVStatistics,
    choose_k_transform,
)
from kvquant.calibrate.fp8 import hadamard_matrix
from kvquant.errors import CalibrationError

pytest.importorskip("transformers")

E4M3_MAX = 448.0


def test_offset_recovers_a_planted_offset_and_leaves_the_first_tokens_out() -> None:
    key, offset = planted(2, 3, 400, 8)
    ch = ChannelStatistics(1, 3, 8, first_tokens=1)
    ch.update(0, key[:, :, :150])
    ch.update(0, key[:, :, 150:])  # a second window: its first position is left out too
    rest = torch.cat([key[:, :, 1:150], key[:, :, 151:]], dim=2)
    assert torch.equal(ch.count[:, 0], torch.tensor([2 * 2, 2 * 399 - 2]))
    c, s = ch.k_transform(rotate=False, apart=True)
    # the mean of 796 N(0, 1) draws: within 5 / sqrt(796) of the planted value
    assert (c[0] - offset).abs().max() < 5 / math.sqrt(796)
    assert torch.allclose(c[0], rest.double().mean(dim=(0, 2)).float(), atol=1e-4)
    # the scale is the exact amax of k - c over the tokens it covers (nothing clips)
    amax = (rest - c[0][None, :, None, :]).abs().amax(dim=(0, 2, 3))
    assert torch.allclose(s[0] * E4M3_MAX, amax, rtol=1e-6)
    assert float((rest - c[0][None, :, None, :]).abs().max() / s[0].max()) <= E4M3_MAX * (1 + 1e-6)
    # counting the first tokens instead drags the offset towards -300 and widens the scale
    c_all, s_all = ch.k_transform(rotate=False, apart=False)
    assert float((c_all[0] - offset).mean()) < -0.5
    assert torch.all(s_all[0] > 10 * s[0])
    # midrange: (min + max) / 2 of the same tokens
    mid, _ = ch.k_transform(rotate=False, apart=True, centre="midrange")
    expect = (rest.amin(dim=(0, 2)) + rest.amax(dim=(0, 2))) / 2
    assert torch.allclose(mid[0], expect, atol=1e-5)


def test_rotation_is_orthonormal_and_offsets_live_in_the_rotated_frame() -> None:
    for d in (1, 2, 8, 64):
        r = hadamard_matrix(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
        assert torch.equal(r, r.T)
    with pytest.raises(CalibrationError, match=r"power of two.*rotation=None"):
        hadamard_matrix(24)
    key, offset = planted(1, 2, 300, 16, seed=3)
    ch = ChannelStatistics(1, 2, 16, first_tokens=1)
    ch.update(0, key)
    c, s = ch.k_transform(rotate=True, apart=True)
    r = hadamard_matrix(16)
    assert (c[0] - offset @ r).abs().max() < 5 / math.sqrt(299)
    kr = key[:, :, 1:] @ r
    assert torch.allclose(c[0], kr.double().mean(dim=(0, 2)).float(), atol=1e-4)
    assert torch.allclose(s[0] * E4M3_MAX, (kr - c[0][None, :, None]).abs().amax(dim=(0, 2, 3)))
    # head_dim 24: offset only, and a clear error for the rotation
    odd = ChannelStatistics(1, 1, 24)
    odd.update(0, torch.randn(1, 1, 10, 24))
    assert odd.rotation is None
    odd.k_transform(rotate=False, apart=True)
    with pytest.raises(CalibrationError, match="power of two"):
        odd.k_transform(rotate=True, apart=True)


def test_k_transform_choice_validates() -> None:
    stats = KVStatistics(1, 1)
    stats.update(0, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(CalibrationError, match="no per-channel K statistics"):
        choose_k_transform(stats)
    ch = ChannelStatistics(1, 1, 8, first_tokens=4)
    stats = KVStatistics(1, 1, channels=ch)
    stats.update(0, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(CalibrationError, match="saw no token after the first 4"):
        choose_k_transform(stats)
    with pytest.raises(CalibrationError, match="rotation"):
        choose_k_transform(stats, rotation="givens", first_tokens=False)
    with pytest.raises(CalibrationError, match="centre"):
        choose_k_transform(stats, first_tokens=False, centre="median")
    with pytest.raises(CalibrationError, match="first_tokens=-1"):
        ChannelStatistics(1, 1, 8, first_tokens=-1)
