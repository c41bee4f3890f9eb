"""``fp32-group`` storage of Hadamard-rotated keys (``k_rotation``): the scheme it hands the
kernels, dense reads in the model's frame, accounting and refusals."""

from __future__ import annotations

import pytest
import torch

from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.kernels import hadamard, paged_attention_reference
from kvquant.schemes import GroupScales


def _store(**kw: object) -> PagedLayerStorage:
    return PagedLayerStorage(
        4, 8, 2, 64, granularity="fp32-group", backend="torch", name="L0", **kw
    )  # type: ignore[arg-type]


def test_rotated_storage_writes_attends_and_reads_back_in_the_model_frame() -> None:
    gen = torch.Generator().manual_seed(0)
    store = _store(group_size=32, k_rotation=hadamard(64))
    scheme = store.scheme
    assert isinstance(scheme, GroupScales) and scheme.group_size == 32
    assert scheme.k_rotation is not None and torch.equal(scheme.k_rotation, hadamard(64))
    alloc = PageAllocator(4, 8)
    slots = alloc.reserve([0, 1], 11)
    key = torch.randn(2, 11, 2, 64, generator=gen)
    key[..., 5] += 20.0  # a large channel: rotated, it spreads over every group
    value = torch.randn(2, 11, 2, 64, generator=gen)
    store.write(key, value, slots)
    bt, lens = alloc.block_tables([0, 1]), alloc.seq_lens([0, 1])
    # K stored rotated: its groups' scales are those of k @ R
    k_scales = store.k_group_scales[bt[0, 0].long(), 0]
    want = (key[0, 0] @ hadamard(64)).unflatten(-1, (2, 32)).abs().amax(-1) / 448
    torch.testing.assert_close(k_scales, want, rtol=1e-6, atol=0)
    q = torch.randn(2, 3, 4, 64, generator=gen)
    got = store.attend(q, bt, lens)
    ref = paged_attention_reference(q, store.pages, bt, lens, scheme, sm_scale=0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    k, v = store.dense(bt, 11)
    assert float((k - key).norm() / key.norm()) < 0.03  # rotated back: the model's frame
    assert float((v - value).norm() / value.norm()) < 0.03
    assert store.memory_bytes()["k_transform"] == 64 * 64 * 4
    assert "G=32, K rotated" in repr(store)
    assert "K rotated" not in repr(_store(group_size=32))


def test_rotated_storage_refuses_what_fp32_group_does_not_take() -> None:
    with pytest.raises(CacheUsageError, match=r"L0: k_offset / first_tokens .*'k-transform'"):
        _store(k_rotation=hadamard(64), k_offset=torch.zeros(2, 64))
    with pytest.raises(CacheUsageError, match="k_offset / first_tokens"):
        _store(first_tokens=1)
    with pytest.raises(ScaleFormatError, match=r"L0: .*k_rotation is not orthonormal"):
        _store(k_rotation=torch.eye(64) * 2)
    with pytest.raises(ScaleFormatError, match=r"L0: .*expected \(64, 64\)"):
        _store(k_rotation=hadamard(32))
    with pytest.raises(ScaleFormatError, match="L0: k_rotation is a str"):
        _store(k_rotation="hadamard")
    with pytest.raises(ScaleFormatError, match="power-of-two head_dim"):
        PagedLayerStorage(2, 8, 1, 48, granularity="fp32-group", group_size=16,
                          k_rotation=torch.eye(48))  # fmt: skip
