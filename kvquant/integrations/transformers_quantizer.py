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

import contextvars
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from kvquant.checkpoint.files import folder_of_weight_files
from kvquant.errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    from kvquant.integrations.hf.config import PatchOptions

__all__ = ["KVQuantConfig", "KVQuantizer", "register"]

_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")

SET_ASIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("kvquant_set_aside", default=False)
"""True while :func:`kvquant.from_pretrained` loads a folder whose producer config it kept
from transformers (so transformers never warned about it)."""


class KVQuantConfig(QuantizationConfigMixin):
    """kvquant's options, for :func:`kvquant.patch` and for ``from_pretrained``.

    Pass it positionally to :func:`kvquant.patch` (``kvquant.patch(model,
    KVQuantConfig(page_size=32))``) or as ``quantization_config=`` to
    ``from_pretrained``; keyword options of ``kvquant.patch`` build one. Every
    value is checked when the config is built (and again when it is used:
    transformers' ``update()`` may change an attribute).

    Args:
        scale_format: registry format (``"auto"``, ``"per-tensor"``,
            ``"per-head"``, ``"fp32-group"``, ``"k-transform"`` or a registered
            name).
        missing_scales: what to do when no layer has a scale: ``"dynamic"``
            (fp32-group scales computed as tokens are written), ``"error"`` or
            ``"unit"``.
        group_size: ``G`` of the ``fp32-group`` format; default 64 capped at
            head_dim, halved until it divides head_dim.
        missing_kv: a layer with only a K or only a V scale: ``"error"``
            (default) or ``"reuse"`` (the one present serves both, noted).
        rope_policy: K scales calibrated before RoPE (Quark's default):
            ``"widen"`` (by sqrt(2), default) or ``"keep"``.
        backend: kernel backend: ``"auto"`` (Triton on CUDA, torch on CPU),
            ``"triton"`` or ``"torch"``.
        page_size: token slots per page, 1..4096 (16, 32 or 64 are typical).
        max_cache_tokens: a bound on the token slots of each cache, all
            sequences together (going beyond raises ``CacheCapacityError``).
            Default None: no bound; the pages grow on demand and hold memory in
            proportion to what is stored.
        num_pages: a fixed page count of each cache (overrides ``max_cache_tokens``).
        cuda_graphs: replay each one-token decode step from a CUDA graph, so
            the step's host cost drops to a few small copies. Default None
            (auto): on for models on a CUDA device, captured at the first decode
            step of each cache; a capture that fails is logged once and the
            model decodes eagerly. True: also on CPU (eagerly, through the
            graph's static buffers), and a failed capture raises. False: every
            step runs the eager forward.
        compile_step: capture the decode graph from ``torch.compile``'d decoder
            layers (fused normalisation, rotary and MLP kernels; kvquant's
            attention runs as two custom ops inside them), so a replay runs far
            fewer kernels. Default None (auto): on wherever a decode graph is
            captured on CUDA and inductor is usable; the first decode of a new
            batch size pays the compile; a compile that fails is logged once and
            the eager step is captured instead. True: every static step, also on
            CPU, and a failed compile raises. False: the graph captures the
            eager layers.
        prefill_tokens: the most tokens (rows x prompt length) one prefill
            forward processes: a larger batched prefill runs its rows in groups
            into the same cache, so its activations scale with this bound, not
            with the batch (logits equal the unsplit call's within rounding).
            Default ``"auto"``: on a CUDA device, chosen per call from the
            memory the device can still hand out (a call that fits runs whole);
            elsewhere calls run whole. None: no limit.
        kv_format: how the cache stores K and V (:class:`~kvquant.choices.KVFormat`):
            ``"fp8"`` (default: FP8 with the resolved scales), ``"nvfp4"`` or ``"mxfp4"``
            (4-bit, scales computed as tokens are written, no calibration), or
            ``"fp8-k-nvfp4-v"`` (FP8 K with the model's static K scales, NVFP4 V); or a
            per-layer map of these words, keyed by layer index (negative from the last
            layer) and ``"default"`` for the layers not listed, e.g. ``{0: "fp8", -1: "fp8",
            "default": "nvfp4"}`` (saved with string keys, as JSON holds them).
        k_rotation: ``"hadamard"``: rotate K by the Hadamard matrix before its dynamic
            ``fp32-group`` scales or its ``nvfp4`` / ``mxfp4`` blocks
            (:class:`~kvquant.choices.KRotation`; head_dim a power of two >= 16), the query
            alike: more accurate than plain groups at the same size, best with
            ``group_size=32``. Default None: K stored as computed. Refused with checkpoint
            (static) scales of FP8 layers and with ``fp8-k-nvfp4-v``.
        recent_tokens: how many of each sequence's newest tokens the attention reads at full
            precision, from a ring kept beside the pages (every format; 0..1024). Each token
            is still stored in the pages; the ring costs ``recent_tokens`` tokens per
            sequence and layer in the model's dtype. Default ``"auto"``: 16 (a quarter of
            the dynamic format's error, or less, for a decode step a few percent longer at
            most) in ``generate``'s cache; none under continuous batching, where every block
            would keep a ring (pass a count for one there). 0: none.
        **saved: keys of a saved config that are not options (``quant_method``).

    Raises:
        OptionError: a bad value (a ``KVQuantError`` and ``ValueError``).
        OptionTypeError: an unknown option name or a value of the wrong type
            (also a ``TypeError``).

    Example:
        >>> cfg = KVQuantConfig(page_size=32)
        >>> cfg.page_size, cfg.to_dict()["quant_method"]
        (32, 'kvquant')
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
        kv_format: str | Mapping[int | str, str] = "fp8",
        k_rotation: str | None = None,
        recent_tokens: int | str = "auto",
        **saved: Any,
    ) -> None:
        from kvquant.integrations.hf.config import (
            SAVED_KEYS,
            check_config_version,
            check_option_names,
            coerce_kv_format,
        )

        check_option_names({k for k in saved if k not in SAVED_KEYS}, "KVQuantConfig")
        check_config_version(saved, "KVQuantConfig")
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
        self.kv_format = coerce_kv_format(kv_format)
        self.k_rotation = k_rotation
        self.recent_tokens = recent_tokens
        self.options()  # checks every value

    def options(self, source: str = "") -> PatchOptions:
        """These options as the frozen value a patch keeps (``source``: where the scales came from).

        Checked again here: transformers' ``update()`` may have changed an attribute.
        """
        from kvquant.integrations.hf.config import OPTION_NAMES, PatchOptions, check_options

        opts = PatchOptions(**{name: getattr(self, name) for name in OPTION_NAMES}, source=source)
        check_options(opts)
        return opts

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready config written to ``config.json`` by ``save_pretrained`` (versioned:
        ``config_version``; a later kvquant reads it, an earlier one refuses it by name)."""
        from kvquant.choices import kv_format_json
        from kvquant.integrations.hf.config import CONFIG_VERSION, OPTION_NAMES

        options = {name: getattr(self, name) for name in OPTION_NAMES}
        options["kv_format"] = kv_format_json(options["kv_format"])
        return {"quant_method": "kvquant", "config_version": CONFIG_VERSION, **options}

    def __repr__(self) -> str:
        import inspect

        defaults = inspect.signature(KVQuantConfig.__init__).parameters
        changed = [
            f"{name}={value!r}"
            for name, value in self.to_dict().items()
            if name in defaults and value != defaults[name].default
        ]
        return f"KVQuantConfig({', '.join(changed)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVQuantConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as transformers' configs


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
        from kvquant.choices import layer_kv_formats
        from kvquant.integrations.hf.models import (
            check_supported,
            find_attention_sites,
            model_geometry,
        )
        from kvquant.integrations.hf.scale_source import checkpoint_scales, layer_specs, resolve

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
            _explain_unread_producer_config(found)
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
        layer_kv_formats(opts.kv_format, len(sites), "KVQuantConfig")  # before the weights load
        model_scales = resolve(raw, geometry, opts, ctx)
        if opts.k_rotation is not None:  # layers it does not fit: refused before the weights load
            layer_specs(
                sites, geometry, model_scales, opts.kv_format, opts.k_rotation, opts.recent_tokens
            )
        self._resolved = (opts, geometry, model_scales, raw, ctx)
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


def _explain_unread_producer_config(found: Any) -> None:
    """Say what transformers' "Unknown quantization type ... skip" warning meant, just before.

    A KV-only checkpoint whose ``config.json`` names a producer transformers has no
    quantizer for (ModelOpt) makes transformers warn that it skips "the quantization"
    and load with ``KVQuantConfig`` alone, which is right: the weights are not
    quantized, and kvquant reads the KV scales the producer's config describes.
    """
    from kvquant.checkpoint.producers import config_producer

    method = str((found.quantization_config or {}).get("quant_method", "")).lower()
    producer = config_producer(found.quantization_config)
    if not method or (producer is not None and producer.kvquant_config) or SET_ASIDE.get():
        return
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    except ImportError:  # pragma: no cover - moved in a later transformers
        return
    if method in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return
    logging.getLogger("kvquant").info(
        "kvquant: %s names a %s quantization_config, which transformers does not load (its "
        "'Unknown quantization type, got %s' warning); kvquant reads the KV-cache scales it "
        "describes, and the weights load as stored. kvquant.from_pretrained(path) loads this "
        "checkpoint without that warning.",
        found.path,
        method,
        method,
    )


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
