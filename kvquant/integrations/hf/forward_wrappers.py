"""The wrappers around a patched model's forward: the decode-graph runner (CUDA graphs of the
compiled decoder layers) and the row-group prefill. Each is removed by ``handle.remove()``."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from kvquant.errors import (
    UnsupportedModelError,
)
from kvquant.integrations.hf.cache_layer import KVQuantCache
from kvquant.integrations.hf.compat import cache_argument
from kvquant.integrations.hf.graphs import (
    CompiledLayers,
    DecodeGraphRunner,
)
from kvquant.integrations.hf.marks import MISSING
from kvquant.integrations.hf.models import (
    decoder_layers,
)
from kvquant.integrations.hf.routing import (
    IsActive,
    PatchBound,
    kvquant_cache,
    plain_dynamic,
    prefill_length_hint,
    settle,
    wants_cache,
)
from kvquant.integrations.hf.rowgroups import RowGroupForward
from kvquant.integrations.hf.state import PatchState

__all__ = [
    "install_forward_wrappers",
    "module_device",
]


def _compiled_layers(model: nn.Module, state: PatchState) -> CompiledLayers | None:
    """The decoder layers for compiled decode steps, or None.

    None for ``compile_step=False``, and in auto mode where a layer's ``forward``
    is already wrapped (accelerate's device hooks, for instance).

    Raises:
        UnsupportedModelError: ``compile_step=True`` and a layer's ``forward`` is wrapped.
    """
    if state.options.compile_step is False:
        return None
    layers = decoder_layers(model)
    wrapped = [i for i, layer in enumerate(layers) if "forward" in layer.__dict__]
    if wrapped:
        if state.options.compile_step:
            raise UnsupportedModelError(
                f"{state.model_name}: decoder layers {wrapped[:4]} have an instance-level "
                "forward (a wrapper such as accelerate's device hooks) that compiling the "
                "layer class's forward would bypass. Fix: kvquant.patch(model, "
                "compile_step=False), or load the model on one device without offloading."
            )
        return None
    return CompiledLayers(layers, [site.module for site in state.sites])


def install_forward_wrappers(model: nn.Module, state: PatchState, graphs: bool) -> None:
    """Wrap the instance's ``forward`` (restored by ``remove()``), if any wrapper is on.

    The :class:`DecodeGraphRunner` (``graphs``) around the previous forward, and the
    :class:`~kvquant.integrations.hf.rowgroups.RowGroupForward` (``prefill_tokens``)
    around that: decode steps pass the row-group check at once, prefills the runner's.
    """
    tokens = state.options.prefill_tokens
    if not graphs and tokens is None:
        return
    bound = None if tokens is None or tokens == "auto" else int(cast(int, tokens))
    compiled = _compiled_layers(model, state) if graphs else None
    prev = model.__dict__.get("forward", MISSING)
    state.saved_attrs.append((model, "forward", prev, "attr"))
    active = IsActive(model, state)
    forward = model.forward
    if graphs:
        runner = DecodeGraphRunner(
            model, forward, active, compiled=compiled, compile_step=state.options.compile_step
        )
        state.graph_runner = runner
        forward = runner
    if tokens is not None:
        groups = RowGroupForward(model, forward, active, bound, _RowGroupCache(model, state))
        state.row_groups = groups
        forward = groups
    model.__dict__["forward"] = forward


class _RowGroupCache(PatchBound):
    """The :data:`~kvquant.integrations.hf.rowgroups.CachePreparer` of the model.

    The kvquant cache a call will use, made before the first row group so that
    every group shares it: the call's ``KVQuantCache`` (of this patch); a new one
    for no cache (when the call uses a cache); the user's empty ``DynamicCache``,
    converted in place (as the decoder hook would). None for anything else (the
    call then runs whole, and the decoder hook refuses or passes it).
    """

    def __call__(self, kwargs: dict[str, Any]) -> tuple[str, KVQuantCache] | None:
        state = self.state
        key, current = cache_argument(kwargs)
        if current is None and not wants_cache(kwargs, state.text_config):
            return None
        if not (
            current is None
            or (isinstance(current, KVQuantCache) and current.patch_id == state.patch_id)
            or (plain_dynamic(current) and current.get_seq_length() == 0)
        ):
            return None
        cache = kvquant_cache(current, self.model)
        # the decoder hook sets it too, but the groups' pages are reserved before it runs
        cache.length_hint = prefill_length_hint(kwargs)
        settle(cache)
        return key or state.raw_context.get("cache_kwarg", "cache"), cache


def module_device(mod: nn.Module) -> torch.device:
    """Where ``mod``'s scale buffers go: its weights' device, CPU for weights on ``meta``.

    accelerate's ``device_map`` offload leaves offloaded weights on ``meta`` and
    loads them for each forward; a buffer registered on ``meta`` would hold no
    data and ``save_pretrained`` could not write it. kvquant's attention reads
    its own copy of the scales (beside the pages), so a CPU buffer serves
    ``state_dict()`` and saving.
    """
    for p in mod.parameters():
        return torch.device("cpu") if p.device.type == "meta" else p.device
    return torch.device("cpu")
