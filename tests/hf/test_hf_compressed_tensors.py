"""Plain ``from_pretrained`` of a compressed-tensors KV checkpoint with the package installed.

On transformers 5.17 compressed-tensors attaches its own KV hook to every attention
module: a ``QuantizedKVCache`` wrapper passed as the cache, ``k_scale`` / ``v_scale``
parameters, and fake quantization of K/V inside the cache update. ``kvquant.patch`` must
switch that quantization off (else K/V are rounded twice) and find its cache behind the
wrapper. Skipped where compressed-tensors is not installed (CI runs it in a second
environment with transformers 5.17: see .ci/run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import prompt

import kvquant.integrations.hf as kvhf
from kvquant.testing.checkpoints import write_checkpoint

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")


def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack(out.logits)


def _plain_twin(path: Path) -> Any:
    """The same weights, loaded without compressed-tensors' hooks."""
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    del cfg.quantization_config
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), config=cfg)


@pytest.mark.parametrize("scale_format", ["auto", "per-tensor"])
def test_patch_replaces_compressed_tensors_kv_quantization(
    tmp_path: Path, scale_format: str
) -> None:
    # per-head scales; "per-tensor" reduces them with max, so a second rounding with
    # compressed-tensors' per-head scales would change K/V
    path = write_checkpoint(
        tmp_path / "ct", convention="compressed-tensors", granularity="per-head"
    )
    ct_model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    ids, mask = prompt(batch=2, length=9, pad=(3, 0))
    kvhf.patch(ct_model, backend="torch", scale_format=scale_format)
    got = _logits(ct_model, ids, mask)

    twin = _plain_twin(path)
    kvhf.patch(twin, scales=path, backend="torch", scale_format=scale_format)
    want = _logits(twin, ids, mask)
    assert torch.equal(got, want)


def test_remove_restores_compressed_tensors_quantization(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "ct", convention="compressed-tensors", granularity="per-head"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    attn = model.model.layers[0].self_attn
    if not hasattr(attn, "kv_cache"):
        pytest.skip("compressed-tensors attached no KV hook with this transformers version")
    ids, mask = prompt(batch=2, length=9, pad=(3, 0))
    before = _logits(model, ids, mask)
    handle = kvhf.patch(model, backend="torch", scale_format="per-tensor")
    assert attn.quantization_enabled is False
    handle.remove()
    assert getattr(attn, "quantization_enabled", True) is not False
    assert torch.equal(_logits(model, ids, mask), before)
