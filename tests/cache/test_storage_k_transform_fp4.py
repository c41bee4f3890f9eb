"""PagedLayerStorage of 4-bit K in the k-transform's frame (``k-transform-nvfp4``,
``k-transform-mxfp4``): the pages of plain NVFP4 / MXFP4 holding the codes of ``k @ R - c``,
``dense()`` back in the model's frame, the first-token side buffer, accounting and refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.cache.storage import Fp4Storage, KTransformFp4Storage
from kvquant.errors import ScaleFormatError
from kvquant.kernels import hadamard, paged_attention
from kvquant.schemes import FirstTokens, Mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D, PAGE = 2, 64, 8
FORMATS = {"k-transform-nvfp4": "nvfp4", "k-transform-mxfp4": "mxfp4"}
GLOBAL = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)}


def _scales(gran: str) -> dict[str, Any]:
    return GLOBAL if "nvfp4" in gran else {}


def _offset() -> torch.Tensor:
    off = torch.zeros(H, D)
    off[:, 3] = 12.0  # the biased channel of _tokens, in the rotated frame
    return off


def _storage(gran: str, **kw: Any) -> Any:
    if DEV == "cuda" and gran == "k-transform-nvfp4":
        pytest.skip("NVFP4 keys in the k-transform's frame are refused on CUDA")
    args = _scales(gran) | {"k_offset": _offset(), "k_rotation": hadamard(D), "first_tokens": 1}
    return PagedLayerStorage(6, PAGE, H, D, granularity=gran, device=DEV, backend="torch",
                             **(args | kw))  # fmt: skip


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, n, H, D, generator=g)
    k = (k @ hadamard(D) + _offset()) @ hadamard(D).T  # biased in the rotated frame
    return k.to(DEV), torch.randn(1, n, H, D, generator=g).to(DEV)


@pytest.mark.parametrize("gran", list(FORMATS))
def test_k_is_stored_in_the_transforms_frame_and_read_back_in_the_models(gran: str) -> None:
    store = _storage(gran)
    assert type(store) is KTransformFp4Storage
    assert "rotated, first_tokens=1" in repr(store)
    plain = PagedLayerStorage(6, PAGE, H, D, granularity=FORMATS[gran], device=DEV,
                              backend="torch", **_scales(gran))  # fmt: skip
    alloc = PageAllocator(num_pages=6, page_size=PAGE)
    k, v = _tokens(13, seed=1)
    slots = alloc.reserve(["a"], 13).to(DEV)
    store.write(k, v, slots)
    h, c = hadamard(D).to(DEV), _offset().to(DEV)
    plain.write(k @ h - c, v, slots)
    for name in Fp4Storage.pool_names:  # the codes of k @ R - c, V as given
        assert torch.equal(getattr(store, name).view(torch.uint8),
                           getattr(plain, name).view(torch.uint8)), name  # fmt: skip
    bt, lens = alloc.block_tables(["a"]).to(DEV), alloc.seq_lens(["a"]).to(DEV)
    dense_k, dense_v = store.dense(bt, 13)
    plain_k, plain_v = plain.dense(bt, 13)
    assert torch.allclose(dense_k, (plain_k + c) @ h.T, atol=1e-4)
    assert torch.equal(dense_v, plain_v)
    # the model's K, 4-bit close (without the offset the biased channel would be off by 12)
    assert float((dense_k - k).norm() / k.norm()) < 0.1
    # attention: the reference over the same pages, rotated query and offset term included
    q = torch.randn(1, 13, 2 * H, D, device=DEV)
    want = paged_attention(q, store.pages, bt, lens, store.scheme, sm_scale=D**-0.5,
                           mask=Mask(), backend="torch")  # fmt: skip
    assert torch.equal(store.attend(q, bt, lens), want)


@pytest.mark.parametrize("gran", list(FORMATS))
def test_first_tokens_are_attended_from_the_side_buffer(gran: str) -> None:
    """keep_first holds the first token rotated; its slot is never read (NaN codes there)."""
    store = _storage(gran)
    alloc = PageAllocator(num_pages=6, page_size=PAGE)
    k, v = _tokens(10, seed=2)
    k[:, 0] *= 30.0  # a sink far outside the 4-bit blocks' range of the others
    slots = alloc.reserve(["a"], 10).to(DEV)
    store.write(k, v, slots)
    store.keep_first(k, v, 0, None)
    fk, fv, fl, fs = store.first_tensors()
    assert fl.tolist() == [1] and fs.tolist() == [0]
    assert torch.allclose(fk[0, 0], k[0, 0] @ hadamard(D).to(DEV), atol=1e-4)
    assert torch.equal(fv[0, 0], v[0, 0])
    fmt = store.scheme.k_format
    first_slot = int(slots[0, 0])
    store.k_block_scales[first_slot // PAGE, first_slot % PAGE].view(torch.uint8).fill_(
        fmt.nan_scale_code
    )
    bt, lens = alloc.block_tables(["a"]).to(DEV), alloc.seq_lens(["a"]).to(DEV)
    q = torch.randn(1, 1, 2 * H, D, device=DEV)
    out = store.attend(q, bt, lens)
    want = paged_attention(q, store.pages, bt, lens, store.scheme, sm_scale=D**-0.5,
                           first=FirstTokens(fk, fv, fl), backend="torch")  # fmt: skip
    assert bool(torch.isfinite(out).all()) and torch.equal(out, want)
    # the transform's bytes: offset, rotation and the side buffer
    held = store.memory_bytes()["k_transform"]
    assert held == (H * D + D * D) * 4 + 2 * fk.numel() * fk.element_size() + 2 * 4


@pytest.mark.parametrize(
    ("gran", "kw", "match"),
    [
        ("k-transform-nvfp4", {"k_offset": None}, "L: granularity 'k-transform-nvfp4' needs "
         "k_offset"),
        ("k-transform-nvfp4", {"k_offset": torch.zeros(3, D)}, r"k_offset has shape \(3, 64\)"),
        ("k-transform-nvfp4", {"k_scale": None}, "L: k-transform-nvfp4 scales: k_global_scale is "
         "a NoneType"),
        ("k-transform-mxfp4", {"k_scale": torch.tensor(1.0)}, "k-transform-mxfp4 computes every "
         "scale on write"),
        ("k-transform-mxfp4", {"k_rotation": torch.ones(D, D)}, "not orthonormal"),
    ],
)  # fmt: skip
def test_constructor_refuses_with_the_owner(gran: str, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ScaleFormatError, match=match) as info:
        _storage(gran, name="L", **kw)
    assert "Fix:" in str(info.value)
