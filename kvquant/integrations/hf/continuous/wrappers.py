"""The wrappers that route a patched model's continuous batching through kvquant: the attention
of transformers 5.17, the model's entry points, the manager's result and stop, the step hooks.

Each is undone by ``handle.remove()``; why each is needed is in ``docs/dev/continuous-batching.md``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvquant.cache import release_library_workspaces
from kvquant.errors import (
    BatchingError,
    KVQuantError,
    OptionError,
    UnsupportedModelError,
)
from kvquant.integrations.hf.compat import (
    BatchingFlavour,
    batching_attention_by_name,
    batching_flavour,
    batching_page_size,
    full_attention_groups,
    swaps_batching_caches_to_cpu,
)
from kvquant.integrations.hf.continuous.caches import (
    VERSION_MESSAGE,
    install_factory,
    is_batching_cache,
    refuse_sliding,
    register_config,
    unregister_config,
)
from kvquant.integrations.hf.continuous.layout import DECODE_PATH_BLOCKS, PAGED_NAME, layout_for
from kvquant.integrations.hf.continuous.storage import release
from kvquant.integrations.hf.marks import MISSING, STATE_ATTR

__all__ = [
    "BatchingHooks",
    "check_batching",
    "install",
    "paged_attention_forward",
]

_logger = logging.getLogger("kvquant")


# ---------------------------------------------------------------------- attention (5.17)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """kvquant's attention under transformers 5.17's continuous batching (``"paged|kvquant"``).

    transformers 5.17 hands the batching cache to a ``paged|`` attention function,
    which stores the new K/V itself: this one stores them in kvquant's pages (FP8 or 4-bit) and attends.

    Raises:
        UnsupportedModelError: called without kvquant's batching cache.
    """
    cache_obj = kwargs.pop("cache", None)
    if not is_batching_cache(cache_obj):
        raise UnsupportedModelError(
            f"{PAGED_NAME!r} is kvquant's attention for transformers' continuous batching over "
            f"its quantized cache; it got {type(cache_obj).__name__}. Fix: leave the attention "
            "implementation to kvquant.patch (it switches it for the batching run only)."
        )
    step = cache_obj.kvq.write(int(getattr(module, "layer_idx", -1)), key, value)
    return step.attend(
        module,
        query,
        key,
        value,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=softcap,
        s_aux=s_aux,
    )


paged_attention_forward = torch.compiler.disable(paged_attention_forward)


# ---------------------------------------------------------------------- model wrappers


class _Bound:
    """A callable of this integration that holds its model and patch state as attributes
    (``copy.deepcopy`` of the model copies it with the model)."""

    def __init__(self, model: nn.Module, state: Any, previous: Any = MISSING) -> None:
        self.model = model
        self.state = state
        self.previous = previous

    def active(self) -> bool:
        return getattr(self.model, STATE_ATTR, None) is self.state

    def original(self, name: str) -> Callable[..., Any]:
        if self.previous is not MISSING:
            fn: Callable[..., Any] = self.previous
            return fn
        return getattr(type(self.model), name).__get__(self.model)


_runs = threading.local()
"""The :class:`_Run` of the ``generate_batch`` call in progress in this thread, if any."""


@dataclass
class _Run:
    """What one ``generate_batch`` call saw: its managers, and the requests whose failure
    ``manager.get_result`` raised inside transformers' loop (which logs it and goes on)."""

    managers: list[Any]
    failures: dict[str, str]


def _cb_config_of(call: inspect.BoundArguments) -> Any:
    cfg = call.arguments.get("continuous_batching_config")
    if cfg is None:
        gen = call.arguments.get("generation_config")
        cfg = getattr(gen, "continuous_batching_config", None)
    if cfg is None:
        from transformers import ContinuousBatchingConfig

        cfg = ContinuousBatchingConfig()
    return cfg


def check_batching(model: nn.Module, state: Any, cb_config: Any) -> BatchingFlavour:
    """Refuse, before any thread starts, what kvquant's batching cannot serve; the flavour.

    Raises:
        UnsupportedModelError: an unknown transformers layout, layers kvquant's cache
            cannot hold, or a model sharded over several devices.
        OptionError: a ContinuousBatchingConfig option kvquant cannot honour.
    """
    kind = batching_flavour()
    if kind is None:
        raise UnsupportedModelError(VERSION_MESSAGE)
    specs = list(state.layer_specs)
    page = batching_page_size(cb_config, kind)
    # the layout's checks (a page size left to transformers' default is checked with the cache)
    page_or_default = page or max([16, *(s.recent_tokens for s in specs)])
    layout_for(specs, page_or_default, torch.float32, state.options.recent_auto)
    from transformers.generation.continuous_batching import cache as cbc

    groups: Any = cbc.group_layers_by_attn_type(state.text_config)
    refuse_sliding(full_attention_groups(groups, kind))
    if getattr(model, "_device_mesh", None) is not None:
        raise UnsupportedModelError(
            f"{state.model_name}: kvquant's continuous batching runs on one device; the model is "
            "sharded (tensor parallelism). Fix: load it on one device."
        )
    name = state.model_name
    graphs = cb_config.use_cuda_graph
    varlen, decode = decode_graphs_asked(cb_config)
    if varlen:
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(use_cuda_graph={graphs!r}); kvquant plans steps "
            "with prompts or chunks on the host, which no CUDA graph captures. Fix: "
            "use_cuda_graph=(False, True) (decode steps only, transformers 5.24 or later) or "
            "False."
        )
    if decode and kind != "allocators":
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(use_cuda_graph={graphs!r}); kvquant captures "
            "decode steps on transformers' decode path, which transformers 5.17 does not have. "
            "Fix: use_cuda_graph=False, or transformers 5.24 or later."
        )
    if decode and getattr(cb_config, "max_blocks_per_request", None) == 0:
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(use_cuda_graph={graphs!r}, "
            "max_blocks_per_request=0); kvquant captures decode steps on transformers' decode "
            "path, which max_blocks_per_request=0 turns off. Fix: leave max_blocks_per_request "
            "unset (or above 0), or use_cuda_graph=False."
        )
    for field_name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(cb_config, field_name, None) is not None:
            raise OptionError(
                f"{name}: ContinuousBatchingConfig({field_name}=...); kvquant's batching step "
                f"runs eagerly. Fix: {field_name}=None."
            )
    if swaps_batching_caches_to_cpu(kind) and cb_config.cpu_offload_space != 0:
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(cpu_offload_space={cb_config.cpu_offload_space}); "
            "on transformers 5.17 the CPU swap pool copies caches in the model's dtype, not "
            "kvquant's quantized blocks. Fix: cpu_offload_space=0 (requests that do not fit are "
            "recomputed), or transformers 5.24."
        )
    nf = max(s.first_tokens for s in specs)
    if page is not None and nf > int(page):
        raise OptionError(
            f"{name}: the k-transform keeps {nf} first tokens per request at full precision, "
            f"in the request's first block of {page} tokens. Fix: a page size of at least {nf}."
        )
    return kind


def decode_graphs_asked(cb_config: Any) -> tuple[bool, bool]:
    """``(varlen, decode)``: the steps the user asks transformers to replay from CUDA graphs
    (``use_cuda_graph`` True: both; None: neither, which is kvquant's default).

    Raises:
        OptionError: ``use_cuda_graph`` is neither None, a bool nor a pair of bools.
    """
    graphs = cb_config.use_cuda_graph
    if graphs is None or isinstance(graphs, bool):
        return bool(graphs), bool(graphs)
    if not isinstance(graphs, (tuple, list)) or len(graphs) != 2:
        raise OptionError(
            f"ContinuousBatchingConfig(use_cuda_graph={graphs!r}); expected None, a bool, or a "
            "(prompt steps, decode steps) pair of bools. Fix: use_cuda_graph=(False, True) "
            "for decode steps from CUDA graphs, or leave it unset."
        )
    varlen, decode = graphs
    return bool(varlen), bool(decode)


@contextmanager
def _presented(model: nn.Module, kind: BatchingFlavour) -> Iterator[str]:
    """The attention name transformers' manager is built under (module docstring).

    5.24 accepts ``paged|eager`` without switching to flash attention, and with it
    plans no CUDA graph (kvquant's runtime name ``kvquant`` is restored after).
    5.17 runs ``paged|<name>`` functions, handed the batching cache: kvquant's
    ``paged|kvquant`` is set here and restored by the manager when it stops.
    """
    config: Any = model.config
    setter: Any = model.set_attn_implementation
    if batching_attention_by_name(kind):
        from transformers import AttentionInterface

        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        before = str(config._attn_implementation)
        setter(PAGED_NAME)
        try:
            yield before
        except BaseException:
            setter(before)
            raise
        return
    before = config._attn_implementation_internal
    config._attn_implementation_internal = "paged|eager"
    try:
        yield str(before)
    finally:
        config._attn_implementation_internal = before


class _InitBatching(_Bound):
    """``model.init_continuous_batching``: every continuous-batching entry point comes here."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original("init_continuous_batching")
        if not self.active():
            return original(*args, **kwargs)
        cls: Any = type(self.model)
        sig = inspect.signature(cls.init_continuous_batching)
        call = sig.bind(self.model, *args, **kwargs)
        cb_config = _cb_config_of(call)
        kind = check_batching(self.model, self.state, cb_config)
        asked = getattr(cb_config, "max_blocks_per_request", None)
        _, decode_graphs = decode_graphs_asked(cb_config)
        register_config(self.state.text_config, self.state)
        install_factory()
        with _presented(self.model, kind) as before:
            manager = original(*args, **kwargs)
        if batching_attention_by_name(kind) and manager._original_attn_impl is None:
            manager._original_attn_impl = before  # the manager switches it back when it stops
        resolved = manager.continuous_batching_config
        # decode-path steps replay from graphs where asked and transformers has a graph
        # backend (it resolved the option already); every other step runs eagerly
        resolved.use_cuda_graph = (False, decode_graphs and resolved.cuda_graph_booleans[1])
        resolved.use_async_batching = False
        resolved.varlen_compile_config = None
        resolved.decode_compile_config = None
        # transformers' decode path (5.24 and later): kvquant's plan reads its block table
        if kind == "allocators":
            resolved.max_blocks_per_request = DECODE_PATH_BLOCKS if asked is None else int(asked)
        else:
            resolved.max_blocks_per_request = 0
        if not isinstance(manager.__dict__.get("get_result"), _GetResult):
            manager.get_result = _GetResult(manager)
            manager.stop = _Stop(manager)
        hooks = _hooks_of(self.state)
        if hooks is not None:
            hooks.managers.add(manager)
        run = getattr(_runs, "current", None)
        if run is not None:
            run.managers.append(manager)
        return manager


class _GetResult:
    """``manager.get_result``: a failed request raises instead of coming back as a result."""

    def __init__(self, manager: Any) -> None:
        self.manager = weakref.ref(manager)

    def __call__(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        manager = self.manager()
        if manager is None:  # pragma: no cover - called through the manager
            raise BatchingError("the continuous-batching manager is gone.")
        result = type(manager).get_result(manager, request_id=request_id, timeout=timeout)
        fatal = manager.background_thread_status.fatal_error
        if result is not None and result.error is not None:
            run = getattr(_runs, "current", None)
            if run is not None:
                run.failures[result.request_id] = result.error
            raise _failure({result.request_id: result.error}, fatal, result)
        if result is None and fatal is not None:
            raise _failure({}, fatal, None)
        return result


class _Stop:
    """``manager.stop``: a manager that stops for good frees its cache's device memory
    (:func:`release`), whatever still refers to the cache object, and the cuBLAS workspace
    its batching thread's handle allocated (held for the life of the process otherwise)."""

    def __init__(self, manager: Any) -> None:
        self.manager = weakref.ref(manager)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        manager = self.manager()
        if manager is None:  # pragma: no cover - called through the manager
            return None
        cache_obj = getattr(manager.batch_processor, "cache", None)
        result = type(manager).stop(manager, *args, **kwargs)
        if (
            is_batching_cache(cache_obj)
            and manager.batch_processor is None
            and not manager.is_running()
        ):
            release(cache_obj)
            release_library_workspaces()
        return result


def _fix_for(error: BaseException | None, texts: list[str]) -> str:
    text = " ".join([str(error or ""), *texts])
    if "can be scheduled" in text or "offloaded" in text or isinstance(error, MemoryError):
        return (
            "give the cache more room (a larger num_blocks or max_memory_percent in the "
            "ContinuousBatchingConfig), or send shorter requests (prompt + max_new_tokens)"
        )
    if isinstance(error, torch.OutOfMemoryError):
        return (
            "a smaller max_memory_percent, num_blocks or max_batch_tokens in the "
            "ContinuousBatchingConfig"
        )
    return "see the error chained below; generate() per request runs the same quantized cache"


def _release_frames(error: BaseException | None) -> None:
    """Drop the local variables of the frames an error from the batching thread carries.

    The traceback stays (transformers also logged it); its frames' locals held the
    batching cache and its device buffer, which a kept exception (a notebook's
    ``sys.last_value``, a log handler's record) would otherwise keep alive.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _failure(failed: dict[str, str], fatal: BaseException | None, output: Any) -> KVQuantError:
    """The error the caller gets: the thread's own KVQuantError, else a BatchingError."""
    _release_frames(fatal)
    if isinstance(fatal, KVQuantError):
        return fatal
    first = next(iter(failed.items()), None)
    what = f"request {first[0]!r} failed: {first[1]}" if first else "the batching thread died"
    more = f" ({len(failed)} requests failed)" if len(failed) > 1 else ""
    cause = f" ({type(fatal).__name__}: {fatal})" if fatal is not None and not first else ""
    err = BatchingError(
        f"continuous batching on kvquant's cache: {what}{cause}{more}. Fix: "
        f"{_fix_for(fatal, list(failed.values()))}."
    )
    err.output = output  # type: ignore[attr-defined]
    if fatal is not None:
        err.__cause__ = fatal
    return err


class _GenerateBatch(_Bound):
    """``model.generate_batch``: raises what transformers' ``generate_batch`` only logs."""

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        original = self.original("generate_batch")
        if not self.active():
            return original(inputs, *args, **kwargs)
        outer = getattr(_runs, "current", None)
        run = _Run(managers=[], failures={})
        _runs.current = run
        try:
            results = original(inputs, *args, **kwargs)
        finally:
            _runs.current = outer
            _drop_stale_caches(self.state)
        fatal = next(
            (
                m.background_thread_status.fatal_error
                for m in run.managers
                if m.background_thread_status.fatal_error
            ),
            None,
        )
        failed = {**run.failures}
        failed.update({rid: r.error for rid, r in results.items() if r.error is not None})
        if fatal is not None or failed:
            raise _failure(failed, fatal, None)
        # one result per prompt at least (transformers 5.24 adds the num_return_sequences
        # copies, 5.17 returns the prompts' own requests only)
        own = sum(1 for rid in results if "__child#" not in rid)
        if own < len(inputs):
            raise BatchingError(
                f"continuous batching on kvquant's cache: {len(inputs) - own} of "
                f"{len(inputs)} requests came back without a result (the batching thread "
                f"stopped). Fix: {_fix_for(None, [])}."
            )
        return results


def _drop_stale_caches(state: Any) -> None:
    """Forget a batching cache a failed forward left on the attention modules (memory)."""
    for site in state.sites:
        held = site.module.__dict__.get("_kvq_cache")
        if held is not None and is_batching_cache(held):
            site.module.__dict__["_kvq_cache"] = None


class _BeginStep(_Bound):
    """Decoder forward pre-hook: plans a continuous-batching step once for every layer."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        obj: Any = kwargs.get("cache")
        if self.active() and is_batching_cache(obj):
            obj.kvq.begin(kwargs)


class _EndStep(_Bound):
    """Decoder forward hook (always called): drops the step's plan."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        obj: Any = kwargs.get("cache")
        if is_batching_cache(obj):
            obj.kvq.end()


class BatchingHooks:
    """What :func:`install` put on a model; ``remove()`` takes it all off (``handle.remove()`` calls it).

    Attributes:
        managers: the continuous-batching managers built on the model under this patch.
    """

    def __init__(self, model: nn.Module, state: Any) -> None:
        self.model = model
        self.state = state
        self.managers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.saved: dict[str, Any] = {}
        decoder = getattr(model, "base_model", model)
        self.handles = [
            decoder.register_forward_pre_hook(_BeginStep(model, state), with_kwargs=True),
            decoder.register_forward_hook(
                _EndStep(model, state), with_kwargs=True, always_call=True
            ),
        ]
        for name, cls in (
            ("init_continuous_batching", _InitBatching),
            ("generate_batch", _GenerateBatch),
        ):
            if not callable(getattr(type(model), name, None)):
                continue
            previous = model.__dict__.get(name, MISSING)
            self.saved[name] = previous
            model.__dict__[name] = cls(model, state, previous)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its managers (a loaded model has none running)."""
        state = dict(self.__dict__)
        state["managers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.managers = weakref.WeakSet()

    def __deepcopy__(self, memo: dict[int, Any]) -> BatchingHooks:
        """A copied model's hooks: the same attributes copied, no managers."""
        copied = BatchingHooks.__new__(BatchingHooks)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name != "managers":
                copied.__dict__[name] = copy.deepcopy(value, memo)
        copied.managers = weakref.WeakSet()
        return copied

    def remove(self) -> None:
        """Stop the managers still running, drop a kept one, restore the model (idempotent)."""
        model = self.model
        for manager in list(self.managers):
            if manager.is_running():
                _logger.warning(
                    "kvquant: handle.remove() stops a continuous-batching manager still running "
                    "on kvquant's cache (its unfinished requests fail)."
                )
                manager.stop(block=True, timeout=10, hard_stop=True)
        kept = model.__dict__.get("_cached_continuous_batching_manager")
        if kept is not None and kept in self.managers:
            model.destroy_cached_continuous_batching_manager()  # type: ignore[operator]
        self.managers = weakref.WeakSet()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for name, previous in self.saved.items():
            current = model.__dict__.get(name)
            if isinstance(current, _Bound) and current.state is self.state:
                if previous is MISSING:
                    del model.__dict__[name]
                else:
                    model.__dict__[name] = previous
        self.saved = {}
        _drop_stale_caches(self.state)
        unregister_config(self.state.text_config)


def _hooks_of(state: Any) -> BatchingHooks | None:
    return next((h for h in state.handles if isinstance(h, BatchingHooks)), None)


def install(model: nn.Module, state: Any) -> BatchingHooks:
    """Make the patched ``model``'s continuous batching run on kvquant's pages (FP8 or 4-bit).

    Called by :func:`kvquant.patch` after its own hooks; what it installs is listed
    in the module docstring. Nothing process-wide changes until the model's first
    ``init_continuous_batching``.

    Returns:
        The hooks; their ``remove()`` undoes everything (the patch's handle calls it).
    """
    return BatchingHooks(model, state)
