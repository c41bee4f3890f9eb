"""Load-time integration: ``from_pretrained(..., quantization_config=KVQuantConfig())``.

:class:`KVQuantConfig` and :class:`KVQuantizer` are registered with
transformers' quantizer plugin under ``"kvquant"``. During ``from_pretrained``:

* before the weights load, the quantizer reads the safetensors headers and
  registers one fp32 buffer per KV-scale tensor, **at the producer's own
  name and shape** (``self_attn.k_scale``, ``self_attn.k_proj.k_scale``,
  ``self_attn.k_proj.output_scale``, ``self_attn.kv_scale``, ...), so every
  scale loads and none is reported UNEXPECTED; no renaming is needed;
* after loading, those tensors go through discovery's name mapping and the
  registry (producer taken from the checkpoint's config), the temporary
  buffers are dropped and the model is patched exactly like
  :func:`kvquant.patch` (canonical ``k_scale`` / ``v_scale`` buffers,
  attention + mask functions, hooks).

``save_pretrained`` then writes the canonical scales and
``{"quant_method": "kvquant", ...}``; loading that folder again (with kvquant
imported) restores the same model.

Checkpoints whose ``config.json`` names a quantizer transformers knows
(compressed-tensors, Quark) cannot take a second ``quantization_config``:
:func:`from_pretrained` keeps their ``quantization_config`` aside (KV-only
checkpoints only) and loads them through kvquant.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from kvquant.errors import UnsupportedModelError
from kvquant.integrations.hf.models import check_supported, find_attention_sites, model_geometry
from kvquant.integrations.hf.patch import (
    PatchOptions,
    _check_options,
    apply_patch,
    refuse_error_findings,
    resolve,
)

__all__ = ["KVQuantConfig", "KVQuantizer", "from_pretrained"]

_logger = logging.getLogger("kvquant")

_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_HEADER_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def _register_config(cls: type) -> type:
    try:
        return register_quantization_config("kvquant")(cls)  # type: ignore[no-any-return]
    except ValueError:  # already registered (module reloaded)
        return cls


def _register_quantizer(cls: type) -> type:
    try:
        return register_quantizer("kvquant")(cls)  # type: ignore[no-any-return]
    except ValueError:
        return cls


@_register_config
class KVQuantConfig(QuantizationConfigMixin):
    """transformers quantization config selecting kvquant's FP8 paged KV cache at load time.

    Args:
        scale_format: registry format name or ``"auto"``.
        missing_scales: ``"dynamic"``, ``"error"`` or ``"unit"``.
        group_size: ``G`` of the dynamic ``fp32-group`` format.
        backend: kernel backend (``"auto"``, ``"triton"``, ``"torch"``).
        page_size: token slots per page.
        max_cache_tokens: token slots of each cache (whole batch), or None.
        num_pages: pages of each cache, or None.
        cuda_graphs: replay one-token decode steps from a CUDA graph: None
            (auto, on CUDA devices), True or False (see :func:`kvquant.patch`).
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
        backend: str = "auto",
        page_size: int = 16,
        max_cache_tokens: int | None = None,
        num_pages: int | None = None,
        cuda_graphs: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.quant_method = "kvquant"  # type: ignore[assignment]
        self.scale_format = scale_format
        self.missing_scales = missing_scales
        self.group_size = group_size
        self.backend = backend
        self.page_size = page_size
        self.max_cache_tokens = max_cache_tokens
        self.num_pages = num_pages
        self.cuda_graphs = cuda_graphs
        _check_options(self.options())

    def options(self, source: str = "") -> PatchOptions:
        """The equivalent :func:`kvquant.patch` options."""
        return PatchOptions(
            scale_format=self.scale_format,
            missing_scales=self.missing_scales,
            group_size=self.group_size,
            backend=self.backend,
            page_size=self.page_size,
            max_cache_tokens=self.max_cache_tokens,
            num_pages=self.num_pages,
            cuda_graphs=self.cuda_graphs,
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready config written to ``config.json`` by ``save_pretrained``."""
        return {
            "quant_method": "kvquant",
            "scale_format": self.scale_format,
            "missing_scales": self.missing_scales,
            "group_size": self.group_size,
            "backend": self.backend,
            "page_size": self.page_size,
            "max_cache_tokens": self.max_cache_tokens,
            "num_pages": self.num_pages,
            "cuda_graphs": self.cuda_graphs,
        }


def _header_scales(files: list[str]) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """KV-scale tensors ``{name: (shape, dtype)}`` and FP8 weight names, from safetensors headers."""
    from safetensors import safe_open

    from kvquant.registry.discovery import match_scale_name

    scales: dict[str, tuple[tuple[int, ...], str]] = {}
    fp8: list[str] = []
    for f in files:
        if not str(f).endswith(".safetensors"):
            continue
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                dtype = str(sl.get_dtype())
                if match_scale_name(name) is not None:
                    scales[name] = (tuple(int(x) for x in sl.get_shape()), dtype)
                elif dtype in _FP8_HEADER_DTYPES:
                    fp8.append(name)
    return scales, fp8


@_register_quantizer
class KVQuantizer(HfQuantizer):
    """The transformers quantizer behind :class:`KVQuantConfig` (loads KV scales, patches the model)."""

    requires_calibration = False

    def __init__(self, quantization_config: KVQuantConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._buffers: list[tuple[nn.Module, str, str, str]] = []
        self._folder: Path | None = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: kvquant needs no extra package at load time."""
        return None

    def update_attn_implementation(self, config: Any) -> Any:
        """Leave the requested implementation: the model is switched after loading."""
        return config

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> nn.Module:
        check_supported(model)
        sites = find_attention_sites(model)
        files = [str(f) for f in (checkpoint_files or [])]
        if files:
            self._folder = Path(files[0]).parent
        scales, fp8 = _header_scales(files)
        if fp8:
            raise UnsupportedModelError(
                f"the checkpoint stores {len(fp8)} FP8 weight tensors (e.g. {fp8[0]}); kvquant "
                "loads KV-cache scales only and would load these weights without their "
                "weight scales. Fix: use a checkpoint with bf16/fp16 weights and FP8 KV scales."
            )
        num_layers = len(sites)
        from kvquant.registry.discovery import match_scale_name

        for name, (shape, dtype) in sorted(scales.items()):
            hit = match_scale_name(name)
            if hit is None or hit[0] >= num_layers:
                continue
            mod_path, _, attr = name.rpartition(".")
            mod = _find_module(model, mod_path)
            if mod is None:
                continue
            if attr in mod._parameters or attr in mod._buffers:
                # compressed-tensors (5.17) may have created it already: keep theirs.
                self._buffers.append((mod, attr, name, dtype))
                continue
            mod.register_buffer(attr, torch.ones(shape, dtype=torch.float32), persistent=True)
            self._buffers.append((mod, attr, name, dtype))
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        from kvquant.registry.discovery import discover_scales, raw_scales_from_state_dict

        cfg: KVQuantConfig = self.quantization_config  # type: ignore[assignment]
        sites = find_attention_sites(model)
        geometry = model_geometry(model, sites)
        mapping: dict[str, torch.Tensor] = {}
        for mod, attr, name, dtype in self._buffers:
            t = getattr(mod, attr)
            mapping[name] = t.detach().cpu().to(_HEADER_DTYPES.get(dtype, torch.float32))
        producer = "kvquant" if self.pre_quantized else None
        qcfg = None
        ctx: dict[str, Any] = {}
        if self._folder is not None and (self._folder / "config.json").is_file():
            try:
                found = discover_scales(self._folder)
            except Exception:  # the folder is only a hint: the loaded tensors are the source
                found = None
            if found is not None:
                refuse_error_findings(found, str(self._folder))
                qcfg = found.quantization_config
                ctx["discovered"] = found
                if producer is None and found.producer != "none":
                    producer = found.producer
        raw = raw_scales_from_state_dict(mapping, producer=producer, quantization_config=qcfg)
        source = f"checkpoint {self._folder}" if self._folder else "from_pretrained"
        opts = cfg.options(source)
        model_scales = resolve(raw, geometry, opts, ctx)
        for mod, attr, _name, _dtype in self._buffers:
            mod._buffers.pop(attr, None)
            mod._parameters.pop(attr, None)
        self._buffers.clear()
        apply_patch(model, opts, sites, geometry, model_scales, raw, ctx)
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


_TRANSFORMERS_QUANTIZERS = ("compressed-tensors", "compressed_tensors", "quark")


def from_pretrained(
    path: str | Path,
    *,
    quantization_config: KVQuantConfig | None = None,
    model_class: Any = None,
    **kwargs: Any,
) -> Any:
    """Load a causal LM from a local checkpoint folder with kvquant's FP8 KV cache.

    Like ``AutoModelForCausalLM.from_pretrained(path, quantization_config=KVQuantConfig())``,
    but also for KV-only checkpoints whose ``config.json`` names a quantizer
    transformers knows (compressed-tensors ``kv_cache_scheme``, Quark): their
    ``quantization_config`` is kept aside (discovery still reads it from the
    folder) so that transformers does not refuse the second config.

    Args:
        path: checkpoint folder.
        quantization_config: kvquant settings (default ``KVQuantConfig()``).
        model_class: the transformers class to load with (default ``AutoModelForCausalLM``).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ``device_map``, ...).

    Returns:
        The loaded, patched model.

    Raises:
        UnsupportedModelError: the checkpoint also quantizes weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cls = model_class or AutoModelForCausalLM
    qc = quantization_config or KVQuantConfig()
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(str(path))
    producer_cfg = getattr(config, "quantization_config", None)
    if producer_cfg is not None and not isinstance(producer_cfg, KVQuantConfig):
        as_dict = producer_cfg if isinstance(producer_cfg, dict) else producer_cfg.to_dict()
        method = str(as_dict.get("quant_method", "")).lower()
        if method != "kvquant":
            if method in _TRANSFORMERS_QUANTIZERS or method == "modelopt":
                _check_kv_only(method, as_dict, path)
            del config.quantization_config
    return cls.from_pretrained(str(path), config=config, quantization_config=qc, **kwargs)


def _check_kv_only(method: str, qcfg: dict[str, Any], path: str | Path) -> None:
    weights = False
    if method.startswith("compressed"):
        weights = bool(qcfg.get("config_groups"))
    elif method == "modelopt":
        weights = qcfg.get("quant_algo") not in (None, "", "null")
    elif method == "quark":
        glob = qcfg.get("global_quant_config") or {}
        weights = bool(isinstance(glob, dict) and glob.get("weight"))
    if weights:
        raise UnsupportedModelError(
            f"{path}: its {method} quantization_config also quantizes the weights; kvquant loads "
            "KV-cache scales only and cannot load quantized weights. Fix: use a KV-only "
            "checkpoint (bf16/fp16 weights plus FP8 KV scales)."
        )
