"""Row-group prefill (``prefill_tokens``) on CUDA: results and peak memory (run through the device tool)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import generate_exactly as _generate
from hf_steps import min_cosine, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_row_groups_match_the_unsplit_prefill_with_decode_graphs(family: str) -> None:
    """bf16 teacher-forced logits (graph decode steps) and fp32 greedy tokens, split vs unsplit."""
    ids, mask = prompt(batch=5, length=40, pad=(5, 0, 9, 1, 0))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (5, 12), generator=torch.Generator().manual_seed(5)).cuda()
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    got = {}
    for tokens in (None, 80):  # 2 rows of 40 tokens a group: 2, 2, 1
        handle = kvhf.patch(model, cuda_graphs=True, compile_step=False, prefill_tokens=tokens)
        got[tokens], cache = step_logits(model, ids, mask, cont)
        assert cache.get_seq_length() == 52
        assert handle.state.graph_runner is not None
        assert handle.state.graph_runner.stats.replays == 12
        if tokens is not None:
            assert handle.state.row_groups.stats.last_rows == [2, 2, 1]
        handle.remove()
    assert torch.isfinite(got[80]).all()
    assert min_cosine(got[80], got[None]) >= 0.999  # bf16 GEMMs of 2 rows against 5
    model = model.float()
    runs = {}
    for tokens in (None, 80):
        handle = kvhf.patch(model, cuda_graphs=True, compile_step=False, prefill_tokens=tokens)
        runs[tokens] = _generate(model, ids, mask, 16)
        handle.remove()
    assert torch.equal(runs[80].sequences, runs[None].sequences)
    logits = [torch.stack(runs[t].logits) for t in (None, 80)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)


def _wide_llama() -> Any:
    """A 2-layer Llama whose MLP activations dominate a prefill's memory (bf16, CUDA)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    return model


def _peak_of_generate(model: Any, ids: torch.Tensor, **kw: Any) -> tuple[int, torch.Tensor]:
    """Bytes allocated at the peak of one ``generate`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
            **kw,
        )
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


@pytest.mark.parametrize("chunk", [None, 256])
def test_a_split_prefill_peaks_below_the_unsplit_one(chunk: int | None) -> None:
    """32 x 1024 tokens: the unsplit prefill holds [32768, 4096] bf16 MLP tensors (256 MiB each)."""
    model = _wide_llama()
    ids = torch.randint(0, 1024, (32, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}
    peaks, outs = {}, {}
    for tokens in (None, 4096):
        handle = kvhf.patch(model, compile_step=False, prefill_tokens=tokens)
        _peak_of_generate(model, ids, **extra)  # warm-up: kernels, cuBLAS workspaces
        peaks[tokens], outs[tokens] = _peak_of_generate(model, ids, **extra)
        if tokens is not None:
            assert handle.state.row_groups.stats.split_calls >= 2
        handle.remove()
    whole, split = peaks[None], peaks[4096]
    # unchunked: ~3 x 256 MiB of MLP activations against ~3 x 32 MiB; chunked: 4x fewer rows
    # per forward than the whole batch in every chunk
    assert split < (0.5 if chunk is None else 0.9) * whole, (split, whole)
    assert outs[4096].shape == outs[None].shape


def test_auto_bound_splits_a_prefill_that_would_not_fit() -> None:
    """The default ``prefill_tokens="auto"`` under a memory budget: 32 x 1024 tokens of the wide
    Llama would need ~1.5 GiB of MLP activations whole; with ~0.4 GiB left after the weights and
    the KV pages, the prefill runs in row groups and generates what the unsplit call does."""
    model = _wide_llama()
    ids = torch.randint(0, 1024, (32, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    handle = kvhf.patch(model, cuda_graphs=False, prefill_tokens=None)
    _, want = _peak_of_generate(model, ids)
    handle.remove()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    budget = torch.cuda.memory_reserved() + 2**30  # the KV pages (~64 MiB) + room
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        handle = kvhf.patch(model, cuda_graphs=False)  # prefill_tokens="auto"
        _peak_of_generate(model, ids)
        stats = handle.state.row_groups.stats
        assert stats.split_calls >= 1 and max(stats.last_rows) < 32
        _, got = _peak_of_generate(model, ids)
        handle.remove()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.equal(got[:, : ids.shape[1]], ids)
    assert (got == want).float().mean() > 0.9  # bf16 GEMMs of fewer rows may flip a near-tie
