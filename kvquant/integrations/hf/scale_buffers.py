"""The canonical fp32 scales as buffers ``k_scale`` / ``v_scale`` of each attention module, and
the state-dict hook that loads a checkpoint's scales into them in any producer's shape."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvquant.errors import (
    ScaleFormatError,
)
from kvquant.integrations.hf.cache_layer import LayerSpec
from kvquant.integrations.hf.forward_wrappers import module_device
from kvquant.integrations.hf.marks import MISSING
from kvquant.integrations.hf.routing import PatchBound
from kvquant.integrations.hf.state import PatchState
from kvquant.schemes import Fp4Scales

__all__ = [
    "ScaleLoad",
    "install_scales",
]


# ---------------------------------------------------------------------- apply / undo


class _CanonicalStateDict:
    """A ``state_dict`` post-hook writing the canonical fp32 scales, whatever the buffers became.

    ``model.to(torch.float16)`` casts every floating buffer, so a 1e-10 scale
    would be saved as 0.0 and 0.0123 as its bf16 rounding; the saved scales are
    the exact canonical fp32 ones instead (on the buffer's device). An object,
    not a closure, so that a patched model pickles (``torch.save(model)``).
    """

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any
    ) -> None:
        for attr, value in _canonical_buffers(self.spec):
            key = prefix + attr
            if value is not None and key in state_dict:
                state_dict[key] = value.to(device=state_dict[key].device, dtype=torch.float32)


def _canonical_buffers(spec: LayerSpec) -> tuple[tuple[str, torch.Tensor | None], ...]:
    """The canonical tensors a patched attention module holds as buffers (and saves).

    A ``k-transform`` layer also holds its ``k_offset``: a model saved after the
    patch then carries the offsets, and discovery refuses the copy (offsets
    without ``kvquant_kv_transform.json``) instead of loading its K scales
    without the transform they were calibrated for.
    """
    out: tuple[tuple[str, torch.Tensor | None], ...] = (
        ("k_scale", spec.k_scale),
        ("v_scale", spec.v_scale),
    )
    if spec.k_offset is not None:
        out += (("k_offset", spec.k_offset),)
    return out


def _held_specs(state: PatchState) -> list[LayerSpec]:
    """The layers' specs as their attention modules hold (and save) scales: a 4-bit layer holds
    the FP8 scales the registry resolved for it (none where they are dynamic), not its storage's
    fixed NVFP4 global scale, so that a saved model resolves the same scales for every layer
    again, whatever format each layer stores (the saved config's ``kv_format`` says which). A
    4-bit layer with K in the k-transform's frame holds its offset too, as the k-transform's
    FP8 layers do (:func:`_canonical_buffers`)."""
    held = []
    for spec, ls in zip(state.layer_specs, state.model_scales.layers, strict=True):
        if issubclass(spec.scheme, Fp4Scales):
            k = None if ls.k is None else ls.k.detach().to("cpu", torch.float32)
            v = None if ls.v is None else ls.v.detach().to("cpu", torch.float32)
            offset = spec.k_offset if spec.scheme.transforms_keys else None
            spec = replace(spec, k_scale=k, v_scale=v, k_offset=offset)
        held.append(spec)
    return held


class ScaleLoad(PatchBound):
    """``load_state_dict`` pre-hook of the model: its kvquant scale buffers keep the patch's values.

    Every cache copies the scales the patch resolved (``LayerSpec``), not the
    buffers, so a state dict with other scale values would change the buffers
    (and ``model.k_scale``) but not the quantization. A state dict without the
    scale keys (the unpatched model's) gets the patch's own, so it loads
    without missing keys; one with the same values (any shape holding them, as
    ``state_dict()`` of the patched model) loads; other values are refused
    before anything is loaded (the hook runs before the first module loads).
    """

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        *rest: Any,
    ) -> None:
        if not self.active():
            return
        names = {id(m): n for n, m in module.named_modules()}
        for site, spec in zip(self.state.sites, _held_specs(self.state), strict=True):
            if id(site.module) not in names:
                continue
            for attr, value in _canonical_buffers(spec):
                buffer = site.module._buffers.get(attr)
                if value is None or buffer is None:
                    continue
                key = f"{prefix}{names[id(site.module)]}.{attr}"
                given = state_dict.get(key, value)
                if not (
                    isinstance(given, torch.Tensor)
                    and given.numel() == value.numel()
                    and torch.equal(
                        given.detach().to("cpu", torch.float32).reshape(value.shape), value
                    )
                ):
                    found = (
                        given.detach().flatten()[:4].tolist()
                        if isinstance(given, torch.Tensor)
                        else type(given).__name__
                    )
                    raise ScaleFormatError(
                        f"{self.state.model_name}.load_state_dict: {key} holds {found}, not the "
                        f"scale the kvquant patch resolved ({value.flatten()[:4].tolist()}); "
                        "kvquant's "
                        "caches use the resolved scales, so loading others into the buffers would "
                        "not change the quantization. Nothing was loaded. Fix: "
                        "kvquant.patch(model, scales=state_dict) first (it resolves the new "
                        "scales), then load_state_dict; or load the checkpoint with "
                        "kvquant.from_pretrained."
                    )
                loaded = value.to(device=buffer.device, dtype=buffer.dtype).clone()
                loaded._kvq_canonical = True  # type: ignore[attr-defined]  # kept by assign=True
                state_dict[key] = loaded


def install_scales(state: PatchState) -> None:
    """Install each layer's canonical scales as buffers of its attention module (undone through
    ``state.saved_attrs`` and ``state.handles``)."""
    for site, spec in zip(state.sites, _held_specs(state), strict=True):
        mod = site.module
        for attr, value in _canonical_buffers(spec):
            prev: Any = MISSING
            kind = "absent"
            if attr in mod._buffers:
                prev, kind = mod._buffers[attr], "buffer"
                del mod._buffers[attr]
            elif attr in mod._parameters:
                prev, kind = mod._parameters[attr], "param"
                del mod._parameters[attr]
            elif attr in mod.__dict__:
                prev, kind = mod.__dict__[attr], "attr"
                del mod.__dict__[attr]
            if value is None and kind == "absent":
                continue
            state.saved_attrs.append((mod, attr, prev, kind))
            if value is not None:
                device = module_device(mod)
                buf = value.to(device=device, dtype=torch.float32).clone()
                buf._kvq_canonical = True  # type: ignore[attr-defined]
                mod.register_buffer(attr, buf, persistent=True)
        if spec.k_scale is not None or spec.v_scale is not None:
            state.handles.append(mod.register_state_dict_post_hook(_CanonicalStateDict(spec)))
        if hasattr(mod, "kv_cache"):
            # compressed-tensors' own KV fake-quant hook (transformers 5.17): K/V would be
            # rounded twice. Keep its hook (it forwards to our cache), switch its quantization off.
            prev_flag = mod.__dict__.get("quantization_enabled", MISSING)
            state.saved_attrs.append((mod, "quantization_enabled", prev_flag, "attr"))
            mod.__dict__["quantization_enabled"] = False
