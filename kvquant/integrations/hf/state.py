"""The state a :func:`kvquant.patch` keeps on the model (``model._kvquant_state``)."""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from kvquant.integrations.hf.cache_layer import LayerSpec
from kvquant.integrations.hf.config import PatchOptions
from kvquant.integrations.hf.graphs import (
    DecodeGraphRunner,
)
from kvquant.integrations.hf.models import (
    AttentionSite,
)
from kvquant.integrations.hf.rowgroups import RowGroupForward
from kvquant.types import RawScale

__all__ = [
    "SCALE_ATTRS",
    "PatchState",
]


if TYPE_CHECKING:
    from kvquant.integrations.hf.patch import KVQuantHandle


SCALE_ATTRS = ("k_scale", "v_scale")


@dataclass
class PatchState:
    """Everything :func:`patch` changed on one model (kept on ``model._kvquant_state``).

    Attributes:
        options: the patch settings.
        sites: the attention modules.
        layer_specs: per layer, what the cache layer needs (scales, granularity).
        rank_specs: under tensor parallelism, this rank's share of ``layer_specs``
            (its KV heads and their scales: :mod:`~kvquant.integrations.hf.sharding`),
            which its caches hold; None otherwise.
        model_scales: the registry's resolved scales (with its report).
        raw_scales: the raw scales they came from (reused when re-patching).
        text_config: the decoder config (its ``_attn_implementation`` is switched).
        previous_attn: the attention implementation before the patch.
        model_name: for messages.
        handles: removable hook handles.
        saved_attrs: ``(module, name, previous value or MISSING, kind)`` to restore.
        graph_runner: the CUDA-graph decode runner installed as the model's
            ``forward`` (unless ``cuda_graphs=False``), else None.
        row_groups: the row-group prefill wrapper installed as the model's
            ``forward`` (around the graph runner, if any) when ``prefill_tokens``
            is set, else None.
        handle: the handle :func:`patch` returned.
        patch_id: identifies the patch; every :class:`KVQuantCache` it builds
            carries it, and a forward refuses a cache of another patch (another
            model, or this model before it was patched again with other options).
        running: ``{"thread": ident}`` while a thread runs a decoder forward of
            the model (a forward from another thread is refused).
    """

    options: PatchOptions
    sites: list[AttentionSite]
    layer_specs: list[LayerSpec]
    model_scales: Any
    raw_scales: list[RawScale]
    raw_context: dict[str, Any]
    text_config: Any
    previous_attn: str | None
    model_name: str
    rank_specs: list[LayerSpec] | None = None
    handles: list[RemovableHandle] = field(default_factory=list)
    saved_attrs: list[tuple[nn.Module, str, Any, str]] = field(default_factory=list)
    graph_runner: DecodeGraphRunner | None = None
    row_groups: RowGroupForward | None = None
    handle: KVQuantHandle | None = None
    patch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    running: dict[str, int] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> PatchState:
        """The state of ``copy.deepcopy(model)``: a patch of its own (new ``patch_id``, idle)."""
        copied = PatchState.__new__(PatchState)
        memo[id(self)] = copied
        for f in fields(self):
            setattr(copied, f.name, copy.deepcopy(getattr(self, f.name), memo))
        copied.patch_id = uuid.uuid4().hex
        copied.running = {}
        return copied
