"""Batched prefill in row groups (``kvquant.patch``'s ``prefill_tokens``).

With ``prefill_tokens=N``, a forward whose ``input_ids`` is ``[B, L]`` with
``L > 1`` and ``B * L > N`` runs the model's forward on ``max(1, N // L)`` rows
at a time, each group writing its rows' K/V into the same kvquant cache (through
:meth:`~kvquant.cache.SequenceBook.row_window`), and returns the concatenated
logits: activations scale with ``N``, not with the batch. The pages of the whole
batch are reserved first; a group that raises leaves the cache as the call found
it. Every other call (decode steps, no kvquant cache, gradients, unknown
arguments, ...) runs whole. The wrapper is the model instance's ``forward``
attribute; the patch handle's ``remove()`` deletes it.

Design (exactness, which calls run whole, the seam): docs/dev/memory.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from transformers.utils import ModelOutput

from kvquant.cache import device_free_bytes
from kvquant.errors import UnsupportedModelError
from kvquant.integrations.hf.cache_layer import KVQuantCache, KVQuantLayer
from kvquant.integrations.hf.compat import CACHE_KEYWORDS
from kvquant.integrations.hf.marks import STATE_ATTR
from kvquant.integrations.hf.sharding import ranks_minimum

__all__ = ["AUTO_ACTIVATION_SHARE", "RowGroupForward", "RowGroupStats", "token_activation_bytes"]

AUTO_ACTIVATION_SHARE = 0.5
"""``prefill_tokens="auto"``: the share of the memory left after the call's KV pages that a
prefill forward's activations may take (the rest is margin for the estimate and fragmentation)."""

_BATCH_ARGS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids")
"""Tensor arguments whose first dimension is the batch: sliced per group."""

_SHARED_ARGS = ("cache_position", "logits_to_keep")
"""Tensor arguments every group takes as they are."""


@dataclass
class RowGroupStats:
    """What the wrapper did (for tests and benchmarks).

    Attributes:
        split_calls: forward calls run in row groups.
        whole_calls: forward calls passed on whole.
        groups: row groups run, over all split calls.
        last_rows: the rows of each group of the last split call, in order.
    """

    split_calls: int = 0
    whole_calls: int = 0
    groups: int = 0
    last_rows: list[int] = field(default_factory=list)


CachePreparer = Callable[[dict[str, Any]], tuple[str, KVQuantCache] | None]
"""Given a call's keyword arguments: ``(cache keyword, the kvquant cache the call will
use)``, creating or converting it as kvquant's decoder hook would, or None when the call
has no kvquant cache."""


class RowGroupForward:
    """The forward of a patched model that runs large batched prefills in row groups.

    See the module docstring.

    Args:
        model: the patched model.
        inner: the forward it wraps (the original bound forward, or the
            decode-graph runner).
        is_active: whether the patch that installed the wrapper is still applied.
        prefill_tokens: the most tokens (rows x query length) one forward
            processes; None: chosen per call from the device's free memory
            (:meth:`auto_tokens`; on CUDA devices only, elsewhere calls run whole).
        prepare_cache: finds the call's kvquant cache (:data:`CachePreparer`).
    """

    def __init__(
        self,
        model: nn.Module,
        inner: Callable[..., Any],
        is_active: Callable[[], bool],
        prefill_tokens: int | None,
        prepare_cache: CachePreparer,
    ) -> None:
        self.model = model
        self.inner = inner
        self.is_active = is_active
        self.prefill_tokens = None if prefill_tokens is None else int(prefill_tokens)
        self.prepare_cache = prepare_cache
        self.stats = RowGroupStats()
        # the wrapped forward's name, docstring and signature (generate inspects it); not
        # its __dict__, which would overwrite this wrapper's own attributes
        functools.update_wrapper(self, inner, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # torch.compile(model.forward): the whole call
            return self.inner(*args, **kwargs)
        lead = None if args else _lead(kwargs)
        found = None
        if lead is not None and self._splittable(lead, kwargs):
            # auto off a CUDA device: memory is not what bounds the call, it runs whole
            if self.prefill_tokens is not None or device_free_bytes(lead.device) is not None:
                found = self.prepare_cache(kwargs)
        if lead is None or found is None or not _cache_fits(found[1], lead):
            self.stats.whole_calls += 1
            return self.inner(*args, **kwargs)
        key, cache = found
        rows = self._rows_per_group(lead, cache, kwargs)
        if rows is None:
            self.stats.whole_calls += 1
            return self.inner(*args, **{**kwargs, key: cache})
        return self._run(kwargs, lead, key, cache, rows)

    # ------------------------------------------------------------------ deciding

    def _flag(self, kwargs: dict[str, Any], name: str) -> bool:
        value = kwargs.get(name)
        if value is None:
            value = getattr(self.model.config, name, False)
        return bool(value)

    def _splittable(self, lead: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether this call may run in row groups (a batched prefill the wrapper can split)."""
        if not self.is_active() or torch.is_grad_enabled() or self.model.training:
            return False
        bsz, length = int(lead.shape[0]), int(lead.shape[1])
        if bsz < 2 or length < 2:
            return False
        if self.prefill_tokens is not None and bsz * length <= self.prefill_tokens:
            return False
        return self._plain_arguments(lead, kwargs)

    def _rows_per_group(
        self, lead: torch.Tensor, cache: KVQuantCache, kwargs: dict[str, Any]
    ) -> int | None:
        """Rows per group when this call is split, else None (it runs whole)."""
        bsz, length = int(lead.shape[0]), int(lead.shape[1])
        tokens = self.prefill_tokens
        if tokens is None:
            tokens = self.auto_tokens(lead, cache, kwargs)
            if tokens is None or bsz * length <= tokens:
                return None
        return max(1, tokens // length)

    def auto_tokens(
        self, lead: torch.Tensor, cache: KVQuantCache, kwargs: dict[str, Any]
    ) -> int | None:
        """The automatic bound (``prefill_tokens="auto"``) for this call, or None off CUDA.

        The memory the device can still hand out, less the pages the cache must
        allocate for the call's tokens, is the room for activations;
        :data:`AUTO_ACTIVATION_SHARE` of it, divided by an estimate of one
        token's activations (:func:`token_activation_bytes`), is the bound. At
        least one row runs at a time. Under tensor parallelism the bound is the
        smallest of the ranks' (:func:`~kvquant.integrations.hf.sharding.ranks_minimum`).
        """
        free = device_free_bytes(lead.device)
        if free is None:
            return None
        bsz, length = int(lead.shape[0]), int(lead.shape[1])
        room = free - cache.bytes_to_hold(bsz, cache.get_seq_length() + length, lead.device)
        per_token = token_activation_bytes(self.model, kwargs)
        bound = max(length, int(max(0, room) * AUTO_ACTIVATION_SHARE) // per_token)
        state = getattr(self.model, STATE_ATTR, None)
        if state is not None and state.rank_specs is not None:
            # tensor parallelism: every rank runs the same groups (each group's collectives)
            bound = ranks_minimum(bound, state.sites, lead.device)
        return bound

    def _plain_arguments(self, lead: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether every argument of the call is one the wrapper knows how to split or share."""
        bsz = int(lead.shape[0])
        if self._flag(kwargs, "output_attentions") or self._flag(kwargs, "output_hidden_states"):
            return False
        if kwargs.get("labels") is not None or kwargs.get("return_dict") is False:
            return False
        config_dict = getattr(self.model.config, "return_dict", True)
        if kwargs.get("return_dict") is None and not config_dict:
            return False
        for name, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or name in _SHARED_ARGS:
                continue
            if name not in _BATCH_ARGS or value.dim() < 2:
                return False  # an argument whose batch layout is unknown
            if name == "attention_mask" and value.dim() != 2:
                return False  # a custom 4D mask: the ordinary forward applies or refuses it
            if value.shape[0] != bsz and not (name == "position_ids" and value.shape[0] == 1):
                return False
        return True

    # ------------------------------------------------------------------ running

    def _run(
        self, kwargs: dict[str, Any], lead: torch.Tensor, key: str, cache: KVQuantCache, rows: int
    ) -> Any:
        bsz, length = int(lead.shape[0]), int(lead.shape[1])
        book = cache.book
        start = cache.get_seq_length()
        start_lens = list(book.layer_lens)
        self.stats.split_calls += 1
        try:
            # The whole batch's pages, before the first group: every group then finds its
            # positions reserved, and a full cache raises before anything is written.
            cache.pool_shape(bsz, lead.device, first_tokens=length)
            cache.reserve_through(start + length, cast(KVQuantLayer, cache.layers[0]))
            joined = _Joined(cache, bsz, type(self.model).__name__)
            self.stats.last_rows = []
            for r0 in range(0, bsz, rows):
                r1 = min(bsz, r0 + rows)
                part = _rows_of(kwargs, r0, r1, bsz)
                part[key] = cache
                with book.row_window(r0, r1, start_lens):
                    joined.add(self.inner(**part), r0, r1)
                self.stats.groups += 1
                self.stats.last_rows.append(r1 - r0)
            return joined.output()
        except BaseException:
            # kvquant's rollback hook cropped a group that raised inside the model; the
            # groups before it stored their rows' positions: crop them too.
            cache.truncate(start)
            raise


def token_activation_bytes(model: nn.Module, kwargs: dict[str, Any]) -> int:
    """An upper estimate of the bytes one prompt token's activations take in a prefill forward.

    From the decoder's config: the residual stream and its norms, Q/K/V and the
    attention output, the MLP's gate, up and activated tensors (the largest of
    a dense or MoE layer), fp32 copies where models upcast (norms, RoPE), and
    the logits of every position when the call keeps them all (no
    ``logits_to_keep``). Twice the sum, for what the estimate does not see
    (the allocator's rounding, kernels' workspaces).
    """
    config = _read(model.config, "text_config") or model.config
    param = next(model.parameters(), None)
    width = param.element_size() if param is not None else 2
    hidden = _read(config, "hidden_size")
    heads = _read(config, "num_attention_heads")
    head_dim = _read(config, "head_dim") or (hidden // heads if heads else 0)
    kv_heads = _read(config, "num_key_value_heads") or heads
    names = ("intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner")
    inter = max(_read(config, name) for name in names) or 4 * hidden
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token = width * (6 * hidden + 3 * inter + 2 * (q + 2 * kv)) + 4 * (2 * hidden + q + kv)
    keep = kwargs.get("logits_to_keep")
    if keep is None or (isinstance(keep, int) and keep == 0):
        per_token += _read(config, "vocab_size") * (width + 4)
    return max(1, 2 * per_token)


def _read(config: Any, name: str) -> Any:
    """``config.<name>`` (an int, or the nested ``text_config``), 0 where absent or ambiguous.

    A config with per-layer attributes (Gemma 4's) refuses a global read of
    them with its own error; the largest layer value is then used.
    """
    try:
        value = getattr(config, name, 0)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, and the like
        layers = getattr(config, "per_layer_config", None) or []
        return max((_read(layer, name) for layer in layers), default=0)
    if name == "text_config":
        return value
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _cache_fits(cache: KVQuantCache, lead: torch.Tensor) -> bool:
    """Whether the cache can take the call's rows group by group.

    A cache that holds another batch size, or is inside a window or a static
    step, gets the whole call (whose ordinary path reports what is wrong).
    """
    book = cache.book
    return (
        book.batch_size in (0, int(lead.shape[0]))
        and book.window is None
        and book.static is None
        and len(cache.layers) > 0
    )


def _lead(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``input_ids`` ``[B, L]`` (or ``inputs_embeds`` ``[B, L, H]`` without ids), else None."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and embeds is None:
        return ids if ids.dim() == 2 else None
    if ids is None and isinstance(embeds, torch.Tensor):
        return embeds if embeds.dim() == 3 else None
    return None


def _rows_of(kwargs: dict[str, Any], r0: int, r1: int, bsz: int) -> dict[str, Any]:
    """The call's keyword arguments for rows ``r0 .. r1 - 1``."""
    part = dict(kwargs)
    for name in _BATCH_ARGS:
        value = part.get(name)
        if isinstance(value, torch.Tensor) and value.shape[0] == bsz:
            part[name] = value[r0:r1]
    return part


class _Joined:
    """The call's output, built group by group: logits ``[B, ...]`` filled in place, the cache.

    The groups' logits are copied into one tensor of the whole batch as they come (no
    second copy of every row's logits, as a concatenation at the end would hold), and
    every group's output is checked to carry nothing else.
    """

    def __init__(self, cache: KVQuantCache, batch: int, model_name: str) -> None:
        self.cache, self.batch, self.model_name = cache, batch, model_name
        self.kind: type | None = None
        self.names: list[str] = []
        self.logits: torch.Tensor | None = None

    def _refuse(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{self.model_name}: a prefill run in row groups (kvquant.patch(prefill_tokens=...)) "
            f"{what}; kvquant joins the groups' logits and their one cache only. Nothing was "
            "kept in the cache. Fix: kvquant.patch(model, prefill_tokens=None) for this model."
        )

    def add(self, out: Any, r0: int, r1: int) -> None:
        """Take the output of rows ``r0 .. r1 - 1``.

        Raises:
            UnsupportedModelError: the output is not a transformers ``ModelOutput``, or
                carries a field other than logits and the cache, or other fields than
                the first group's.
        """
        if not isinstance(out, ModelOutput):
            raise self._refuse(f"returned a {type(out).__name__}, not a ModelOutput")
        names = list(out.keys())
        if self.kind is None:
            self.kind, self.names = type(out), names
        elif type(out) is not self.kind or names != self.names:
            raise self._refuse("returned different output fields in different groups")
        for name in names:
            value = out[name]
            if name == "logits" and isinstance(value, torch.Tensor):
                if self.logits is None:
                    shape = (self.batch, *value.shape[1:])
                    self.logits = value.new_empty(shape)
                self.logits[r0:r1].copy_(value)
            elif name not in CACHE_KEYWORDS or value is not self.cache:
                raise self._refuse(f"returned the field {name!r}")

    def output(self) -> Any:
        """The joined output, of the groups' output class."""
        if self.kind is None:  # pragma: no cover - a split call runs at least two groups
            raise self._refuse("ran no group")
        fields = {n: self.logits if n == "logits" else self.cache for n in self.names}
        return self.kind(**fields)
