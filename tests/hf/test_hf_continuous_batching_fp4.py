"""transformers' continuous batching on kvquant's 4-bit pages (tiny fp32 Llama of head_dim 32, CPU,
torch backend): ``nvfp4``, ``mxfp4`` and ``fp8-k-nvfp4-v``.

As in ``test_hf_continuous_batching`` (whose helpers these tests use): every request of a
batch must equal the patched model's own ``generate`` for that request alone (a prompt attends
at full precision, every later token over the 4-bit pages), and some request must differ from
the unpatched model, so that the equality says something. Runs on transformers 5.17, 5.24 and 5.25.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from hf_tiny import _COMMON
from test_hf_continuous_batching import (
    FOUR_BIT,
    NEW,
    Run,
    WriteCount,
    _continued,
    _wait_for,
    alone,
    assert_fp8_visible,
    assert_same,
    cb_config,
    gen_config,
    models,
    prompts,
    run_of,
    tiny,
    tokens,
)

import kvquant.integrations.hf as kvhf
from kvquant.cache import PagedLayerStorage
from kvquant.errors import CacheCapacityError, UnsupportedModelError
from kvquant.integrations.hf import continuous
from kvquant.integrations.hf.continuous import caches as cb_caches
from kvquant.integrations.hf.continuous import storage as cb_storage
from kvquant.integrations.hf.continuous.layout import layout_for
from kvquant.kernels import plan_attention, plan_write
from kvquant.schemes import (
    DYNAMIC_NVFP4_GLOBAL_SCALE,
    MXFP4,
    NVFP4,
    Fp8KNvfp4VScales,
    Mxfp4Scales,
    Nvfp4Scales,
    Pages,
)

transformers = pytest.importorskip("transformers")

FORMATS = FOUR_BIT
SIDES = {"nvfp4": (NVFP4, NVFP4), "mxfp4": (MXFP4, MXFP4), "fp8-k-nvfp4-v": (None, NVFP4)}
"""Each format's K and V page formats (None: FP8)."""


# ---------------------------------------------------------------------- the batch equals generate


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_batch_equals_each_requests_own_generate(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 3 to 30 tokens (one to two blocks) in one batch; the 4-bit pages are the
    cache's (the batching storage wrote them, every layer a 4-bit storage)."""
    model, _, ref = models(fmt)
    writes = WriteCount(monkeypatch)
    built: list[Any] = []
    original = continuous.BatchingStorage.__init__

    def spy(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        built.append((self.layout, [type(s).__name__ for s in self.layers]))

    monkeypatch.setattr(continuous.BatchingStorage, "__init__", spy)
    reqs = prompts()
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    assert writes.calls > 0
    layout, classes = built[0]
    assert (layout.k_fp4, layout.v_fp4) == SIDES[fmt]
    want_class = "Fp8KNvfp4VStorage" if fmt == "fp8-k-nvfp4-v" else "Fp4Storage"
    assert classes == [want_class, want_class]
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert all(len(t) == NEW for t in tokens(got))
    assert_fp8_visible(got, [alone(ref, ids) for ids in reqs])  # 4-bit changed the numbers
    assert continuous.live_caches() == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_generate_equals_generate(fmt: str) -> None:
    model, _, ref = models(fmt)
    reqs = prompts((11, 11, 11), seed=3)
    out = model.generate(
        torch.tensor(reqs),
        generation_config=gen_config(),
        cache_implementation="paged",
        continuous_batching_config=cb_config(),
    )
    got = [row[11:].tolist() for row in out.reshape(len(reqs), -1)]
    assert got == tokens([alone(model, r) for r in reqs])
    assert got != tokens([alone(ref, r) for r in reqs])
    assert continuous.live_caches() == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_requests_finishing_early_and_arriving_while_others_decode(fmt: str) -> None:
    """The manager API: B and C arrive while A decodes; B (5 new tokens) finishes long before
    A (16) and C (11); their blocks return while the others still decode."""
    model, _, ref = models(fmt)
    a, b, c = prompts((20, 5, 33), seed=7)
    budgets = {"a": (a, 16), "b": (b, 5), "c": (c, 11)}
    manager = model.init_continuous_batching(
        generation_config=gen_config(max_new_tokens=16), continuous_batching_config=cb_config()
    )
    manager.start()
    order: list[str] = []
    try:
        manager.add_request(a, request_id="a", max_new_tokens=16, streaming=True)
        _wait_for(manager, "a", 3)
        manager.add_request(b, request_id="b", max_new_tokens=5)
        manager.add_request(c, request_id="c", max_new_tokens=11)
        finals: dict[str, Run] = {}
        deadline = time.monotonic() + 120
        while len(finals) < 3 and time.monotonic() < deadline:
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                finals[result.request_id] = run_of(result)
                order.append(result.request_id)
    finally:
        manager.stop(block=True)
    assert order.index("b") < order.index("a")  # B finished while A still decoded
    got = [finals[k] for k in budgets]
    assert [len(t) for t in tokens(got)] == [16, 5, 11]
    assert_same(got, [alone(model, p, max_new_tokens=n) for p, n in budgets.values()])
    assert_fp8_visible(got, [alone(ref, p, max_new_tokens=n) for p, n in budgets.values()])
    assert continuous.live_caches() == []


def test_a_shared_prefix_reads_the_first_requests_4bit_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefix sharing (transformers' default): B's prompt starts with A's first two full blocks,
    reused from A; B's own prompt tokens attend over them in NVFP4 (a launch of several
    queries per row), as the patched model does continuing from a cache holding the prefix."""
    model, handle, _ = models("nvfp4")
    matched: list[int] = []
    cls = cb_caches._cache_class()
    original = cls.search_prefix_match

    def search(self: Any, request_id: str, prompt_ids: list[int]) -> int:
        found = original(self, request_id, prompt_ids)
        if request_id == "b":
            matched.append(found)
        return int(found)

    monkeypatch.setattr(cls, "search_prefix_match", search)
    a, tail = prompts((40, 7), seed=13)
    b = a[:35] + tail
    manager = model.init_continuous_batching(
        generation_config=gen_config(max_new_tokens=8), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        manager.add_request(a, request_id="a", max_new_tokens=8, streaming=True)
        _wait_for(manager, "a", 1)
        manager.add_request(b, request_id="b", max_new_tokens=8)
        got = None
        deadline = time.monotonic() + 120
        while got is None and time.monotonic() < deadline:
            result = manager.get_result(request_id="b", timeout=0.5)
            if result is not None and result.is_finished():
                got = run_of(result)
    finally:
        manager.stop(block=True)
    assert matched == [32]  # B found A's two full blocks
    assert got is not None
    assert_same([got], [_continued(model, handle, b, 32, max_new_tokens=8)])
    assert_fp8_visible([got], [alone(model, b, max_new_tokens=8)])  # the 4-bit prefix counts


# ---------------------------------------------------------------------- the block layout


def _owners(layout: Any, buffer: torch.Tensor, blocks: int) -> None:
    """Every byte of ``buffer`` belongs to at most one part of one layer."""
    owner = torch.full((buffer.numel(),), -1)
    for layer in range(layout.num_layers):
        for i, (name, view) in enumerate(sorted(layout.views(buffer, layer, blocks).items())):
            start = view.data_ptr() - buffer.data_ptr()
            size = view.element_size()
            offsets = torch.zeros(view.shape, dtype=torch.long)
            for dim, stride in enumerate(view.stride()):
                shape = [1] * view.dim()
                shape[dim] = view.shape[dim]
                offsets = offsets + torch.arange(view.shape[dim]).view(shape) * stride
            for byte in range(size):
                idx = start + offsets.reshape(-1) * size + byte
                assert bool((owner[idx] == -1).all()), (layer, name)
                owner[idx] = layer * 10 + i


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_layout_of_the_4bit_formats(fmt: str) -> None:
    """Codes and block scales of K and V, each on its own 128-byte offset, in the shapes and
    strides of ``fp4_page_storage`` with the block as the page stride; no two parts share a
    byte; a storage over the views writes and reads back what the 4-bit cache stores."""
    _model, handle, _ = models(fmt)
    layout = layout_for(handle.state.layer_specs, 4, torch.float32)
    k_fmt, v_fmt = SIDES[fmt]
    assert (layout.k_fp4, layout.v_fp4) == (k_fmt, v_fmt)
    ps, hkv, d = 4, 2, 32
    off = layout.offsets
    names = ["k_pages", "v_pages"] + [
        f"{s}_block_scales" for s, f in (("k", k_fmt), ("v", v_fmt)) if f is not None
    ]
    assert list(off) == [*names, "end"]
    assert all(off[n] % 128 == 0 for n in off)
    k_codes = ps * hkv * (d if k_fmt is None else d // 2)
    assert off["v_pages"] == -(-k_codes // 128) * 128
    blocks = 3
    buffer = torch.zeros(blocks * layout.bytes_per_block, dtype=torch.uint8)
    _owners(layout, buffer, blocks)
    views = layout.views(buffer, 1, blocks)
    base = buffer.data_ptr() + layout.bytes_per_page
    for name in names:
        view = views[name]
        assert view.data_ptr() == base + off[name]
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        fmt_of = k_fmt if name.startswith("k") else v_fmt
        width = view.shape[-1]
        if fmt_of is not None:
            want = d // 2 if name.endswith("pages") else d // fmt_of.block_size
            dtype = torch.uint8 if name.endswith("pages") else fmt_of.scale_dtype
            assert view.dtype == dtype and width == want
            assert view.stride() == (layout.bytes_per_block, hkv * width, width, 1)
    # the layer's storage over the views: written and read back as the 4-bit cache does
    spec = handle.state.layer_specs[1]
    storage = PagedLayerStorage(
        blocks, ps, hkv, d, granularity=fmt, k_scale=spec.k_scale, v_scale=spec.v_scale,
        backend="torch", pages=views,
    )  # fmt: skip
    own = PagedLayerStorage(
        blocks, ps, hkv, d, granularity=fmt, k_scale=spec.k_scale, v_scale=spec.v_scale,
        backend="torch",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 6, hkv, d, generator=g), torch.randn(1, 6, hkv, d, generator=g)
    slots = torch.tensor([[0, 1, 2, 3, 8, 9]])
    for s in (storage, own):
        s.write(k, v, slots)
    table = torch.tensor([[0, 2]], dtype=torch.int32)
    for a, b in zip(storage.dense(table, 6), own.dense(table, 6), strict=True):
        assert torch.equal(a, b)
    assert float((storage.dense(table, 6)[1] - v).abs().max()) > 0  # 4-bit: not exact
    for name in names:
        assert torch.equal(getattr(storage, name).view(torch.uint8),
                           getattr(own, name).view(torch.uint8))  # fmt: skip
    # layer 0's bytes and the untouched block 1 stay zero
    rows = buffer.view(blocks, layout.bytes_per_block)
    assert bool((rows[:, : layout.bytes_per_page] == 0).all())
    assert bool((rows[1] == 0).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_triton_kernels_accept_the_4bit_block_views(fmt: str) -> None:
    """The Triton write and attention (interpreted on CPU: the smallest geometry) plan over the
    buffer's strided views and compute what the torch reference computes."""
    ps, hkv, d, blocks = 4, 1, 32, 3
    layout = continuous.BlockLayout(
        num_layers=2, page_size=ps, num_kv_heads=hkv, head_dim=d,
        k_fp4=SIDES[fmt][0], v_fp4=SIDES[fmt][1],
    )  # fmt: skip
    g1 = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE)
    scheme = {
        "nvfp4": lambda: Nvfp4Scales(d, g1, g1.clone()),
        "mxfp4": lambda: Mxfp4Scales(d),
        "fp8-k-nvfp4-v": lambda: Fp8KNvfp4VScales(d, torch.tensor(0.01), g1.clone()),
    }[fmt]()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 6, hkv, d, generator=g), torch.randn(1, 6, hkv, d, generator=g)
    q = torch.randn(1, 1, 2, d, generator=g)
    slots = torch.tensor([[4, 5, 6, 7, 8, 9]])  # blocks 1 and 2
    table, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    outs = []
    for backend in ("triton", "torch"):
        buffer = torch.zeros(blocks * layout.bytes_per_block, dtype=torch.uint8)
        views = layout.views(buffer, 1, blocks)
        pages = Pages(views["k_pages"], views["v_pages"], views.get("k_block_scales"),
                      views["v_block_scales"])  # fmt: skip
        plan_write(k, v, pages, slots, scheme, backend=backend).run(k, v, pages, slots, scheme)
        plan = plan_attention(q, pages, table, lens, scheme, sm_scale=d**-0.5, backend=backend)
        assert plan.backend == backend
        outs.append((buffer, plan.run(q, pages, table, lens, scheme, sm_scale=d**-0.5)))
    assert torch.equal(outs[0][0], outs[1][0])  # the same bytes written
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------- sizing


def test_a_budget_buys_about_1_8_times_the_fp8_blocks_in_nvfp4() -> None:
    """Llama-3.2-1B shapes: 16 layers, 8 KV heads of 64, pages of 256 tokens; the same bf16
    budget (num_blocks) and the same free memory buy each format's own blocks."""
    shape = dict(num_layers=16, page_size=256, num_kv_heads=8, head_dim=64)
    fp8 = continuous.BlockLayout(**shape)
    per = {f: continuous.BlockLayout(**shape, k_fp4=k, v_fp4=v) for f, (k, v) in SIDES.items()}
    # one layer's page: codes (D/2 bytes per slot and head) and block scales (1 byte per block)
    slots = 256 * 8
    assert per["nvfp4"].bytes_per_page == 2 * (slots * 32 + slots * 4)
    assert per["mxfp4"].bytes_per_page == 2 * (slots * 32 + slots * 2)
    assert per["fp8-k-nvfp4-v"].bytes_per_page == slots * 64 + slots * 32 + slots * 4
    assert fp8.bytes_per_block / per["nvfp4"].bytes_per_block == pytest.approx(1 / (0.5 + 1 / 16))
    assert fp8.bytes_per_block / per["mxfp4"].bytes_per_block == pytest.approx(1 / (0.5 + 1 / 32))
    assert fp8.bytes_per_block / per["fp8-k-nvfp4-v"].bytes_per_block == pytest.approx(
        2 / (1 + 0.5 + 1 / 16)
    )
    config = transformers.LlamaConfig(**_COMMON)
    budget = cb_config(num_blocks=1000)
    _, fp8_blocks = continuous.plan_blocks(budget, config, fp8, torch.bfloat16)
    _, nv_blocks = continuous.plan_blocks(budget, config, per["nvfp4"], torch.bfloat16)
    assert fp8_blocks == 2000  # half the bytes of bf16
    assert nv_blocks == 1000 * fp8.dense_block_bytes(torch.bfloat16) // per["nvfp4"].bytes_per_block
    assert nv_blocks / fp8_blocks == pytest.approx(1.78, abs=0.01)


def test_memory_sized_cache_counts_4bit_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No num_blocks: the free memory, less one step's activations, buys NVFP4 blocks (pages
    of 64 tokens: no part of the block is padded, so the ratio to FP8 is the formats')."""
    shape = dict(num_layers=2, page_size=64, num_kv_heads=2, head_dim=32)
    layout = continuous.BlockLayout(**shape, k_fp4=NVFP4, v_fp4=NVFP4)
    fp8 = continuous.BlockLayout(**shape)
    assert layout.bytes_per_page == 2 * (64 * 2 * 16 + 64 * 2 * 2)
    free = 8 << 20
    monkeypatch.setattr(cb_storage, "_memory_breakdown", lambda: (free, 0, 0))
    config = tiny().config
    cfg = cb_config(num_blocks=None, max_batch_tokens=64, max_memory_percent=0.5)
    _, blocks = continuous.plan_blocks(cfg, config, layout, torch.float32)
    _, fp8_blocks = continuous.plan_blocks(cfg, config, fp8, torch.float32)
    step = 64 * (max(64 * 4 + 128 * 4, 4 * (64 + 4 * 32 + 2 * 2 * 32 + 2 * 4 * 32)) + 52)
    per = layout.bytes_per_block
    assert blocks == (free // 2 - 2 * per - step) // (per + 8)
    assert blocks / fp8_blocks == pytest.approx(1 / (0.5 + 1 / 16), rel=0.01)
    monkeypatch.setattr(cb_storage, "_memory_breakdown", lambda: (4096, 0, 0))
    with pytest.raises(CacheCapacityError, match="hold no NVFP4 block"):
        continuous.plan_blocks(cfg, config, layout, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_num_blocks_is_a_budget_the_4bit_cache_holds_more_blocks_of(fmt: str) -> None:
    model, _, _ = models(fmt)
    manager = model.init_continuous_batching(
        generation_config=gen_config(), continuous_batching_config=cb_config(num_blocks=10)
    )
    manager.start()
    try:
        manager.add_request(prompts((5,))[0], request_id="x", max_new_tokens=2)
        deadline = time.monotonic() + 60
        while manager.batch_processor is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cache = manager.batch_processor.cache
        layout = cache.kvq.layout
    finally:
        manager.stop(block=True)
    # 10 fp32 blocks of 16 tokens, 2 layers, 2 KV heads of 32
    budget = 10 * 2 * 2 * 16 * 2 * 32 * 4
    codes, scales = {  # one layer's page, K and V, each part 128-aligned
        "nvfp4": (2 * 16 * 2 * 16, 2 * 128),  # 16 tokens x 2 heads x 2 blocks = 64 -> 128
        "mxfp4": (2 * 16 * 2 * 16, 2 * 128),  # 1 block per head: 32 bytes -> 128
        "fp8-k-nvfp4-v": (16 * 2 * 32 + 16 * 2 * 16, 128),
    }[fmt]
    assert layout.bytes_per_block == 2 * (codes + scales)
    assert cache.num_blocks == budget // layout.bytes_per_block
    assert continuous.live_caches() == []


# ---------------------------------------------------------------------- refusals


def test_a_layer_map_mixing_formats_is_refused_before_any_thread_starts() -> None:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 2}, head_dim=32)
    )
    kvhf.patch(model, backend="torch", kv_format={0: "nvfp4", "default": "mxfp4"})
    with pytest.raises(UnsupportedModelError) as info:
        model.generate_batch(
            prompts((4,)), generation_config=gen_config(), continuous_batching_config=cb_config()
        )
    message = str(info.value)
    assert "mxfp4 Hkv=2 D=32; nvfp4 Hkv=2 D=32" in message  # found
    assert "Expected every layer with the same KV heads, head dim and KV format" in message
    assert "Fix: " in message
    assert continuous.live_caches() == []


def test_layout_for_refuses_layers_of_one_format_but_other_geometries() -> None:
    _, handle, _ = models("nvfp4")
    specs = list(handle.state.layer_specs)
    specs[1] = replace(specs[1], num_kv_heads=1, k_scale=None, v_scale=None)
    with pytest.raises(UnsupportedModelError, match=r"2 kinds: nvfp4 Hkv=1 D=32; nvfp4 Hkv=2"):
        layout_for(specs, 16, torch.float32)
    specs = list(handle.state.layer_specs)
    specs[0] = replace(specs[0], kv_reused=True)
    with pytest.raises(UnsupportedModelError, match=r"later layers attend over the K/V of model"):
        layout_for(specs, 16, torch.float32)
