"""``kv_format="fp8-k-nvfp4-v"`` with a k-transform calibration: FP8 K in the transform's frame
(offset, rotation, first tokens at full precision) beside NVFP4 V, through ``kvquant.patch``
(tiny fp32 Llama of head_dim 16 with biased keys, CPU, torch backend).

Before this format existed the patch refused the combination (the k-transform has no plain
static K scale); now K keeps the transform, in ``generate``, in a per-layer format map and in
transformers' continuous batching.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_kt import biased_llama, k_transform_scales
from hf_steps import min_cosine, step_logits
from hf_tiny import prompt
from test_hf_continuous_batching import (
    alone,
    assert_fp8_visible,
    assert_same,
    cb_config,
    coarse_k_transform,
    gen_config,
    prompts,
    run_of,
)

import kvquant.integrations.hf as kvhf
from kvquant.integrations.hf import continuous

transformers = pytest.importorskip("transformers")

KV_FORMAT = "fp8-k-nvfp4-v"


def test_greedy_generate_keeps_the_k_transform_beside_nvfp4_v() -> None:
    ids, mask = prompt(batch=1, length=10, pad=(0,))
    kw: dict[str, Any] = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = biased_llama().generate(input_ids=ids, attention_mask=mask, **kw)
    model = biased_llama()
    handle = kvhf.patch(
        model, scales=k_transform_scales(model), kv_format=KV_FORMAT, backend="torch", page_size=4
    )
    assert handle.scales.granularity == "k-transform"
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, want)
    storage = out.past_key_values.layers[0].storage
    assert type(storage).__name__ == "KTransformNvfp4VStorage"
    assert storage.k_rotation is not None and storage.k_offset is not None
    assert storage.first_tokens == 1 and storage.first_tensors()[2].tolist() == [1]
    assert storage.v_block_scales is not None  # V in NVFP4


def test_logits_near_the_unpatched_model_with_left_padding() -> None:
    """Left padding: each row's first visible token is kept; logits near the unpatched ones."""
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    want, _ = step_logits(biased_llama(), ids, mask, cont)
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model), kv_format=KV_FORMAT, backend="torch")
    got, cache = step_logits(model, ids, mask, cont)
    assert bool(torch.isfinite(got).all())
    assert min_cosine(got, want) > 0.99
    assert cache.layers[0].storage.first_tensors()[3].tolist() == [0, 3]  # left padding


def test_a_layer_map_naming_fp8_k_nvfp4_v_keeps_the_transform() -> None:
    ids, mask = prompt(batch=1, length=8, pad=(0,))
    model = biased_llama()
    handle = kvhf.patch(
        model,
        scales=k_transform_scales(model),
        kv_format={0: KV_FORMAT, "default": "fp8"},
        backend="torch",
    )
    assert [s.granularity for s in handle.state.layer_specs] == [
        "k-transform-k-nvfp4-v",
        "k-transform",
    ]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
    kinds = [type(layer.storage).__name__ for layer in out.past_key_values.layers]
    assert kinds == ["KTransformNvfp4VStorage", "KTransformStorage"]


def test_continuous_batching_equals_each_requests_own_generate() -> None:
    model, ref = biased_llama(), biased_llama()
    scales = coarse_k_transform(model)
    # no ring: continuous batching keeps none by default, generate's cache 16
    kvhf.patch(model, scales=scales, kv_format=KV_FORMAT, backend="torch", recent_tokens=0)
    reqs = prompts((3, 9, 17, 30))
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert_fp8_visible(got, [alone(ref, ids) for ids in reqs])
    assert continuous.live_caches() == []


@pytest.mark.gpu
def test_triton_kernels_and_cuda_graphs_on_gpu() -> None:
    """CUDA, backend="triton", decode graphs: within the reference's logits."""
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9), seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (3, 24), generator=torch.Generator().manual_seed(5)).cuda()
    model = biased_llama().to(device="cuda", dtype=torch.bfloat16)
    scales = k_transform_scales(model, first_tokens=2)
    handle = kvhf.patch(
        model, scales=scales, kv_format=KV_FORMAT, backend="triton", cuda_graphs=True
    )
    got, cache = step_logits(model, ids, mask, cont)
    assert handle.state.graph_runner.stats.replays > 0
    assert cache.layers[0].storage.first_start.tolist() == [5, 0, 9]
    handle.remove()
    kvhf.patch(model, scales=scales, kv_format=KV_FORMAT, backend="torch", cuda_graphs=False)
    ref, _ = step_logits(model, ids, mask, cont)
    assert bool(torch.isfinite(got).all())
    assert min_cosine(got, ref) >= 0.999
