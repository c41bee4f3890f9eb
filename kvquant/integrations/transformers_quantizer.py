"""kvquant's transformers quantizer plugin: :class:`KVQuantConfig` and :class:`KVQuantizer`.

Importing this module registers both with transformers under ``"kvquant"``, so
that ``from_pretrained`` of a folder whose ``config.json`` says
``"quant_method": "kvquant"`` (what ``save_pretrained`` writes for a patched
model) loads it through kvquant. ``import kvquant`` arranges for that import
to happen as soon as transformers' quantizers are loaded (see
``kvquant/__init__.py``), which is why this module imports only transformers'
quantizer base classes at the top: it may run while transformers itself is
still being imported. Everything else is imported when a method runs, during
``from_pretrained``. Users reach these classes as :class:`kvquant.KVQuantConfig`
(documented in :mod:`kvquant.integrations.hf.quantizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from kvquant.checkpoint.files import folder_of_weight_files
from kvquant.errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    from kvquant.integrations.hf.patch import PatchOptions

__all__ = ["KVQuantConfig", "KVQuantizer", "register"]

_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


class KVQuantConfig(QuantizationConfigMixin):
    """transformers quantization config selecting kvquant's FP8 paged KV cache at load time.

    Args:
        scale_format: registry format name or ``"auto"``.
        missing_scales: ``"dynamic"``, ``"error"`` or ``"unit"``.
        group_size: ``G`` of the dynamic ``fp32-group`` format.
        missing_kv: a layer with only K or only V: ``"error"`` or ``"reuse"``.
        rope_policy: K calibrated before RoPE: ``"widen"`` or ``"keep"``.
        backend: kernel backend (``"auto"``, ``"triton"``, ``"torch"``).
        page_size: token slots per page.
        max_cache_tokens: token slots of each cache (whole batch), or None.
        num_pages: pages of each cache, or None.
        cuda_graphs: replay one-token decode steps from a CUDA graph: None
            (auto, on CUDA devices), True or False (see :func:`kvquant.patch`).
        compile_step: capture decode graphs from ``torch.compile``'d decoder
            layers: None (auto), True or False (see :func:`kvquant.patch`).
        prefill_tokens: the most tokens one prefill forward processes (larger
            batched prefills run in row groups): ``"auto"`` (from the free
            memory, on CUDA), an int, or None (no limit; see :func:`kvquant.patch`).
        **kwargs: ignored keys of a saved config (``quant_method``, ...).

    Example:
        >>> cfg = KVQuantConfig(scale_format="per-tensor")
        >>> cfg.to_dict()["quant_method"]
        'kvquant'
    """

    def __init__(
        self,
        scale_format: str = "auto",
        missing_scales: str = "dynamic",
        group_size: int | None = None,
        missing_kv: str = "error",
        rope_policy: str = "widen",
        backend: str = "auto",
        page_size: int = 16,
        max_cache_tokens: int | None = None,
        num_pages: int | None = None,
        cuda_graphs: bool | None = None,
        compile_step: bool | None = None,
        prefill_tokens: int | str | None = "auto",
        **kwargs: Any,
    ) -> None:
        self.quant_method = "kvquant"  # type: ignore[assignment]
        self.scale_format = scale_format
        self.missing_scales = missing_scales
        self.group_size = group_size
        self.missing_kv = missing_kv
        self.rope_policy = rope_policy
        self.backend = backend
        self.page_size = page_size
        self.max_cache_tokens = max_cache_tokens
        self.num_pages = num_pages
        self.cuda_graphs = cuda_graphs
        self.compile_step = compile_step
        self.prefill_tokens = prefill_tokens
        from kvquant.integrations.hf.patch import _check_options

        _check_options(self.options())

    def options(self, source: str = "") -> PatchOptions:
        """The equivalent :func:`kvquant.patch` options."""
        from kvquant.integrations.hf.patch import PatchOptions

        return PatchOptions(
            scale_format=self.scale_format,
            missing_scales=self.missing_scales,
            group_size=self.group_size,
            missing_kv=self.missing_kv,
            rope_policy=self.rope_policy,
            backend=self.backend,
            page_size=self.page_size,
            max_cache_tokens=self.max_cache_tokens,
            num_pages=self.num_pages,
            cuda_graphs=self.cuda_graphs,
            compile_step=self.compile_step,
            prefill_tokens=self.prefill_tokens,
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready config written to ``config.json`` by ``save_pretrained``."""
        return {
            "quant_method": "kvquant",
            "scale_format": self.scale_format,
            "missing_scales": self.missing_scales,
            "group_size": self.group_size,
            "missing_kv": self.missing_kv,
            "rope_policy": self.rope_policy,
            "backend": self.backend,
            "page_size": self.page_size,
            "max_cache_tokens": self.max_cache_tokens,
            "num_pages": self.num_pages,
            "cuda_graphs": self.cuda_graphs,
            "compile_step": self.compile_step,
            "prefill_tokens": self.prefill_tokens,
        }


class KVQuantizer(HfQuantizer):
    """The transformers quantizer behind :class:`KVQuantConfig` (loads KV scales, patches the model)."""

    requires_calibration = False

    def __init__(self, quantization_config: KVQuantConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._buffers: list[tuple[nn.Module, str]] = []
        self._folder: Path | None = None
        self._resolved: tuple[Any, ...] = ()

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: kvquant needs no extra package at load time."""
        return None

    def update_attn_implementation(self, config: Any) -> Any:
        """Leave the requested implementation: the model is switched after loading."""
        return config

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> nn.Module:
        """Read and resolve the checkpoint's KV scales, before any weight is loaded.

        The scales come from discovery on the checkpoint folder (the raw
        tensors as stored, exactly what ``kvquant doctor`` and
        :func:`kvquant.patch` read), never from the buffers transformers fills:
        those would hold integer scales cast to fp32. Everything that can refuse
        the checkpoint runs here, before the weights load (and before any
        ``.bin`` file is unpickled). The producer-named buffers registered here
        only receive the scale tensors so that none is reported UNEXPECTED; they
        are dropped after loading.
        """
        from kvquant.checkpoint.discovery import discover_scales
        from kvquant.integrations.hf.models import (
            check_supported,
            find_attention_sites,
            model_geometry,
        )
        from kvquant.integrations.hf.patch import checkpoint_scales, resolve

        check_supported(model)
        sites = find_attention_sites(model)
        geometry = model_geometry(model, sites)
        files = [Path(str(f)) for f in (checkpoint_files or [])]
        pickled = [f.name for f in files if f.suffix != ".safetensors"]
        if pickled and files[0].suffix == ".json":
            raise CheckpointError(
                f"transformers was given the file {files[0]} as the checkpoint's weights; "
                "expected the checkpoint folder. Fix: pass the folder "
                f"({files[0].parent}) to from_pretrained, not a file inside it."
            )
        if pickled:
            raise CheckpointError(
                f"{files[0].parent}: the checkpoint's weights are {pickled[:3]}; kvquant reads "
                "safetensors checkpoints only (it never unpickles .bin files). Fix: re-save the "
                "model with save_pretrained() (safetensors is the default)."
            )
        cfg: KVQuantConfig = self.quantization_config  # type: ignore[assignment]
        raw: list[Any] = []
        offsets: tuple[Any, ...] = ()
        ctx: dict[str, Any] = {}
        source = "from_pretrained (no checkpoint files)"
        if files:
            hint = getattr(model.config, "name_or_path", None) or getattr(
                model, "name_or_path", None
            )
            self._folder = folder_of_weight_files(files, hint)
            found = discover_scales(self._folder)
            raw, ctx = checkpoint_scales(found, geometry, str(self._folder), loaded_from=True)
            count = sum(found.weight_dtypes.get(d, 0) for d in _FP8_HEADER_DTYPES)
            if count:
                raise UnsupportedModelError(
                    f"the checkpoint stores {count} FP8 weight tensors; kvquant loads KV-cache "
                    "scales only and would load these weights without their weight scales. "
                    "Fix: use a checkpoint with bf16/fp16 weights and FP8 KV scales."
                )
            transform = ctx.get("k_transform", found.k_transform)
            offsets = transform.offsets if transform is not None else ()
            source = f"checkpoint {found.path}"
        opts = cfg.options(source)
        self._resolved = (opts, geometry, resolve(raw, geometry, opts, ctx), raw, ctx)
        for r in (*raw, *offsets):
            mod_path, _, attr = r.name.rpartition(".")
            mod = _find_module(model, mod_path)
            if mod is None:
                continue
            if attr not in mod._parameters and attr not in mod._buffers:
                # (compressed-tensors on 5.17 may have created it already)
                mod.register_buffer(
                    attr, torch.zeros(tuple(r.tensor.shape), dtype=torch.float32), persistent=True
                )
            self._buffers.append((mod, attr))
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Drop the loading-only buffers and patch the model with the scales resolved before loading."""
        from kvquant.integrations.hf.models import find_attention_sites
        from kvquant.integrations.hf.patch import apply_patch

        opts, geometry, model_scales, raw, ctx = self._resolved
        for mod, attr in self._buffers:
            mod._buffers.pop(attr, None)
            mod._parameters.pop(attr, None)
        self._buffers.clear()
        ctx = {**ctx, "quantizer": self}
        apply_patch(model, opts, find_attention_sites(model), geometry, model_scales, raw, ctx)
        return model

    def is_serializable(self, **kwargs: Any) -> bool:
        """kvquant models save their canonical scales and config."""
        return True

    @property
    def is_trainable(self) -> bool:
        """Not trainable: the FP8 cache is for inference."""
        return False


def _find_module(model: nn.Module, path: str) -> nn.Module | None:
    prefix = getattr(model, "base_model_prefix", "")
    candidates = [path]
    if prefix and path.startswith(prefix + "."):
        candidates.append(path[len(prefix) + 1 :])
    elif prefix:
        candidates.append(f"{prefix}.{path}")
    for cand in candidates:
        try:
            return model.get_submodule(cand)
        except AttributeError:
            continue
    return None


def register() -> None:
    """Register :class:`KVQuantConfig` and :class:`KVQuantizer` with transformers as ``"kvquant"``.

    Idempotent: a name already registered (this module imported again, or
    transformers' registry module reloaded and then registered again) is left as it is.
    """
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    if "kvquant" not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config("kvquant")(KVQuantConfig)
    if "kvquant" not in AUTO_QUANTIZER_MAPPING:
        register_quantizer("kvquant")(KVQuantizer)


register()
