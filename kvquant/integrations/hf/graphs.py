"""CUDA-graph decode steps for patched models (``kvquant.patch``'s ``cuda_graphs``).

:class:`DecodeGraphRunner` captures the one-token forward of a patched model in
one CUDA graph per :class:`~kvquant.integrations.hf.cache_layer.KVQuantCache`
and replays it for every later decode step (an eager step launches hundreds of
small kernels: ``generate`` is host bound). Steps that do not qualify (prefill,
a custom mask, gradients, ...) run the ordinary forward; on CPU the same static
step runs eagerly. With ``compile_step`` the graph captures each decoder
layer's ``torch.compile``'d forward (:class:`CompiledLayers`), whose write and
attention are the custom ops of :mod:`~kvquant.integrations.hf.step_ops`. The
runner is installed as the model instance's ``forward`` attribute (transformers
offers no hook that replaces a step); the patch handle's ``remove()`` deletes it.

Design (when a step qualifies, capture, recapture, compile): docs/dev/decode-steps.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kvquant.cache import StaticStep
from kvquant.errors import BackendError, KVQuantError
from kvquant.integrations.hf.attention import STEP_LAYER_ATTR
from kvquant.integrations.hf.cache_layer import DecodeMaskMemo, KVQuantCache, KVQuantLayer
from kvquant.integrations.hf.compat import CACHE_KEYWORDS
from kvquant.integrations.hf.step_ops import STEP_KWARG, layer_step

__all__ = [
    "CompiledLayers",
    "DecodeGraph",
    "DecodeGraphRunner",
    "GraphStats",
    "compile_unusable_reason",
    "left_padding_starts",
    "offloaded_weights",
    "one_device_reason",
    "pool_devices",
    "step_left_padding_starts",
]

_logger = logging.getLogger("kvquant")

_SCALARS = (bool, int, float, str)


@dataclass
class DecodeGraph:
    """The captured decode step of one cache.

    Attributes:
        key: the call signature it was built for (tensor shapes, dtypes and
            devices, and the other arguments' values).
        static: the static step tensors.
        inputs: one static buffer per tensor argument, by keyword.
        call_kwargs: the keyword arguments the step passes to ``forward``, but the
            cache (:meth:`call` adds it: the cache holds this record, and a record
            that held the cache would keep both alive until the cyclic garbage
            collector ran).
        cache_key: the keyword the cache is passed under.
        graph: the CUDA graph (None until captured; always None on CPU).
        output: the captured step's output (static tensors; :data:`_CACHE_MARK`
            where the output carries the cache).
    """

    key: tuple[Any, ...]
    static: StaticStep
    inputs: dict[str, torch.Tensor]
    call_kwargs: dict[str, Any]
    cache_key: str = "cache"
    graph: Any = None
    output: Any = None

    def call(self, forward: Callable[..., Any], cache: KVQuantCache) -> Any:
        """``forward`` over the step's static arguments and ``cache``."""
        return forward(**self.call_kwargs, **{self.cache_key: cache})


class _CacheMark:
    """Stands for the cache in a captured output (see :class:`DecodeGraph`)."""

    def __repr__(self) -> str:
        return "<the step's cache>"


_CACHE_MARK = _CacheMark()


def _without_cache(out: Any, cache: KVQuantCache) -> Any:
    """``out`` with :data:`_CACHE_MARK` in place of ``cache`` (a tuple or a ``ModelOutput``)."""
    if isinstance(out, tuple):
        return type(out)(_CACHE_MARK if x is cache else x for x in out)
    return type(out)(**{k: (_CACHE_MARK if v is cache else v) for k, v in out.items()})


def pool_devices(cache: KVQuantCache) -> set[torch.device]:
    """The devices ``cache``'s page pools sit on (each layer's where that layer runs)."""
    return {
        layer.storage.device
        for layer in cache.layers
        if isinstance(layer, KVQuantLayer) and layer.storage is not None
    }


def offloaded_weights(model: nn.Module) -> bool:
    """Whether accelerate loads some of ``model``'s weights for each forward (``device_map``
    entries ``"cpu"`` or ``"disk"`` next to a GPU, or ``"disk"``): its hooks' ``offload``."""
    for mod in model.modules():
        hook = getattr(mod, "_hf_hook", None)
        if hook is None:
            continue
        if any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,))):
            return True
    return False


def one_device_reason(model: nn.Module, cache: KVQuantCache, device: torch.device) -> str | None:
    """Why the decode steps of ``cache`` cannot run as one static step on ``device``, or None.

    The static step (and its CUDA graph) holds one set of step tensors on the input's
    device: every layer's pages must be there. On CUDA every weight must also stay
    resident (a graph cannot capture accelerate's loading of offloaded weights).
    """
    devices = pool_devices(cache)
    if devices != {device}:
        where = ", ".join(sorted(str(d) for d in devices))
        return (
            f"its layers keep their pages on several devices or away from the input ({where}; "
            f"the input ids on {device}), and a decode graph runs on one device"
        )
    if device.type == "cuda" and offloaded_weights(model):
        return (
            "accelerate loads offloaded weights (device_map 'cpu' or 'disk') during each "
            "forward, which a CUDA graph cannot capture"
        )
    return None


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One warm-up stream per device for the whole process.

    Libraries keep per-stream state: cuBLAS allocates a workspace for every
    stream it runs on and keeps it for the life of the process, so a new
    stream per capture would leave that workspace behind after every patch.
    """
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def left_padding_starts(
    mask: torch.Tensor | None, batch: int, total: int, device: torch.device
) -> torch.Tensor | None:
    """Left-padding starts int32 ``[B]`` of a 2D padding mask ``[B, total]``, or None.

    None means the mask is not pure left padding with a real newest token in
    every row (or has another shape): the step must take the ordinary path,
    which applies or refuses it. Reads the mask's values: one copy to the host,
    where the check runs (a handful of GPU launches and a sync cost more than
    copying a ``[B, total]`` mask at the sizes a decode step has).

    Example:
        >>> import torch
        >>> m = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        >>> left_padding_starts(m, 2, 4, m.device).tolist()
        [2, 0]
        >>> left_padding_starts(torch.tensor([[1, 0, 1, 1]]), 1, 4, m.device) is None
        True
    """
    if mask is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, total):
        return None
    host = mask.to("cpu")
    real = host if host.dtype == torch.bool else host != 0
    start = (~real).sum(dim=1, dtype=torch.int32)
    cols = torch.arange(total, dtype=torch.int32)
    if not (bool((real == (cols[None, :] >= start[:, None])).all()) and bool(real[:, -1].all())):
        return None
    return start.to(device)


MASK_MEMO_SPARE = 256
"""Columns of ones a :class:`DecodeMaskMemo` keeps past its mask (steps before a full check)."""


def step_left_padding_starts(
    cache: KVQuantCache, mask: torch.Tensor | None, total: int, device: torch.device
) -> torch.Tensor | None:
    """:func:`left_padding_starts` of a decode step, checked against the previous step's mask.

    ``generate`` grows the mask by a column of ones each step: when this mask is
    the previous step's plus such a column (one comparison on the mask's device
    against :class:`DecodeMaskMemo`'s copy), the starts are the previous step's,
    and the ``[B, total]`` copy to the host and its check are skipped. Anything
    else takes the full check. The memo lives on the cache, which ends with it.
    """
    batch = cache.batch_size_
    memo = cache.decode_mask_memo
    if (
        memo is not None
        and isinstance(mask, torch.Tensor)
        and tuple(mask.shape) == (batch, total)
        and memo.length == total - 1
        and total <= memo.ones.shape[1]
        and mask.device == memo.ones.device
        and mask.dtype == memo.ones.dtype
        and torch.equal(mask, memo.ones[:, :total])
    ):
        memo.length = total
        return memo.starts
    checked = left_padding_starts(mask, batch, total, device)
    if isinstance(mask, torch.Tensor) and checked is not None:
        ones = torch.ones((batch, total + MASK_MEMO_SPARE), dtype=mask.dtype, device=mask.device)
        ones[:, :total].copy_(mask)
        cache.decode_mask_memo = DecodeMaskMemo(ones, total, checked)
    else:
        cache.decode_mask_memo = None
    return checked


def _signature(kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable key of a step's arguments (tensor shapes, dtypes, devices; other values).

    Strides are left out: the static buffers are contiguous and ``copy_`` takes any layout,
    so a view of a growing tensor (``ids[:, -1:]``) does not force a new capture.
    Returns None when an argument is neither a tensor nor a plain value.
    """
    key: list[Any] = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if name == "attention_mask" or name in CACHE_KEYWORDS:
            continue
        if isinstance(value, torch.Tensor):
            key.append((name, tuple(value.shape), value.dtype, value.device))
        elif value is None or type(value) in _SCALARS:
            key.append((name, value))
        else:
            return None
    return tuple(key)


def _copy_output(out: Any, cache: KVQuantCache) -> Any:
    """The step's output with every tensor cloned (the graph's own are overwritten next step)
    and ``cache`` where the captured output carried it."""

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone()
        return cache if x is _CACHE_MARK else x

    if isinstance(out, tuple):
        return type(out)(copy(x) for x in out)
    return type(out)(**{k: copy(v) for k, v in out.items()})


def compile_unusable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` with inductor cannot build the decode step on ``device``, or None.

    ``compile_step=None`` (auto) compiles only decode graphs on CUDA devices,
    where inductor emits Triton kernels: it needs a usable Triton.
    """
    if device.type != "cuda":
        return f"the model is on {device.type}, and compiled steps run inside CUDA graphs only"
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - every supported torch has it
        return "this torch build has no inductor Triton support"
    if not has_triton():
        return "Triton is not usable here (inductor generates Triton kernels for CUDA)"
    return None


class _CompileFailure(Exception):
    """Internal: the compiled step failed (``error``); the runner decides between raising and eager."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


def _compiled_layer_call(
    compiled: Callable[..., Any],
    layer: nn.Module,
    step: dict[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """One decoder layer of a compiled decode step: no cache, no mask enter the compiled code.

    The layer gets its cache layer's tensors (``step``, from
    :func:`~kvquant.integrations.hf.step_ops.layer_step`) as the keyword
    ``STEP_KWARG``, which it hands on to kvquant's attention: the write and the
    attention are custom ops inside the layer's graph. The static step masks
    the padding with its own ``kv_start``, so the mask (whose length grows
    every step, which would recompile a static-shape graph) is not needed.
    """
    for name in ("cache", "past_key_values", "attention_mask"):
        if name in kwargs:
            kwargs[name] = None
    kwargs[STEP_KWARG] = step
    return compiled(layer, *args, **kwargs)


def inductor_options() -> dict[str, Any]:
    """The inductor settings of a compiled decode step (``torch.compile(options=...)``).

    A decode step's kernels are small (one token per sequence), so what a first
    ``generate`` pays is compile time, not kernel time:

    - ``compile_threads=1``: inductor compiles the layer's few Triton kernels in
      this process instead of first starting a pool of worker processes, each of
      which imports torch (docs/performance.md, "Compiled decode steps"). A
      ``TORCHINDUCTOR_COMPILE_THREADS`` in the environment is left to rule.
    - ``triton.autotune_pointwise=False``: each elementwise kernel is compiled
      for one launch configuration instead of several timed at the first run.
    """
    options: dict[str, Any] = {"triton.autotune_pointwise": False}
    if not os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        options["compile_threads"] = 1
    return options


RECOMPILE_LIMIT = 64
"""dynamo's per-code-object recompile limit while the compiled layers run (default 8).

dynamo keeps the compiled versions of a function on its code object and stops
compiling it (running it eagerly, with a warning) past the limit. Some code
objects are shared widely: transformers 5.24 wraps every decoder layer's and
attention module's ``forward`` in one ``deprecate_kwarg`` wrapper function, so
each layer class, attention class, dtype and batch size adds a version of the
same code object. Raised only inside :meth:`CompiledLayers.installed`."""


class CompiledLayers:
    """The decoder layers of one model, with ``torch.compile``'d forwards for decode-graph steps.

    One compiled function per decoder-layer class (``torch.compile`` of the
    class's ``forward``, the layer passed as its first argument): dynamo
    treats the layer's parameters as inputs (``inline_inbuilt_nn_modules``),
    so every layer of the class runs the same compiled graph. Compiled with
    ``dynamic=False`` (a decode step has one shape per batch size; only the
    pools' page count and the block table's width are marked dynamic, see
    :func:`~kvquant.integrations.hf.step_ops.layer_step`) and
    ``fullgraph=False`` (a layer that does not hand kvquant's step keyword on
    to its attention still compiles, with a graph break there).

    Nothing is installed outside :meth:`installed`: the layers keep their
    original ``forward`` for every other call, and nothing is left on any
    module after it.

    Args:
        layers: the decoder layers (:func:`~kvquant.integrations.hf.models.decoder_layers`).
        attention: their attention modules, in layer order.
        backend: the ``torch.compile`` backend; ``"inductor"`` (the fused
            kernels) except in tests (``"aot_eager"`` or a counting backend
            check the wiring on CPU without a C++ compile). Set it before the
            first compiled step.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        attention: Sequence[nn.Module],
        backend: str | Callable[..., Any] = "inductor",
    ) -> None:
        self.layers = list(layers)
        self.attention = list(attention)
        self.backend = backend
        self._compiled: dict[type[nn.Module], Callable[..., Any]] = {}

    def _forward_of(self, cls: type[nn.Module]) -> Callable[..., Any]:
        fn = self._compiled.get(cls)
        if fn is None:
            fn = torch.compile(
                cls.forward,
                backend=self.backend,
                options=inductor_options() if self.backend == "inductor" else None,
                dynamic=False,
                fullgraph=False,
            )
            self._compiled[cls] = fn
        return fn

    @contextlib.contextmanager
    def installed(self, cache_layers: Sequence[KVQuantLayer], static: StaticStep) -> Iterator[None]:
        """While the block runs, the layers call their compiled forwards over ``cache_layers``.

        Each layer gets its cache layer's tensors and ``static``'s (the running
        static step) as kvquant's step keyword.

        Raises:
            _CompileFailure: a decoder layer already has an instance-level
                ``forward`` (a wrapper such as accelerate's hooks), which a
                compiled class ``forward`` would bypass.
            Exception: whatever ``torch.compile`` raises.
        """
        for layer in self.layers:
            if "forward" in layer.__dict__:
                raise _CompileFailure(
                    BackendError(
                        f"{type(layer).__name__} has an instance-level forward (a wrapper such as "
                        "accelerate's device hooks) that a compiled layer would bypass"
                    )
                )
        calls = [
            functools.partial(
                _compiled_layer_call, self._forward_of(type(m)), m, layer_step(cl, static)
            )
            for m, cl in zip(self.layers, cache_layers, strict=True)
        ]
        limit = max(int(torch._dynamo.config.recompile_limit), RECOMPILE_LIMIT)
        try:
            for layer, call in zip(self.layers, calls, strict=True):
                layer.__dict__["forward"] = call
            for attn, cache_layer in zip(self.attention, cache_layers, strict=True):
                attn.__dict__[STEP_LAYER_ATTR] = cache_layer
            with torch._dynamo.config.patch(recompile_limit=limit):
                yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
            for attn in self.attention:
                attn.__dict__.pop(STEP_LAYER_ATTR, None)


@dataclass
class GraphStats:
    """What the runner did (for tests and benchmarks).

    Attributes:
        captures: graphs captured.
        replays: decode steps served by a graph replay.
        static_eager: decode steps run through the static buffers without a graph (CPU).
        ordinary: calls passed to the ordinary forward.
        fallbacks: caches that fell back to eager decoding after a failed capture.
        compiled_runs: static-step forwards run through the compiled layers
            (a warm-up, a capture, or a CPU step).
        compile_fallbacks: compiled steps that failed and were run eagerly
            (``compile_step=None``).
    """

    captures: int = 0
    replays: int = 0
    static_eager: int = 0
    ordinary: int = 0
    fallbacks: int = 0
    compiled_runs: int = 0
    compile_fallbacks: int = 0


class DecodeGraphRunner:
    """The forward of a patched model with CUDA-graph decode steps (see the module docstring).

    Args:
        model: the patched model.
        original: the forward it had before (bound).
        is_active: whether the patch that installed the runner is still applied.
        compiled: the model's decoder layers for compiled steps, or None
            (``compile_step=False``).
        compile_step: None (auto: compile decode graphs on CUDA devices where
            inductor is usable; a failed compile is logged once and the eager
            step is captured) or True (compile every static step, also on CPU;
            a failed compile raises).
    """

    def __init__(
        self,
        model: nn.Module,
        original: Callable[..., Any],
        is_active: Callable[[], bool],
        compiled: CompiledLayers | None = None,
        compile_step: bool | None = None,
    ) -> None:
        self.model = model
        self.original = original
        self.is_active = is_active
        self.compiled = compiled
        self.compile_step = compile_step
        self.stats = GraphStats()
        self._logged_cpu = False
        self._logged_fallback = False
        self._logged_devices = False
        self._compile_off = compiled is None
        self._unusable: dict[torch.device, str | None] = {}
        self._warmed: set[tuple[Any, ...]] = set()
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # torch.compile(model.forward) traces this wrapper: the user's compiled forward
            # runs the ordinary step (a CUDA graph cannot be captured inside dynamo's trace)
            return self.original(*args, **kwargs)
        cache = self._eligible(args, kwargs)
        if cache is None:
            self.stats.ordinary += 1
            return self.original(*args, **kwargs)
        return self._step(cache, kwargs)

    # ------------------------------------------------------------------ deciding

    def _eligible(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KVQuantCache | None:
        if args or torch.is_grad_enabled() or self.model.training or not self.is_active():
            return None
        cache = next((kwargs[n] for n in CACHE_KEYWORDS if kwargs.get(n) is not None), None)
        if not isinstance(cache, KVQuantCache) or cache.cuda_graphs is False:
            return None
        if cache.patch_id != getattr(getattr(self.model, "_kvquant_state", None), "patch_id", None):
            return None  # another patch's cache: the ordinary forward refuses it
        if (
            cache.book.static is not None
            or cache.rollback_point is not None  # a stopped forward: the ordinary path crops it
            or cache.allocator is None
            or not cache.attention_is_kvquant()
        ):
            return None
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (cache.batch_size_, 1):
            return None
        if cache.cuda_graphs is None and ids.device.type != "cuda":
            return None  # auto: graphs on CUDA devices only
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] != 1:
            return None
        if kwargs.get("inputs_embeds") is not None:
            return None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return None
        seq = -1
        for layer in cache.layers:
            if not isinstance(layer, KVQuantLayer) or layer.storage is None:
                return None
            if seq not in (-1, layer.seq_len):
                return None
            if layer.wants_first_tokens():
                return None  # k-transform: first tokens still arriving (eager steps keep them)
            seq = layer.seq_len
        if seq <= 0 or not self._on_one_device(cache, ids.device):
            return None
        return cache

    def _on_one_device(self, cache: KVQuantCache, device: torch.device) -> bool:
        """Whether the cache's steps can run as one static step on ``device`` (checked once per
        cache); if not, ``cuda_graphs=None`` decodes it eagerly from now on (logged once), as it
        does under tensor parallelism.

        Raises:
            BackendError: ``cuda_graphs=True`` and they cannot.
        """
        if cache.on_one_device:
            return True
        reason = one_device_reason(self.model, cache, device)
        state = getattr(self.model, "_kvquant_state", None)
        sharded = getattr(state, "rank_specs", None) is not None
        if reason is None and cache.cuda_graphs is None and sharded:
            reason = (
                "under tensor parallelism the default decodes eagerly (a captured step with the "
                "ranks' collectives is untested; pass cuda_graphs=True to capture it)"
            )
        if reason is None:
            cache.on_one_device = True
            return True
        if cache.cuda_graphs:
            raise BackendError(
                f"kvquant: cuda_graphs=True, but the kvquant cache of {type(self.model).__name__} "
                f"cannot decode in a CUDA graph: {reason}. Nothing was written. Fix: "
                "kvquant.patch(model, cuda_graphs=None) (such a model decodes eagerly)."
            )
        cache.cuda_graphs = False
        if not self._logged_devices:
            self._logged_devices = True
            _logger.info("kvquant: decode steps run eagerly (no CUDA graph): %s.", reason)
        return False

    # ------------------------------------------------------------------ running

    def _compiling(self, device: torch.device) -> bool:
        """Whether this step runs the compiled layers (see ``compile_step``)."""
        if self._compile_off:
            return False
        if self.compile_step:
            return True
        if device not in self._unusable:
            self._unusable[device] = compile_unusable_reason(device)
        return self._unusable[device] is None

    def _step(self, cache: KVQuantCache, kwargs: dict[str, Any]) -> Any:
        try:
            return self._try_step(cache, kwargs)
        except _CompileFailure as fail:
            # The forward raised, so kvquant.patch's rollback hook put the cache back where
            # the step began: run the whole step again, eagerly.
            self._compile_failed(fail)
            return self._try_step(cache, kwargs)

    def _try_step(self, cache: KVQuantCache, kwargs: dict[str, Any]) -> Any:
        layers = cast(list[KVQuantLayer], cache.layers)  # checked by _eligible
        key = _signature(kwargs)
        device = kwargs["input_ids"].device
        seq = layers[0].seq_len
        starts = (
            None
            if key is None
            else step_left_padding_starts(cache, kwargs.get("attention_mask"), seq + 1, device)
        )
        if key is None or starts is None:
            self.stats.ordinary += 1
            return self.original(**kwargs)
        rec = cache.decode_graph
        if not isinstance(rec, DecodeGraph) or rec.key != key:
            cache.ensure_decode_headroom(seq + 1)  # grows (if it must) before the capture
        cache.reserve_through(seq + 1, layers[0])  # a full cache raises before any write
        rec = cache.decode_graph
        if not isinstance(rec, DecodeGraph) or rec.key != key:
            rec = self._build(cache, kwargs, key, device)
            cache.decode_graph = rec
        cache.book.load_static(rec.static, seq, starts)
        for name, buf in rec.inputs.items():
            buf.copy_(kwargs[name])
        compiled = self._compiling(device)
        if device.type == "cuda":
            if rec.graph is None:
                try:
                    self._capture(cache, rec, compiled)
                except BackendError as err:
                    if cache.cuda_graphs is not None:
                        raise
                    return self._fall_back(cache, layers, kwargs, err)
            rec.graph.replay()
            out = _copy_output(rec.output, cache)
            self.stats.replays += 1
        else:
            if not self._logged_cpu:
                self._logged_cpu = True
                _logger.info(
                    "kvquant: cuda_graphs=True on a %s model: decode steps run eagerly through "
                    "the static step buffers (CUDA graphs need a CUDA device).",
                    device.type,
                )
            out = self._run(cache, rec, compiled)
            self.stats.static_eager += 1
        cache.book.advance_all(1)
        return out

    def _fall_back(
        self,
        cache: KVQuantCache,
        layers: list[KVQuantLayer],
        kwargs: dict[str, Any],
        err: BackendError,
    ) -> Any:
        """Auto mode, failed capture: decode this cache eagerly from now on (logged once)."""
        cache.cuda_graphs = False
        cache.decode_graph = None
        if not self._logged_fallback:
            self._logged_fallback = True
            _logger.warning(
                "%s Decoding eagerly instead (cuda_graphs=None falls back; pass "
                "cuda_graphs=False to skip the capture, or True to make this an error).",
                err,
            )
        self.stats.fallbacks += 1
        self.stats.ordinary += 1
        return self.original(**kwargs)

    def _compile_failed(self, fail: _CompileFailure) -> None:
        """A compiled step failed: raise (``compile_step=True``) or run eager steps from now on."""
        name = type(self.model).__name__
        if self.compile_step:
            raise BackendError(
                f"kvquant: the compiled decode step of {name} failed ({fail}). The cache still "
                "holds the tokens it held. Fix: kvquant.patch(model, compile_step=False) (the "
                "decode graph then captures the eager step)."
            ) from fail.error
        self._compile_off = True
        self.stats.compile_fallbacks += 1
        _logger.warning(
            "kvquant: the compiled decode step of %s failed (%s); running the eager step instead "
            "(compile_step=None falls back; pass compile_step=False to skip the compile, or True "
            "to make this an error).",
            name,
            fail,
        )

    def _build(
        self,
        cache: KVQuantCache,
        kwargs: dict[str, Any],
        key: tuple[Any, ...],
        device: torch.device,
    ) -> DecodeGraph:
        static = cache.book.static_step(device)
        inputs = {
            name: torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for name, v in kwargs.items()
            if isinstance(v, torch.Tensor) and name != "attention_mask"
        }
        call = {**kwargs, **inputs, "attention_mask": None}
        cache_key = next(n for n in CACHE_KEYWORDS if call.get(n) is cache)
        for name in CACHE_KEYWORDS:
            call.pop(name, None)
        return DecodeGraph(
            key=key, static=static, inputs=inputs, call_kwargs=call, cache_key=cache_key
        )

    def _run(self, cache: KVQuantCache, rec: DecodeGraph, compiled: bool = False) -> Any:
        """The static step's forward, through the compiled layers when ``compiled``.

        Raises:
            _CompileFailure: the compiled forward raised anything but a kvquant
                error or an out-of-memory error (those are the step's own).
        """
        rec.static.derive(cache.page_size)
        cache.book.static = rec.static
        try:
            if not compiled or self.compiled is None:
                return rec.call(self.original, cache)
            self.stats.compiled_runs += 1
            try:
                with self.compiled.installed(cast(list[KVQuantLayer], cache.layers), rec.static):
                    return rec.call(self.original, cache)
            except (_CompileFailure, KVQuantError, torch.OutOfMemoryError):
                raise
            except Exception as err:
                raise _CompileFailure(err) from err
        finally:
            cache.book.static = None

    def _capture(self, cache: KVQuantCache, rec: DecodeGraph, compiled: bool) -> None:
        device = rec.static.pos.device
        stream = torch.cuda.current_stream(device)
        if (rec.key, compiled) not in self._warmed:
            side = _side_stream(device)
            side.wait_stream(stream)
            try:
                with torch.cuda.stream(side):
                    # Warm-up (compiles and loads every kernel, creates library handles): it
                    # writes this step's K/V, which the replay then writes again, identically.
                    # Later captures of the same signature (a new cache, a grown pool) skip it.
                    self._run(cache, rec, compiled)
            finally:
                stream.wait_stream(side)
        # A capture that fails leaves torch's CUDA generator in capture mode (every later
        # random op on the device raises) and the capture stream current: keep what to put back.
        gen = torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
        rng = gen.clone_state()
        graph = torch.cuda.CUDAGraph()
        try:
            with contextlib.ExitStack() as stack:
                if compiled:
                    # Nothing may compile inside the capture: a guard that fails there raises
                    # (and the eager step is captured instead) rather than recompiling.
                    stack.enter_context(torch.compiler.set_stance("fail_on_recompile"))
                stack.enter_context(torch.cuda.graph(graph))
                output = self._run(cache, rec, compiled)
        except Exception as err:
            torch.cuda.set_stream(stream)
            gen.graphsafe_set_state(rng)
            if isinstance(err, _CompileFailure):
                raise
            if compiled:  # retried with the eager step (compile_step=None) or raised
                raise _CompileFailure(err) from err
            raise BackendError(
                f"kvquant: capturing the decode step of {type(self.model).__name__} in a CUDA "
                f"graph failed ({type(err).__name__}: {err}). The cache still holds the tokens it "
                "held. "
                "Fix: kvquant.patch(model, cuda_graphs=False)."
            ) from err
        rec.graph, rec.output = graph, _without_cache(output, cache)
        self._warmed.add((rec.key, compiled))
        self.stats.captures += 1
