"""Tensor parallelism (transformers' ``tp_plan``): each rank's cache layers hold its own KV heads.

transformers shards a layer's K/V projections by rows (a ``DTensor`` placed
``Shard(0)`` on a one-dimensional mesh), so rank ``r`` of ``W`` computes KV heads
``r * H / W`` to ``(r + 1) * H / W - 1``. :func:`rank_specs` gives each rank's
layer specs those heads: per-head scales and K-transform offsets sliced with
them, per-tensor scales and the rotation replicated; :func:`ranks_minimum` makes a
per-rank choice (the prefill's row groups) the same on every rank. Design: docs/dev/cache.md.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvquant.errors import UnsupportedModelError
from kvquant.integrations.hf.cache_layer import LayerSpec
from kvquant.integrations.hf.models import AttentionSite

__all__ = ["head_shard", "rank_specs", "ranks_minimum"]


def head_shard(module: nn.Module, name: str) -> tuple[int, int, int] | None:
    """``(rank, world, local rows)`` of an attention module's K projection split by rows.

    None when the projection is not a ``DTensor`` or is replicated (every rank
    holds every head).

    Raises:
        UnsupportedModelError: a placement kvquant cannot map onto heads.
    """
    weight = getattr(getattr(module, "k_proj", None), "weight", None)
    placements = getattr(weight, "placements", None)
    if weight is None or placements is None:
        return None
    mesh = weight.device_mesh
    shards = [p for p in placements if p.is_shard()]
    if not shards:
        return None
    if mesh.ndim != 1 or len(shards) != 1 or shards[0].dim != 0:
        raise UnsupportedModelError(
            f"{name}: the K projection is split as {tuple(placements)} over the mesh "
            f"{tuple(mesh.shape)}; kvquant's cache follows a split of the projection's rows "
            "(KV heads) over one mesh dimension, transformers' tp_plan 'colwise'. Fix: load "
            "with tp_plan='auto', or with device_map='auto' (whole layers per GPU)."
        )
    rows = int(weight.to_local().shape[0])
    return int(mesh.get_local_rank()), int(mesh.size()), rows


def _heads(t: torch.Tensor | None, heads: int, lo: int, n: int) -> torch.Tensor | None:
    """Rows ``lo .. lo + n - 1`` of a per-head tensor (``[H]`` or ``[H, D]``); others as they are."""
    if t is None or t.dim() == 0 or t.shape[0] != heads:
        return t
    return t[lo : lo + n]


def _rank_spec(spec: LayerSpec, rank: int, world: int, local_rows: int) -> LayerSpec:
    heads = spec.num_kv_heads
    n = heads // world
    if heads % world or local_rows != n * spec.head_dim:
        raise UnsupportedModelError(
            f"{spec.name}: tensor parallelism over {world} ranks, but the layer has {heads} KV "
            f"heads of {spec.head_dim} and this rank's K projection {local_rows} rows; kvquant "
            f"gives each rank whole KV heads ({world} must divide {heads}, as transformers' own "
            f"attention needs). Fix: run a number of processes that divides {heads} (torchrun's "
            "process count), or load with device_map='auto' (whole layers per GPU)."
        )
    lo = rank * n
    return dataclasses.replace(
        spec,
        num_kv_heads=n,
        k_scale=_heads(spec.k_scale, heads, lo, n),
        v_scale=_heads(spec.v_scale, heads, lo, n),
        k_offset=_heads(spec.k_offset, heads, lo, n),
    )


def rank_specs(sites: list[AttentionSite], specs: list[LayerSpec]) -> list[LayerSpec] | None:
    """This rank's share of ``specs`` under tensor parallelism; None without it.

    Raises:
        UnsupportedModelError: the KV heads cannot be split evenly over the ranks,
            or the K projections are split in a way kvquant does not follow.
    """
    out: list[LayerSpec] = []
    sharded = False
    for site, spec in zip(sites, specs, strict=True):
        shard = head_shard(site.module, site.name)
        if shard is None or shard[1] == 1:
            out.append(spec)
            continue
        sharded = True
        out.append(_rank_spec(spec, *shard))
    return out if sharded else None


def ranks_minimum(value: int, sites: list[AttentionSite], device: torch.device) -> int:
    """The smallest ``value`` over the ranks the K projections are split over (``value``
    without tensor parallelism).

    For a choice each rank makes from its own state (its free memory) that changes the
    collectives the forward runs: every rank must make the same one, and call this.
    """
    for site in sites:
        weight = getattr(getattr(site.module, "k_proj", None), "weight", None)
        if head_shard(site.module, site.name) is None or weight is None:
            continue
        mesh = weight.device_mesh
        where = device if device.type == mesh.device_type else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=where)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=mesh.get_group())
        return int(t.item())
    return value
