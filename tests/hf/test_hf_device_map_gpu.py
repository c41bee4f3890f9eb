"""Models dispatched by accelerate over a GPU and the CPU, or over two GPUs (run on a GPU).

Each layer's pages live where the layer runs and its kernels launch there; a
cache whose layers sit on several devices, or a model whose weights accelerate
loads for each forward (offloaded), decodes without CUDA graphs, with the same
results. The CPU-only cases: tests/hf/test_hf_device_map.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_steps import calibrate, min_cosine, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.integrations.hf.graphs import pool_devices

pytestmark = pytest.mark.gpu
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _split(model: Any, second: str | int) -> Any:
    """``model`` with decoder layer 1 running on ``second``, everything else on ``cuda:0``.

    accelerate's hooks move each layer's inputs to its device; ``main_device="cpu"``
    keeps a ``"cpu"`` entry running on the CPU (next to a GPU, transformers'
    ``device_map`` would offload it and run it on the GPU instead).
    """
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": second,
        "model.norm": 0,
        "lm_head": 0,
    }
    return accelerate.dispatch_model(
        model,
        device_map=device_map,
        main_device="cpu" if second == "cpu" else 0,
        skip_keys=model._skip_keys_device_placement,
    )


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9))
    cont = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(5))
    return ids.cuda(), mask.cuda(), cont.cuda()


@pytest.mark.parametrize("granularity", ["per-head", "fp32-group"])
def test_layers_split_between_cuda_and_cpu(granularity: str) -> None:
    ids, mask, cont = _case()
    whole = build("llama").cuda()
    ref, _ = step_logits(whole, ids, mask, cont)
    scales = None if granularity == "fp32-group" else calibrate(whole, ids, mask, granularity)
    model = _split(build("llama"), "cpu")
    assert model.model.layers[1].self_attn.k_proj.weight.device.type == "cpu"
    handle = kvhf.patch(model, scales=scales, scale_format=granularity)  # graphs: auto
    got, cache = step_logits(model, ids, mask, cont)
    assert [layer.device.type for layer in cache.layers] == ["cuda", "cpu"]
    assert pool_devices(cache) == {torch.device("cuda", 0), torch.device("cpu")}
    stats = handle.state.graph_runner.stats
    assert (stats.captures, stats.replays, stats.fallbacks) == (0, 0, 0)
    assert cache.cuda_graphs is False  # decided at the first decode step
    assert torch.isfinite(got).all()
    assert min_cosine(got, ref) >= 0.995


def test_cpu_offload_through_from_pretrained_runs_on_the_gpu(tmp_path: Path) -> None:
    ids, mask, cont = _case()
    build("llama").save_pretrained(tmp_path / "src")
    resident = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "src"), device_map="cuda"
    ).eval()
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": "cpu",  # offloaded: its weights are loaded onto cuda:0 for each forward
        "model.norm": 0,
        "lm_head": 0,
    }
    offloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "src"), device_map=device_map
    ).eval()
    got = {}
    for name, model in (("resident", resident), ("offloaded", offloaded)):
        handle = kvhf.patch(model, backend="triton", compile_step=False)
        got[name], cache = step_logits(model, ids, mask, cont)
        assert pool_devices(cache) == {torch.device("cuda", 0)}
        stats = handle.state.graph_runner.stats
        if name == "resident":
            assert stats.replays == cont.shape[1]
        else:  # a graph cannot capture the loading of offloaded weights: eager steps
            assert (stats.captures, stats.replays, stats.fallbacks) == (0, 0, 0)
    assert min_cosine(got["offloaded"], got["resident"]) >= 0.9999


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_layers_split_between_two_gpus() -> None:
    ids, mask, cont = _case()
    whole = build("llama").cuda()
    handle = kvhf.patch(whole, cuda_graphs=False)
    ref, _ = step_logits(whole, ids, mask, cont)
    handle.remove()
    model = _split(build("llama"), 1)
    handle = kvhf.patch(model)  # backend auto: Triton on both GPUs
    with torch.cuda.device(0):  # kernels of layer 1 must still launch on cuda:1
        got, cache = step_logits(model, ids, mask, cont)
    assert [layer.device for layer in cache.layers] == [torch.device("cuda", i) for i in (0, 1)]
    assert cache.cuda_graphs is False
    assert handle.state.graph_runner.stats.replays == 0
    # the same kernels on the same values as on one GPU
    assert min_cosine(got, ref) >= 0.9999
