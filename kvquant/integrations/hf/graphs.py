"""CUDA-graph decode steps for patched models (``kvquant.patch``'s ``cuda_graphs``).

At small and medium batch sizes ``generate`` is host bound: a decode step of
an eager transformers model launches hundreds of small kernels, each costing
more CPU time than GPU time. This module captures the whole one-token forward
of a patched model in one CUDA graph per cache, and replays it for every later
decode step.

How a step runs (:class:`DecodeGraphRunner`):

1. The step qualifies when it is a one-token forward of every sequence of a
   :class:`~kvquant.integrations.hf.cache_layer.KVQuantCache` that holds a
   prefix and has ``cuda_graphs`` on (``None``, the default, means: on a CUDA
   device), called with keyword arguments only,
   ``position_ids`` given, without gradients, and with a 2D attention mask
   that is pure left padding (checked on the device, one sync per step).
   Anything else (prefill, chunked prefill, ``inputs_embeds``, a custom mask,
   ``output_attentions``) runs the ordinary forward, with the same results.
2. The cache reserves the new token's pages on the host (a full cache raises
   :class:`~kvquant.errors.CacheCapacityError` before anything is written).
3. The step's inputs are copied into static buffers
   (:class:`~kvquant.integrations.hf.cache_layer.StaticStep` and one buffer per
   tensor argument); the first step of a cache warms the forward up on a side
   stream and captures it; every step then replays the graph. When the pool
   grows (a cache without a size bound enlarges its pages on demand) the
   page tensors move, and the next step captures again. With the default
   ``cuda_graphs=None`` a capture that fails is logged once and the cache
   decodes eagerly from then on; with ``cuda_graphs=True`` it raises.
4. The host-side counters of the cache layers advance, and the step returns a
   copy of the captured output (the next replay overwrites the static one).

Inside the step, the cache layers write to slots computed on the device from
the static position and the block table, and kvquant's attention reads the
static lengths, block table and left-padding starts; the model gets
``attention_mask=None`` (the padding is carried by the starts), so
transformers builds no mask. On a CPU model the same static step runs
eagerly, without a graph (logged once): it is how the CPU tests check the
step's bookkeeping.

The seam: transformers' ``generate`` calls the model's ``forward`` for each
step and offers no hook that can replace a step's computation (its own
``torch.compile`` path needs a cache that dynamo can trace). kvquant therefore
installs the runner as an attribute ``forward`` of the model instance,
wrapping the previous one (as accelerate's hooks do); the patch handle's
``remove()`` deletes it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kvquant.errors import BackendError
from kvquant.integrations.hf.cache_layer import KVQuantCache, KVQuantLayer, StaticStep

__all__ = ["DecodeGraph", "DecodeGraphRunner", "GraphStats", "left_padding_starts"]

_logger = logging.getLogger("kvquant")

_CACHE_KWARGS = ("cache", "past_key_values")
_SCALARS = (bool, int, float, str)


@dataclass
class DecodeGraph:
    """The captured decode step of one cache.

    Attributes:
        key: the call signature it was built for (tensor shapes, dtypes and
            devices, and the other arguments' values).
        static: the static step tensors.
        inputs: one static buffer per tensor argument, by keyword.
        call_kwargs: the keyword arguments the step passes to ``forward``.
        graph: the CUDA graph (None until captured; always None on CPU).
        output: the captured step's output (static tensors).
    """

    key: tuple[Any, ...]
    static: StaticStep
    inputs: dict[str, torch.Tensor]
    call_kwargs: dict[str, Any]
    graph: Any = None
    output: Any = None


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


def _signature(kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable key of a step's arguments (tensor shapes, dtypes, devices; other values).

    Strides are left out: the static buffers are contiguous and ``copy_`` takes any layout,
    so a view of a growing tensor (``ids[:, -1:]``) does not force a new capture.
    Returns None when an argument is neither a tensor nor a plain value.
    """
    key: list[Any] = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if name == "attention_mask" or name in _CACHE_KWARGS:
            continue
        if isinstance(value, torch.Tensor):
            key.append((name, tuple(value.shape), value.dtype, value.device))
        elif value is None or type(value) in _SCALARS:
            key.append((name, value))
        else:
            return None
    return tuple(key)


def _copy_output(out: Any) -> Any:
    """The step's output with every tensor cloned (the graph's own are overwritten next step)."""
    if isinstance(out, tuple):
        return type(out)(x.clone() if isinstance(x, torch.Tensor) else x for x in out)
    items = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    return type(out)(**items)


@dataclass
class GraphStats:
    """What the runner did (for tests and benchmarks).

    Attributes:
        captures: graphs captured.
        replays: decode steps served by a graph replay.
        static_eager: decode steps run through the static buffers without a graph (CPU).
        ordinary: calls passed to the ordinary forward.
        fallbacks: caches that fell back to eager decoding after a failed capture.
    """

    captures: int = 0
    replays: int = 0
    static_eager: int = 0
    ordinary: int = 0
    fallbacks: int = 0


class DecodeGraphRunner:
    """The forward of a patched model with CUDA-graph decode steps (see the module docstring).

    Args:
        model: the patched model.
        original: the forward it had before (bound).
        is_active: whether the patch that installed the runner is still applied.
    """

    def __init__(
        self, model: nn.Module, original: Callable[..., Any], is_active: Callable[[], bool]
    ) -> None:
        self.model = model
        self.original = original
        self.is_active = is_active
        self.stats = GraphStats()
        self._logged_cpu = False
        self._logged_fallback = False
        self._warmed: set[tuple[Any, ...]] = set()
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self._eligible(args, kwargs)
        if cache is None:
            self.stats.ordinary += 1
            return self.original(*args, **kwargs)
        return self._step(cache, kwargs)

    # ------------------------------------------------------------------ deciding

    def _eligible(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KVQuantCache | None:
        if args or torch.is_grad_enabled() or self.model.training or not self.is_active():
            return None
        cache = next((kwargs[n] for n in _CACHE_KWARGS if kwargs.get(n) is not None), None)
        if not isinstance(cache, KVQuantCache) or cache.cuda_graphs is False:
            return None
        if cache.static is not None or cache.allocator is None or not cache.attention_is_kvquant():
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
        return cache if seq > 0 else None

    # ------------------------------------------------------------------ running

    def _step(self, cache: KVQuantCache, kwargs: dict[str, Any]) -> Any:
        layers = cast(list[KVQuantLayer], cache.layers)  # checked by _eligible
        key = _signature(kwargs)
        device = kwargs["input_ids"].device
        seq = layers[0].seq_len
        starts = (
            None
            if key is None
            else left_padding_starts(
                kwargs.get("attention_mask"), cache.batch_size_, seq + 1, device
            )
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
        st = rec.static
        bt = cache.block_table(device)
        if bt.shape[1] != st.width:
            st.block_table[:, : bt.shape[1]].copy_(bt)
            st.width = bt.shape[1]
        st.pos.fill_(seq)
        st.kv_start.copy_(starts)
        for name, buf in rec.inputs.items():
            buf.copy_(kwargs[name])
        if device.type == "cuda":
            if rec.graph is None:
                try:
                    self._capture(cache, rec)
                except BackendError as err:
                    if cache.cuda_graphs is not None:
                        raise
                    return self._fall_back(cache, layers, kwargs, err)
            rec.graph.replay()
            out = _copy_output(rec.output)
            self.stats.replays += 1
        else:
            if not self._logged_cpu:
                self._logged_cpu = True
                _logger.info(
                    "kvquant: cuda_graphs=True on a %s model: decode steps run eagerly through "
                    "the static step buffers (CUDA graphs need a CUDA device).",
                    device.type,
                )
            out = self._run(cache, rec)
            self.stats.static_eager += 1
        for layer in layers:
            layer.seq_len += 1
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

    def _build(
        self,
        cache: KVQuantCache,
        kwargs: dict[str, Any],
        key: tuple[Any, ...],
        device: torch.device,
    ) -> DecodeGraph:
        static = StaticStep.allocate(cache.batch_size_, cache.pages_per_sequence(), device)
        inputs = {
            name: torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for name, v in kwargs.items()
            if isinstance(v, torch.Tensor) and name != "attention_mask"
        }
        call = {**kwargs, **inputs, "attention_mask": None}
        return DecodeGraph(key=key, static=static, inputs=inputs, call_kwargs=call)

    def _run(self, cache: KVQuantCache, rec: DecodeGraph) -> Any:
        rec.static.derive(cache.page_size)
        cache.static = rec.static
        try:
            return self.original(**rec.call_kwargs)
        finally:
            cache.static = None

    def _capture(self, cache: KVQuantCache, rec: DecodeGraph) -> None:
        device = rec.static.pos.device
        stream = torch.cuda.current_stream(device)
        if rec.key not in self._warmed:
            side = _side_stream(device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                # Warm-up (compiles and loads every kernel, creates library handles): it
                # writes this step's K/V, which the replay then writes again, identically.
                # Later captures of the same signature (a new cache, a grown pool) skip it.
                self._run(cache, rec)
            stream.wait_stream(side)
        # A capture that fails leaves torch's CUDA generator in capture mode (every later
        # random op on the device raises) and the capture stream current: keep what to put back.
        gen = torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
        rng = gen.clone_state()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                output = self._run(cache, rec)
        except Exception as err:
            torch.cuda.set_stream(stream)
            gen.graphsafe_set_state(rng)
            raise BackendError(
                f"kvquant: capturing the decode step of {type(self.model).__name__} in a CUDA "
                f"graph failed ({type(err).__name__}: {err}). The cache still holds the tokens it "
                "held. "
                "Fix: kvquant.patch(model, cuda_graphs=False)."
            ) from err
        rec.graph, rec.output = graph, output
        self._warmed.add(rec.key)
        self.stats.captures += 1
