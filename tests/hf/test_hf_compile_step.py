"""``patch(model, compile_step=...)`` on CPU: the compiled decode step equals the eager one.

On CPU the graph runner's static step runs eagerly (no CUDA graph), and with
``compile_step=True`` it runs through the ``torch.compile``'d decoder layers:
the same path that a CUDA graph captures on the GPU. The tests compile with
a counting backend (dynamo's graphs run as traced, and every compiled graph
and call is counted) or ``aot_eager``, so they check the wiring without a C++
compile; one slow test compiles with inductor. The capture of compiled layers
on CUDA is tested in ``tests/hf/test_hf_compile_gpu.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from hf_steps import cache_kwarg, min_cosine, step_logits
from hf_steps import generate_exactly as _generate
from hf_tiny import ALL_BUILDERS, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import BackendError, OptionError, OptionTypeError, UnsupportedModelError
from kvquant.integrations.hf import graphs
from kvquant.integrations.hf.attention import STEP_LAYER_ATTR
from kvquant.schemes import FirstTokens, GroupScales, KTransformScales, Mask, Pages, PerHeadScales


class CountingBackend:
    """A ``torch.compile`` backend that runs dynamo's graphs as traced, counting them.

    ``poison``: every compiled graph returns its outputs filled with NaN (to show that a
    test comparing the compiled step's results would catch a wrong compiled graph).
    """

    def __init__(self, poison: bool = False) -> None:
        self.graphs = 0
        self.calls = 0
        self.poison = poison

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            out = gm(*args)
            if not self.poison:
                return out
            return type(out)(
                torch.full_like(o, float("nan")) if isinstance(o, torch.Tensor) else o for o in out
            )

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Each test compiles from scratch (dynamo's code caches are per process)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _patch(
    model: Any, backend: Any = "aot_eager", compile_step: bool | None = True, **kw: Any
) -> Any:
    handle = kvhf.patch(
        model, backend="torch", page_size=4, cuda_graphs=True, compile_step=compile_step, **kw
    )
    compiled = handle.state.graph_runner.compiled
    if compiled is not None:
        compiled.backend = backend  # before the first compiled step
    return handle


def _module_state(model: Any) -> list[tuple[str, type, bool, bool]]:
    return [
        (name, type(m), "forward" in m.__dict__, STEP_LAYER_ATTR in m.__dict__)
        for name, m in model.named_modules()
    ]


def test_compiled_step_equals_eager_step_and_shares_one_graph_per_layer_class() -> None:
    model = build("llama")
    ids, mask = prompt(batch=3, length=12, pad=(5, 0, 2))
    cont = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, _ = step_logits(model, ids, mask, cont)  # the unpatched model
    got = {}
    counter = CountingBackend()
    for compiled in (False, True):
        handle = _patch(model, backend=counter, compile_step=compiled)
        got[compiled], cache = step_logits(model, ids, mask, cont)
        stats = handle.state.graph_runner.stats
        assert stats.static_eager == 9 and stats.ordinary == 1  # the prefill
        assert stats.compiled_runs == (9 if compiled else 0)
        assert cache.get_seq_length() == 12 + 9
        handle.remove()
    # Both layers ran one compiled graph (kvquant's write and attention are custom ops
    # inside it, no graph break), compiled once: the second layer and the later steps
    # reuse it; it ran at every step for every layer.
    assert counter.graphs == 1
    assert counter.calls == 9 * 2
    assert torch.isfinite(got[True]).all()
    # The same kernels on the same cache contents, fp32: equal within float rounding.
    torch.testing.assert_close(got[True], got[False], rtol=1e-5, atol=1e-5)
    assert min_cosine(got[True], ref) >= 0.999  # and the unpatched model within FP8 rounding


def test_more_layers_compile_no_more_graphs() -> None:
    counts = []
    for layers in (2, 4):
        torch._dynamo.reset()
        cfg = build("llama").config
        cfg.num_hidden_layers = layers
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        counter = CountingBackend()
        _patch(model, backend=counter)
        ids, mask = prompt(batch=2, length=9, pad=(2, 0))
        _generate(model, ids, mask, 4)
        counts.append(counter.graphs)
    assert counts[0] == counts[1]


def test_poisoned_compiled_graphs_reach_the_logits() -> None:
    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    handle = _patch(model, backend=CountingBackend(poison=True))
    out = _generate(model, ids, mask, 3)
    logits = torch.stack(out.logits)
    assert torch.isfinite(logits[0]).all()  # the prefill runs the original layers
    assert torch.isnan(logits[1:]).all()  # every decode step ran the compiled graphs
    handle.remove()


_FAST_FAMILIES = ["qwen3", "gemma2", "phi3"]
_SLOW_FAMILIES = [
    pytest.param(f, marks=pytest.mark.slow) for f in sorted(ALL_BUILDERS) if f not in _FAST_FAMILIES
]


@pytest.mark.parametrize("family", _FAST_FAMILIES + _SLOW_FAMILIES)
def test_greedy_generate_with_left_padding_equals_eager(family: str) -> None:
    model = build(family)
    ids, mask = prompt(batch=3, length=14, pad=(6, 0, 3))
    runs = {}
    for compiled in (False, True):
        handle = _patch(model, compile_step=compiled)
        out = _generate(model, ids, mask, 7)
        runs[compiled] = (out.sequences, torch.stack(out.logits))
        assert handle.state.graph_runner.stats.compiled_runs == (6 if compiled else 0)
        handle.remove()
    assert torch.equal(runs[True][0], runs[False][0])
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-5)


def test_prompt_length_compiles_nothing_new_and_prefill_stays_eager() -> None:
    model = build("llama")
    counter = CountingBackend()
    handle = _patch(model, backend=counter)
    ids, mask = prompt(batch=2, length=9, pad=(2, 0))
    _generate(model, ids, mask, 4)
    graphs, calls = counter.graphs, counter.calls
    per_step = calls // 3
    for length in (5, 17):  # other prompt lengths, same batch: the same compiled graphs
        ids, mask = prompt(batch=2, length=length, pad=(1, 0), seed=length)
        _generate(model, ids, mask, 4)
    assert counter.graphs == graphs
    # only the 3 decode steps of each call ran compiled code (never the prefill)
    assert counter.calls == calls + 2 * 3 * per_step
    handle.remove()


def test_remove_leaves_no_compiled_wrapper() -> None:
    model = build("llama")
    before = _module_state(model)
    forward = type(model).forward
    handle = _patch(model)
    ids, mask = prompt(batch=2, length=8, pad=(0, 3))
    _generate(model, ids, mask, 3)
    assert handle.state.graph_runner.stats.compiled_runs == 2
    # between steps nothing is installed either: only the runner on the model itself
    assert [s for s in _module_state(model) if s[0]] == [s for s in before if s[0]]
    handle.remove()
    assert _module_state(model) == before
    assert "forward" not in model.__dict__ and type(model).forward is forward
    for layer in model.model.layers:
        assert layer.forward.__func__ is type(layer).forward


@pytest.mark.parametrize("where", ["torch.compile", "backend"])
def test_auto_mode_falls_back_to_the_eager_step_once(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    handle = _patch(model, compile_step=False)
    want = _generate(model, ids, mask, 5)
    handle.remove()

    def broken_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("inductor is broken here")

    def broken_compile(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torch.compile is broken here")

    # CPU models compile only with compile_step=True: make auto mode consider CPU usable.
    monkeypatch.setattr(graphs, "compile_unusable_reason", lambda device: None)
    if where == "torch.compile":
        monkeypatch.setattr(torch, "compile", broken_compile)
    handle = _patch(model, backend=broken_backend, compile_step=None)
    with caplog.at_level(logging.WARNING, logger="kvquant"):
        got = _generate(model, ids, mask, 5)
        got2 = _generate(model, ids, mask, 5)
    warnings = [r for r in caplog.records if "compiled decode step" in r.getMessage()]
    assert len(warnings) == 1
    assert "is broken here" in warnings[0].getMessage()
    assert "compile_step=False" in warnings[0].getMessage()
    stats = handle.state.graph_runner.stats
    assert stats.compile_fallbacks == 1 and stats.static_eager == 8
    for out in (got, got2):
        assert torch.equal(out.sequences, want.sequences)
        assert torch.equal(torch.stack(out.logits), torch.stack(want.logits))
    handle.remove()


def test_compile_step_true_raises_and_keeps_the_cache() -> None:
    model = build("llama")

    def broken_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("inductor is broken here")

    handle = _patch(model, backend=broken_backend)
    ids, mask = prompt(batch=2, length=8, pad=(0, 2))
    key = cache_kwarg(model)
    cache = handle.new_cache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{key: cache})
        pages = [layer.k_pages.clone() for layer in cache.layers]
        with pytest.raises(BackendError, match="compile_step=False") as err:
            model(
                input_ids=ids[:, :1],
                attention_mask=torch.ones(2, 9, dtype=torch.long),
                position_ids=torch.full((2, 1), 8),
                **{key: cache},
            )
    assert isinstance(err.value, RuntimeError)
    assert "inductor is broken here" in str(err.value)
    assert cache.get_seq_length() == 8
    assert all(
        torch.equal(p, layer.k_pages[: p.shape[0]])
        for p, layer in zip(pages, cache.layers, strict=True)
    )
    assert all(
        "forward" not in layer.__dict__ and STEP_LAYER_ATTR not in layer.self_attn.__dict__
        for layer in model.model.layers
    )
    handle.remove()


def test_auto_mode_on_cpu_does_not_compile() -> None:
    model = build("llama")
    counter = CountingBackend()
    handle = _patch(model, backend=counter, compile_step=None)
    ids, mask = prompt(batch=2, length=8, pad=(0, 2))
    _generate(model, ids, mask, 3)
    assert counter.graphs == 0 and handle.state.graph_runner.stats.compiled_runs == 0
    assert graphs.compile_unusable_reason(torch.device("cpu")) is not None
    handle.remove()


def test_bad_compile_step_options_are_refused(tiny_llama: Any) -> None:
    with pytest.raises(OptionTypeError, match="compile_step"):
        kvhf.patch(tiny_llama, compile_step="yes")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="cuda_graphs=False"):
        kvhf.patch(tiny_llama, cuda_graphs=False, compile_step=True)
    assert not hasattr(tiny_llama, "_kvquant_state")
    with pytest.raises(OptionError, match="compile_step"):
        kvhf.KVQuantConfig(cuda_graphs=False, compile_step=True)
    cfg = kvhf.KVQuantConfig(compile_step=False)
    assert cfg.to_dict()["compile_step"] is False
    assert cfg.options().compile_step is False
    # no compiled layers without compile_step; the decision line says so
    handle = kvhf.patch(tiny_llama, cuda_graphs=True, compile_step=False)
    assert handle.state.graph_runner.compiled is None
    handle.remove()


def test_wrapped_decoder_layers(tiny_llama: Any, caplog: pytest.LogCaptureFixture) -> None:
    layer = tiny_llama.model.layers[1]
    layer.forward = layer.forward  # an instance-level wrapper, as accelerate's hooks install
    with pytest.raises(UnsupportedModelError, match="compile_step=False"):
        kvhf.patch(tiny_llama, cuda_graphs=True, compile_step=True)
    assert not hasattr(tiny_llama, "_kvquant_state")
    with caplog.at_level(logging.INFO, logger="kvquant"):
        handle = kvhf.patch(tiny_llama, cuda_graphs=True)
    assert handle.state.graph_runner.compiled is None
    assert any("compiled step: off (wrapped layers)" in r.getMessage() for r in caplog.records)
    handle.remove()
    assert "forward" in layer.__dict__  # the user's wrapper is left alone


@pytest.mark.slow
def test_inductor_compiled_step_matches_eager() -> None:
    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(4, 0))
    cont = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(2))
    got = {}
    for compiled in (False, True):
        handle = _patch(model, backend="inductor", compile_step=compiled)
        got[compiled], _ = step_logits(model, ids, mask, cont)
        assert handle.state.graph_runner.stats.compiled_runs == (4 if compiled else 0)
        handle.remove()
    # inductor fuses and reorders fp32 arithmetic: equal within float rounding
    torch.testing.assert_close(got[True], got[False], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- custom ops, one graph per layer

_OPCHECKS = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
"""opcheck's tests for kvquant's step ops (its schema test compares FP8 tensors with allclose,
which torch does not implement for FP8 on CPU: the mutations are checked by the test itself)."""


def _op_inputs(fmt: str, seed: int) -> dict[str, Any]:
    """Random pages, a step's new K/V and query, and the format's scales (B 2, Hkv 2, Hq 4, D 16)."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, hq, d, pages, ps = 2, 2, 4, 16, 6, 4

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    k_pages = (rand(pages, ps, hkv, d) * 50).to(torch.float8_e4m3fn)
    v_pages = (rand(pages, ps, hkv, d) * 50).to(torch.float8_e4m3fn)
    x: dict[str, Any] = dict(
        key=rand(b, hkv, 1, d), value=rand(b, hkv, 1, d), query=rand(b, hq, 1, d),
        k_pages=k_pages, v_pages=v_pages, slots=torch.tensor([[6], [13]]),
        block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        lens=torch.tensor([7, 2], dtype=torch.int32), kv_start=torch.tensor([2, 0], dtype=torch.int32),
        k_scale=None, v_scale=None, k_group_scales=None, v_group_scales=None, k_offset=None,
        k_rotation=None, first_k=None, first_v=None, first_lens=None, first_start=None, sinks=None,
    )  # fmt: skip
    if fmt in ("fp32-group", "rotated-k"):
        x["k_group_scales"] = torch.rand(pages, ps, hkv, 2, generator=g) / 100 + 1e-3
        x["v_group_scales"] = torch.rand(pages, ps, hkv, 2, generator=g) / 100 + 1e-3
        if fmt == "rotated-k":
            from kvquant.kernels import hadamard

            x["k_rotation"] = hadamard(d)
        x["scheme"] = GroupScales(head_dim=d, group_size=d // 2, k_rotation=x["k_rotation"])
    else:
        x["k_scale"] = torch.rand(hkv, generator=g) / 100 + 1e-3
        x["v_scale"] = torch.rand(hkv, generator=g) / 100 + 1e-3
        x["scheme"] = PerHeadScales(x["k_scale"], x["v_scale"])
    if fmt == "k-transform":
        from kvquant.kernels import hadamard

        x["k_offset"], x["k_rotation"] = rand(hkv, d), hadamard(d)
        x["first_k"], x["first_v"] = rand(b, 2, hkv, d), rand(b, 2, hkv, d)
        x["first_lens"] = torch.tensor([2, 1], dtype=torch.int32)
        x["first_start"] = torch.tensor([2, 1], dtype=torch.int32)  # row 1's start moved: unused
        x["sinks"] = rand(hq).to(torch.bfloat16)
        x["scheme"] = KTransformScales(x["k_scale"], x["v_scale"], x["k_offset"], x["k_rotation"])
    return x


@pytest.mark.parametrize("fmt", ["fp32-group", "per-head", "k-transform", "rotated-k"])
def test_step_ops_equal_the_reference_kernels_and_pass_opcheck(fmt: str) -> None:
    from kvquant.kernels import paged_attention_reference, write_kv_reference

    x = _op_inputs(fmt, seed=len(fmt))
    scheme = x["scheme"]
    groups = (x["k_group_scales"], x["v_group_scales"])
    pages = Pages(x["k_pages"], x["v_pages"], *groups)
    want = Pages(*(None if t is None else t.clone() for t in (pages.k, pages.v, *groups)))
    write_kv_reference(
        x["key"].transpose(1, 2), x["value"].transpose(1, 2), want, x["slots"], scheme
    )
    name, ints, tensors = scheme.flatten()
    write_args = (
        x["key"], x["value"], x["k_pages"], x["v_pages"], *groups, x["slots"], name, ints,
        tensors, "torch",
    )  # fmt: skip
    torch.ops.kvquant.step_write(*write_args)
    assert torch.equal(x["k_pages"].view(torch.uint8), want.k.view(torch.uint8))
    assert torch.equal(x["v_pages"].view(torch.uint8), want.v.view(torch.uint8))
    for got_scales, want_scales in zip(groups, (want.k_scales, want.v_scales), strict=True):
        if got_scales is not None:  # fp32-group: the new token's scales
            assert torch.equal(got_scales, want_scales)
    first = None
    if x["first_k"] is not None:
        # the storage's rule: a row whose first tokens were kept for another start reads pages
        lens = torch.where(x["kv_start"] == x["first_start"], x["first_lens"], 0).to(torch.int32)
        first = FirstTokens(x["first_k"], x["first_v"], lens)
    sinks = None if x["sinks"] is None else x["sinks"].float()
    expected = paged_attention_reference(
        x["query"].transpose(1, 2), pages, x["block_table"], x["lens"], scheme, sm_scale=0.25,
        mask=Mask(causal=True, kv_start=x["kv_start"], sinks=sinks), first=first,
    )  # fmt: skip
    attn_args = (
        x["query"], x["k_pages"], x["v_pages"], *groups, x["block_table"], x["lens"],
        x["kv_start"], name, ints, tensors, x["first_k"], x["first_v"], x["first_lens"],
        x["first_start"], x["sinks"], 0.25, 0.0, 0, "torch",
    )  # fmt: skip
    got = torch.ops.kvquant.step_attention(*attn_args)
    assert got.shape == (2, 1, 4, 16) and got.is_contiguous() and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.kvquant.step_write.default, write_args, test_utils=_OPCHECKS)
    torch.library.opcheck(torch.ops.kvquant.step_attention.default, attn_args, test_utils=_OPCHECKS)


class GraphRecorder(CountingBackend):
    """A counting backend that also keeps the call targets of every graph it compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[set[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.targets.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return super().__call__(gm, example_inputs)


@pytest.mark.parametrize(
    ("family", "graphs"),
    [("llama", 1), ("qwen3", 1), ("phi3", 1), ("gemma2", 2)],  # gemma2: sliding + full layers
)
def test_each_layer_type_compiles_one_graph_without_a_break(family: str, graphs: int) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    model = build(family)
    recorder = GraphRecorder()
    handle = _patch(model, backend=recorder)
    ids, mask = prompt(batch=2, length=9, pad=(3, 0))
    _generate(model, ids, mask, 4)
    assert handle.state.graph_runner.stats.compiled_runs == 3
    assert dict(counters["graph_break"]) == {}
    assert recorder.graphs == graphs
    assert recorder.calls == 3 * len(model.model.layers)  # one graph call per layer per step
    for targets in recorder.targets:  # the write and the attention are inside each graph
        assert {"kvquant.step_write", "kvquant.step_attention"} <= targets
    handle.remove()


def test_a_growing_pool_compiles_nothing_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page counts and block-table widths are dynamic in the graph: growth is no recompile."""
    from kvquant.integrations.hf import pool_sizing

    monkeypatch.setattr(pool_sizing, "GROWTH_HEADROOM", 0.0)  # grow at every page
    model = build("llama")
    ids, mask = prompt(batch=2, length=9, pad=(3, 0))
    runs, pools = {}, {}
    for compiled in (False, True):
        recorder = GraphRecorder()
        handle = _patch(model, backend=recorder, compile_step=compiled)
        cache = handle.new_cache()
        runs[compiled] = _generate(model, ids, mask, 40, **{cache_kwarg(model): cache})
        pools[compiled] = (cache.capacity_version, cache.layers[0].k_pages.shape[0])
        assert handle.state.graph_runner.stats.compiled_runs == (39 if compiled else 0)
        handle.remove()
    # the first growth makes room before the first static step, the later ones are mid-decode
    assert pools[True] == pools[False] and pools[True][0] >= 3
    assert recorder.graphs == 1  # compiled once, at the first pool size
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    torch.testing.assert_close(
        torch.stack(runs[True].logits), torch.stack(runs[False].logits), rtol=1e-5, atol=1e-5
    )


def test_a_layer_that_drops_the_step_keyword_breaks_the_graph_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A decoder layer that does not hand kvquant's keyword on: the cache layer writes (logged)."""
    from torch._dynamo.utils import counters

    from kvquant.integrations.hf import attention

    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    handle = _patch(model, compile_step=False)
    want = _generate(model, ids, mask, 5)
    handle.remove()
    # the layers get the step under another name, which the attention function does not know
    monkeypatch.setattr(graphs, "STEP_KWARG", "kvquant_step_elsewhere")
    monkeypatch.setattr(attention, "_logged_breaks", set())
    counters.clear()
    handle = _patch(model, backend=CountingBackend())
    with caplog.at_level(logging.INFO, logger="kvquant"):
        got = _generate(model, ids, mask, 5)
    logged = [r.getMessage() for r in caplog.records if "breaks its graph" in r.getMessage()]
    assert len(logged) == 1 and "LlamaAttention" in logged[0]
    assert sum(counters["graph_break"].values()) > 0
    assert handle.state.graph_runner.stats.compiled_runs == 4
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(
        torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5
    )
    handle.remove()


@pytest.mark.parametrize("fmt", ["per-tensor", "k-transform"])
def test_static_scale_formats_compile_to_the_eager_step(fmt: str) -> None:
    """Static scales, and the K transform's offset, rotation and first tokens, through the ops."""
    from hf_kt import biased_llama, k_transform_scales
    from hf_steps import calibrate

    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    runs = {}
    for compiled in (False, True):
        model = biased_llama()
        if fmt == "k-transform":
            scales = k_transform_scales(model, first_tokens=2)
        else:
            scales = calibrate(model, ids, mask, "per-tensor")
        handle = _patch(model, compile_step=compiled, scales=scales)
        assert handle.scales.granularity == fmt
        runs[compiled] = _generate(model, ids, mask, 6)
        stats = handle.state.graph_runner.stats
        assert stats.compiled_runs == (stats.static_eager if compiled else 0)
        assert stats.static_eager >= 3
        handle.remove()
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    logits = torch.stack(runs[True].logits)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, torch.stack(runs[False].logits), rtol=1e-5, atol=1e-5)


def test_sink_logits_are_converted_once_per_layer() -> None:
    """gpt-oss: the op converts each layer's sinks to fp32 once (the same parameter every call),
    so the kernels' value check never reads a new tensor inside a CUDA graph capture."""
    from kvquant.integrations.hf import step_ops

    before = {id(t) for t in step_ops.converted_sinks()}
    model = build("gpt_oss")
    handle = _patch(model)
    ids, mask = prompt(batch=2, length=9, pad=(3, 0))
    _generate(model, ids, mask, 5)
    assert handle.state.graph_runner.stats.compiled_runs == 4
    converted = [t for t in step_ops.converted_sinks() if id(t) not in before]
    assert len(converted) == len(model.model.layers)
    for layer in model.model.layers:
        assert any(torch.equal(c, layer.self_attn.sinks.float()) for c in converted)
    handle.remove()


def test_inductor_options_leave_an_explicit_thread_count_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvquant.integrations.hf.graphs import inductor_options

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert inductor_options() == {"triton.autotune_pointwise": False, "compile_threads": 1}
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
    assert inductor_options() == {"triton.autotune_pointwise": False}
