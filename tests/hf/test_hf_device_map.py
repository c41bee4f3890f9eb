"""Models dispatched by accelerate (``device_map``) on CPU: offloaded layers, pools per device.

A CPU machine cannot hold layers on two compute devices; what it can run is
transformers' own ``device_map`` with layers offloaded to the CPU or to disk
(accelerate's hooks load their weights for each forward). The layers split
between CUDA devices, or between CUDA and the CPU, are tested on a GPU
(tests/hf/test_hf_device_map_gpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_steps import calibrate, step_logits
from hf_tiny import build, prompt

import kvquant
import kvquant.integrations.hf as kvhf
import kvquant.integrations.hf.graphs as graphs
from kvquant.errors import BackendError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

OFFLOADED = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}
"""Layer 1's weights on disk (on ``meta`` in the model), everything else in CPU memory."""


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    build("llama").save_pretrained(path)
    return path


def _offloaded(path: Path, tmp_path: Path, **kwargs: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), device_map=OFFLOADED, offload_folder=str(tmp_path / "offload"), **kwargs
    ).eval()


@pytest.mark.parametrize("granularity", ["per-head", "fp32-group"])
def test_offloaded_layers_decode_like_the_resident_model(tmp_path: Path, granularity: str) -> None:
    path = _saved(tmp_path)
    resident = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    offloaded = _offloaded(path, tmp_path)
    assert offloaded.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    scales = None if granularity == "fp32-group" else calibrate(resident, ids, mask, granularity)
    got = {}
    for name, model in (("resident", resident), ("offloaded", offloaded)):
        kvhf.patch(model, scales=scales, scale_format=granularity, backend="torch", page_size=4)
        got[name], cache = step_logits(model, ids, mask, cont)
        # every layer's pages and scales where the layer runs (accelerate's execution device)
        assert {layer.device for layer in cache.layers} == {torch.device("cpu")}
        if granularity == "per-head":
            assert all(layer.k_scale.shape == (2,) for layer in cache.layers)
    torch.testing.assert_close(got["offloaded"], got["resident"], atol=1e-5, rtol=0)


def test_saved_patched_model_loads_with_a_device_map(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    handle = kvhf.patch(model, scales=calibrate(model, ids, mask, "per-head"), backend="torch")
    kw: dict[str, Any] = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    model.save_pretrained(tmp_path / "saved")
    k_scale = handle.state.layer_specs[1].k_scale
    handle.remove()
    loaded = kvquant.from_pretrained(
        tmp_path / "saved", device_map=OFFLOADED, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert loaded.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    torch.testing.assert_close(loaded._kvquant_state.layer_specs[1].k_scale, k_scale)
    with torch.no_grad():
        out = loaded.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


def test_pool_devices_of_a_cache(tmp_path: Path) -> None:
    model = _offloaded(_saved(tmp_path), tmp_path)
    handle = kvhf.patch(model, backend="torch", page_size=4)
    cache = handle.new_cache()
    assert graphs.pool_devices(cache) == set()  # nothing allocated yet
    ids, mask = prompt()
    step_logits(model, ids, mask, ids[:, :1], cache=cache)
    assert graphs.pool_devices(cache) == {torch.device("cpu")}


def _pools_on_two_devices(cache: Any) -> set[torch.device]:
    """What a cache of a model split over two devices reports (CPU cannot hold such pools).

    With the default ``cuda_graphs=None`` such a cache decodes through the ordinary forward
    (tests/hf/test_hf_device_map_gpu.py); on CPU the runner never tries a step in that mode.
    """
    return {torch.device("cpu"), torch.device("meta")}


def test_cuda_graphs_true_refuses_pools_on_several_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4, cuda_graphs=True)
    cache = handle.new_cache()
    monkeypatch.setattr(graphs, "pool_devices", _pools_on_two_devices)
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    with pytest.raises(BackendError, match=r"several devices.*cuda_graphs=None"):
        step_logits(model, ids, mask, ids[:, :1], cache=cache)
    assert cache.get_seq_length() == 12  # the prompt; the refused step wrote nothing
