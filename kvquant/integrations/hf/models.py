"""Which Hugging Face model families kvquant's attention path supports, and how to find their parts.

A family is identified by ``config.model_type``. Every supported family has a
decoder (``model.base_model``) with a ``layers`` list whose items carry a
``self_attn`` module with ``layer_idx``, ``head_dim`` and ``scaling``. The
table below records what each family needs from the kernels (logit softcap,
sliding-window layers); anything else gets :class:`~kvquant.errors.UnsupportedModelError`
naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from kvquant.errors import UnsupportedModelError
from kvquant.types import LayerGeometry

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttentionSite",
    "FamilySupport",
    "check_supported",
    "decoder_layers",
    "find_attention_sites",
    "model_geometry",
    "text_config",
]


@dataclass(frozen=True)
class FamilySupport:
    """What kvquant knows about one model family.

    Attributes:
        model_type: ``config.model_type``.
        features: the attention features the family uses (for the docs and messages).
    """

    model_type: str
    features: tuple[str, ...]


SUPPORTED_FAMILIES: dict[str, FamilySupport] = {
    f.model_type: f
    for f in (
        FamilySupport("llama", ("GQA", "RoPE")),
        FamilySupport("mistral", ("GQA", "RoPE", "sliding window (config.sliding_window)")),
        FamilySupport("qwen2", ("GQA", "RoPE", "optional sliding-window layers")),
        FamilySupport("qwen3", ("GQA", "RoPE", "q/k RMSNorm", "optional sliding-window layers")),
        FamilySupport("phi3", ("fused qkv_proj", "RoPE", "sliding window (config.sliding_window)")),
        FamilySupport("gemma2", ("GQA", "logit softcap", "alternating sliding-window layers")),
        FamilySupport("gemma3_text", ("GQA", "q/k RMSNorm", "alternating sliding-window layers")),
        FamilySupport("gemma", ("GQA / MQA", "RoPE")),
        FamilySupport("granite", ("GQA", "RoPE", "attention_multiplier as the softmax scale")),
        FamilySupport(
            "cohere2", ("GQA", "RoPE on sliding layers only", "interleaved sliding-window layers")
        ),
        FamilySupport("mixtral", ("GQA", "RoPE", "sparse MoE MLP", "sliding window")),
        FamilySupport("starcoder2", ("GQA", "RoPE", "biased projections", "sliding window")),
        FamilySupport("smollm3", ("GQA", "RoPE skipped on every no_rope_layer_interval-th layer")),
        FamilySupport("phi", ("partial rotary embedding", "biased projections")),
        FamilySupport("qwen3_moe", ("GQA", "RoPE", "q/k RMSNorm", "sparse MoE MLP")),
        FamilySupport("olmo2", ("GQA", "RoPE", "q/k RMSNorm over the whole projection")),
        FamilySupport("olmo3", ("GQA", "RoPE", "q/k RMSNorm", "interleaved sliding-window layers")),
        FamilySupport(
            "gemma4_text",
            (
                "per-layer head_dim and KV heads (global_head_dim, num_global_key_value_heads)",
                "K reused as V on full-attention layers (attention_k_eq_v)",
                "q/k/v RMSNorm",
                "alternating sliding-window layers",
                "KV sharing across layers (num_kv_shared_layers)",
            ),
        ),
        FamilySupport(
            "gpt_oss",
            ("GQA", "RoPE", "learned attention sinks", "alternating sliding-window layers", "MoE"),
        ),
    )
}
"""Supported families, keyed by ``config.model_type``."""

_KNOWN_UNSUPPORTED: dict[str, str] = {
    "gemma3": "the multimodal Gemma3ForConditionalGeneration (vision tower, bidirectional "
    "image-token masks); load the text-only Gemma3ForCausalLM instead",
    "gemma4": "the multimodal Gemma4ForConditionalGeneration (vision and audio towers, "
    "bidirectional image-token masks); load the text-only Gemma4ForCausalLM instead",
    "gpt_neox": "GPT-NeoX attention (the cache update passes no kwargs; not wired)",
    "llama4": "chunked attention and no-RoPE layers",
    "deepseek_v3": "multi-head latent attention (MLA)",
    "falcon_h1": "hybrid recurrent (Mamba) layers beside attention",
}


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a supported model.

    Attributes:
        name: dotted module path, e.g. ``model.layers.3.self_attn``.
        module: the attention module.
        layer_idx: its decoder layer index (``module.layer_idx``).
        kv_source: for a layer that attends over the K/V another layer produced
            (Gemma 4's KV sharing: ``is_kv_shared_layer``), that layer's index;
            else None.

    The sliding window and logit softcap of a layer reach the attention
    function as call keywords (``sliding_window=``, ``softcap=``), as they do
    for transformers' own attention functions.
    """

    name: str
    module: nn.Module
    layer_idx: int
    kv_source: int | None = None


def text_config(model: nn.Module) -> Any:
    """The decoder's text config of ``model`` (``config.get_text_config()`` when it exists)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no `config`: kvquant.patch expects a transformers "
            "PreTrainedModel. Fix: pass a model from AutoModelForCausalLM.from_pretrained(...)."
        )
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def check_supported(model: nn.Module) -> FamilySupport:
    """Return the family entry of ``model`` or raise naming the missing feature.

    Raises:
        UnsupportedModelError: the family is not in :data:`SUPPORTED_FAMILIES`, or
            its config asks for a feature the kernels lack (bidirectional attention).
    """
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    top_type = str(getattr(getattr(model, "config", None), "model_type", model_type))
    supported = ", ".join(sorted(SUPPORTED_FAMILIES))
    if top_type in _KNOWN_UNSUPPORTED or model_type not in SUPPORTED_FAMILIES:
        why = _KNOWN_UNSUPPORTED.get(top_type) or _KNOWN_UNSUPPORTED.get(str(model_type))
        missing = why or "a model family that kvquant's attention path has not been checked against"
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={top_type!r}) is not supported by kvquant: it needs "
            f"{missing}. Supported families: {supported}. Fix: use a supported family, or run "
            "this model without kvquant."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{type(model).__name__}: config.use_bidirectional_attention=True needs non-causal "
            "attention over the cache, which kvquant's kernels do not provide. Fix: load the "
            "model with use_bidirectional_attention=False."
        )
    return SUPPORTED_FAMILIES[str(model_type)]


def _decoder_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    base = getattr(model, "base_model", model)
    prefix = ""
    for name, mod in model.named_modules():
        if mod is base:
            prefix = name
            break
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__}: no decoder layer list at `{prefix or 'model'}.layers`; "
            "kvquant finds attention modules there. Fix: use a supported family."
        )
    return (prefix + "." if prefix else "") + "layers", list(layers)


def _int_attr(module: nn.Module, attr: str) -> int:
    value: Any = getattr(module, attr)
    return int(value)


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every decoder attention module of ``model``, in layer order.

    Raises:
        UnsupportedModelError: a layer has no ``self_attn``, or it lacks
            ``layer_idx`` / ``head_dim`` / ``scaling``, or it is not causal.
    """
    prefix, layers = _decoder_layers(model)
    sites: list[AttentionSite] = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        name = f"{prefix}.{i}.self_attn"
        if not isinstance(attn, nn.Module):
            raise UnsupportedModelError(
                f"{name} does not exist in {type(model).__name__}: kvquant expects every decoder "
                "layer to hold its attention as `self_attn`. Fix: use a supported family."
            )
        for attr in ("layer_idx", "head_dim", "scaling"):
            if not hasattr(attn, attr):
                raise UnsupportedModelError(
                    f"{name} ({type(attn).__name__}) has no `{attr}` attribute; kvquant needs it "
                    "to drive the paged kernels. Fix: use a supported family."
                )
        if not getattr(attn, "is_causal", True):
            raise UnsupportedModelError(
                f"{name} is not causal (is_causal=False); kvquant's cache attention is causal only."
            )
        sites.append(AttentionSite(name=name, module=attn, layer_idx=_int_attr(attn, "layer_idx")))
    for i, site in enumerate(sites):
        if site.layer_idx != i:
            raise UnsupportedModelError(
                f"{site.name} has layer_idx={site.layer_idx} but sits at position {i}; kvquant "
                "expects one cache layer per decoder layer in order."
            )
    return _with_kv_sources(sites)


def _with_kv_sources(sites: list[AttentionSite]) -> list[AttentionSite]:
    """Mark the layers that attend over another layer's K/V (Gemma 4's KV sharing).

    transformers' Gemma 4 gives a KV-shared layer (``is_kv_shared_layer``) the
    K/V that the last earlier layer of its ``layer_type`` returned from its cache
    update (that layer has ``store_full_length_kv``); the shared layer itself
    never updates the cache.

    Raises:
        UnsupportedModelError: a shared layer whose source layer cannot be found.
    """
    if not any(getattr(s.module, "is_kv_shared_layer", False) for s in sites):
        return sites
    out: list[AttentionSite] = []
    for site in sites:
        if not getattr(site.module, "is_kv_shared_layer", False):
            out.append(site)
            continue
        kind = getattr(site.module, "layer_type", None)
        sources = [
            s.layer_idx
            for s in sites[: site.layer_idx]
            if getattr(s.module, "store_full_length_kv", False)
            and not getattr(s.module, "is_kv_shared_layer", False)
            and getattr(s.module, "layer_type", None) == kind
        ]
        if len(sources) != 1:
            raise UnsupportedModelError(
                f"{site.name} reuses the K/V of an earlier layer (is_kv_shared_layer) but "
                f"{len(sources)} earlier layers of type {kind!r} store them "
                "(store_full_length_kv); kvquant expects exactly one. Fix: run this model "
                "without kvquant."
            )
        out.append(AttentionSite(site.name, site.module, site.layer_idx, kv_source=sources[0]))
    return out


def _layer_config(config: Any, layer: int) -> Any:
    """Layer ``layer``'s config: ``config.per_layer_config[layer]`` for a heterogeneous config.

    transformers' heterogeneous configs (``per_layer_config``, e.g. Gemma 4's
    ``global_head_dim``) refuse a model-wide read of a per-layer attribute.
    """
    if getattr(config, "is_heterogeneous", False):
        return config.per_layer_config[layer]
    return config


def model_geometry(model: nn.Module, sites: list[AttentionSite]) -> LayerGeometry:
    """The attention geometry of ``model`` (what the registry checks scale shapes against).

    head_dim comes from each attention module, KV heads from each layer's config,
    so a model whose layers differ (Gemma 4's full-attention layers) gets a
    per-layer geometry (:meth:`LayerGeometry.layer`).

    Raises:
        UnsupportedModelError: the layers disagree on the number of query heads, or a
            layer's KV heads do not divide its query heads.
    """
    config = text_config(model)
    heads: list[int] = []
    kv_heads: list[int] = []
    for site in sites:
        cfg = _layer_config(config, site.layer_idx)
        num_heads = int(cfg.num_attention_heads)
        num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv:
            raise UnsupportedModelError(
                f"{site.name}: {num_heads} query heads are not a multiple of {num_kv} KV heads; "
                "kvquant's kernels share each KV head among a whole group of query heads. "
                "Fix: run this model without kvquant."
            )
        heads.append(num_heads)
        kv_heads.append(num_kv)
    if len(set(heads)) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}: attention layers have different numbers of query heads "
            f"{sorted(set(heads))}; kvquant needs one query-head count for the whole model. "
            "Fix: run this model without kvquant."
        )
    head_dims = [_int_attr(s.module, "head_dim") for s in sites]
    return LayerGeometry.from_layers(heads[0], kv_heads, head_dims)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` in order (the modules that hold the attention sites).

    Raises:
        UnsupportedModelError: the decoder has no ``layers`` list.
    """
    return _decoder_layers(model)[1]
