"""Load-time integration: ``from_pretrained(..., quantization_config=KVQuantConfig())``.

:class:`KVQuantConfig` and :class:`KVQuantizer` are registered with
transformers' quantizer plugin under ``"kvquant"``. During ``from_pretrained``:

* before the weights load, the quantizer runs discovery on the checkpoint
  folder and the registry on the raw scale tensors as stored (the same
  pipeline as ``kvquant doctor`` and :func:`kvquant.patch`, so the same
  decision, findings and scales); any refusal happens here, before a weight
  is read. It registers one buffer per KV-scale tensor **at the producer's
  own name and shape** (``self_attn.k_scale``, ``self_attn.k_proj.k_scale``,
  ``self_attn.k_proj.output_scale``, ``self_attn.kv_scale``, ...), so that no
  scale is reported UNEXPECTED; their loaded values are never used;
* after loading, those buffers are dropped and the model is patched exactly
  like :func:`kvquant.patch` (canonical ``k_scale`` / ``v_scale`` buffers,
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
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from kvquant.checkpoint.files import folder_named_by, folder_of_weight_files, locate_checkpoint
from kvquant.errors import CheckpointError, OptionTypeError, UnsupportedModelError
from kvquant.integrations.hf.models import check_supported, find_attention_sites, model_geometry
from kvquant.integrations.hf.patch import (
    PatchOptions,
    _check_geometry,
    _check_options,
    apply_patch,
    refuse_error_findings,
    resolve,
)

__all__ = ["KVQuantConfig", "KVQuantizer", "from_pretrained"]

_logger = logging.getLogger("kvquant")

_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


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
            batched prefills run in row groups), or None (see :func:`kvquant.patch`).
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
        prefill_tokens: int | None = None,
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
        _check_options(self.options())

    def options(self, source: str = "") -> PatchOptions:
        """The equivalent :func:`kvquant.patch` options."""
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


@_register_quantizer
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
            hint = getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None)
            self._folder = folder_of_weight_files(files, hint)
            found = discover_scales(self._folder)
            _check_geometry(found.geometry, geometry, str(self._folder))
            refuse_error_findings(found, str(self._folder))
            count = sum(found.weight_dtypes.get(d, 0) for d in _FP8_HEADER_DTYPES)
            if count:
                raise UnsupportedModelError(
                    f"the checkpoint stores {count} FP8 weight tensors; kvquant loads KV-cache "
                    "scales only and would load these weights without their weight scales. "
                    "Fix: use a checkpoint with bf16/fp16 weights and FP8 KV scales."
                )
            raw = list(found.scales)
            offsets = found.k_transform.offsets if found.k_transform is not None else ()
            ctx["discovered"] = found
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


_TRANSFORMERS_QUANTIZERS = ("compressed-tensors", "compressed_tensors", "quark")


_HUB_KWARGS = ("revision", "cache_dir", "subfolder", "token", "trust_remote_code", "code_revision")
"""``from_pretrained`` keywords that say where the files are: the config is read with them too."""


def from_pretrained(
    path: str | Path,
    *,
    quantization_config: KVQuantConfig | None = None,
    model_class: Any = None,
    **kwargs: Any,
) -> Any:
    """Load a causal LM from a checkpoint folder or a cached hub id with kvquant's FP8 KV cache.

    Like ``AutoModelForCausalLM.from_pretrained(path, quantization_config=KVQuantConfig())``,
    but also for KV-only checkpoints whose ``config.json`` names a quantizer
    transformers knows (compressed-tensors ``kv_cache_scheme``, Quark): their
    ``quantization_config`` is kept aside (discovery still reads it from the
    folder) so that transformers does not refuse the second config. A hub id is
    read from the local Hugging Face cache only (``local_files_only=True``):
    kvquant never downloads, and an id that is not cached is refused at once.

    Args:
        path: checkpoint folder, or a file inside it (``config.json``,
            ``model.safetensors``) for its folder, by the command line's rule;
            or a hub id in the local Hugging Face cache.
        quantization_config: kvquant settings (default ``KVQuantConfig()``).
        model_class: the transformers class to load with (default ``AutoModelForCausalLM``).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ``device_map``,
            ``revision``, ``cache_dir``, ...); the config is read with the same
            ``revision``, ``cache_dir`` and ``subfolder``.

    Returns:
        The loaded, patched model.

    Raises:
        OptionTypeError: ``path`` or ``quantization_config`` of the wrong type.
        CheckpointError: ``path`` is neither a checkpoint folder nor a hub id in
            the local cache.
        UnsupportedModelError: the checkpoint also quantizes weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(
            f"kvquant.from_pretrained: path is a {type(path).__name__}; expected a checkpoint "
            "folder (str or Path) or a hub id in the local Hugging Face cache."
        )
    if quantization_config is not None and not isinstance(quantization_config, KVQuantConfig):
        raise OptionTypeError(
            "kvquant.from_pretrained: quantization_config is a "
            f"{type(quantization_config).__name__}; expected a kvquant.KVQuantConfig (or None)."
        )
    cls = model_class or AutoModelForCausalLM
    qc = quantization_config or KVQuantConfig()
    path = folder_named_by(path)  # config.json or a shard names its folder, at every door
    locate_checkpoint(path, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"))
    if not os.path.lexists(str(path)):  # a hub id, found in the local cache: never download
        kwargs["local_files_only"] = True
    hub = {k: kwargs[k] for k in (*_HUB_KWARGS, "local_files_only") if k in kwargs}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(str(path), **hub)
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
