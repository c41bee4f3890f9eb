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
