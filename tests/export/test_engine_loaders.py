"""``kvquant export`` output, loaded by vLLM's and SGLang's own KV-scale loading code.

The engines' code is taken from their pinned releases at test time
(``tests/engine_sources.py``: vLLM 0.33.0's sdist, SGLang 0.5.23's wheel, fetched
from PyPI once and cached); nothing of it is kept in the repository. What runs is
theirs, unchanged; what the test supplies is the skeleton around it:

* vLLM: the checkpoint's scale tensors go through ``AutoWeightsLoader`` (nested
  as in ``LlamaForCausalLM`` -> ``LlamaModel``, with the quant config's
  ``get_cache_scale_mapper`` / ``get_checkpoint_weight_mapper`` and
  ``LlamaModel.hf_to_vllm_mapper``) into attention layers initialised by
  ``set_default_quant_scales`` and the KV cache method's ``create_weights``
  (``CompressedTensorsKVCacheMethod`` after its ``validate_kv_cache_scheme``, or
  ``ModelOptKVCacheMethod``), its weight loaders (the per-head ``_tp_aware_loader``
  at each rank of a tensor-parallel split), then ``process_weights_after_loading``.
  ``maybe_remap_kv_scale_name`` (the older helper most non-Llama models call) must
  reach the same parameters.
* SGLang: ``LlamaForCausalLM._legacy_load_weights`` (its default path, with
  ``maybe_remap_kv_scale_name`` and ``default_weight_loader``) into
  ``RadixAttention``-like layers set up by ``CompressedTensorsKVCacheMethod`` (after
  its ``is_supported_scheme``) or ``ModelOptFp8KVCacheMethod``, then
  ``process_weights_after_loading``.

Stand-ins replace only the engines' heavy imports: the TP rank/size getters, the
platform (not FP8-fnuz), logging (recorded: a scale the engine drops is a warning
there, a failure here), the stage/embedding classes the loader skips. Which KV
cache method a config selects is the test's reading of the engines' config
classes (compressed-tensors ``quant_method`` -> the compressed-tensors method;
ModelOpt's ``hf_quant_config.json`` with ``kv_cache_quant_algo: FP8`` -> the
ModelOpt one).

The scales each engine ends up with (vLLM ``_k_scale`` / ``_v_scale`` and
``_k_scale_float``; SGLang ``k_scale`` and ``k_scale_float``) must equal
kvquant's canonical fp32 scales of the source checkpoint exactly (reduced with
max where the export is per-tensor; the rank's own KV heads under TP). The
sources carry fresh random scales every run (the seed is in the messages).

Without network access and no cached sources the tests skip, saying so;
``KVQUANT_REQUIRE_ENGINE_SOURCES=1`` (set by ``.ci/run``) turns that into a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, TypeAlias

import pytest
import regex
import safetensors
import torch
from engine_sources import (
    SGLANG,
    VLLM,
    EngineSourceUnavailable,
    Release,
    class_members,
    fetch,
    is_cached,
    load,
    module,
)
from engine_sources import namespace as engine_namespace
from torch import nn

from kvquant.checkpoint.discovery import discover_scales
from kvquant.errors import ExportError
from kvquant.export import export_checkpoint
from kvquant.registry.resolve import resolve_scales
from kvquant.testing.checkpoints import write_checkpoint

NUM_LAYERS = 2
NUM_HEADS = 16
NUM_KV_HEADS = 8
HEAD_DIM = 16
REQUIRE_ENV = "KVQUANT_REQUIRE_ENGINE_SOURCES"

# KV-only sources (weights="none"): every producer convention kvquant reads.
SOURCES: dict[str, dict[str, Any]] = {
    "ct": {"convention": "compressed-tensors"},
    "ct-head": {"convention": "compressed-tensors", "granularity": "per-head"},
    "modelopt": {"convention": "modelopt"},
    "quark": {"convention": "quark"},
    "quark-post": {"convention": "quark", "post_rope": True},
    "quark-fp8": {"convention": "quark-fp8"},
    "legacy": {"convention": "legacy-kv_scale"},
}


def _folder(release: Release, pytestconfig: pytest.Config) -> Path:
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if not is_cached(release) and reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(
                f"{release.spec}: fetching {release.filename} ({release.size / 1e6:.0f} MB) "
                f"from PyPI for its loader sources (kept: {release.folder()}); pre-fetch "
                "with: python tests/engine_sources.py"
            )
    try:
        return fetch(release, quiet=True)
    except EngineSourceUnavailable as exc:
        message = f"{release.spec} loader sources unavailable (PyPI unreachable?): {exc}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires them")
        pytest.skip(message)


# ---------------------------------------------------------------------------
# stand-ins for the engines' heavy imports


class _Log:
    """A logger that records what the engine code says."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []

    def _record(self, level: str, msg: object, *args: object, **_: object) -> None:
        text = str(msg) % args if args else str(msg)
        self.records.append((level, text))

    def clear(self) -> None:
        self.records.clear()

    def warnings(self) -> list[str]:
        return [text for level, text in self.records if level in ("warning", "error")]

    def debug(self, msg: object, *args: object, **kw: object) -> None:
        self._record("debug", msg, *args, **kw)

    def info(self, msg: object, *args: object, **kw: object) -> None:
        self._record("info", msg, *args, **kw)

    def warning(self, msg: object, *args: object, **kw: object) -> None:
        self._record("warning", msg, *args, **kw)

    def error(self, msg: object, *args: object, **kw: object) -> None:
        self._record("error", msg, *args, **kw)

    debug_once = debug
    info_once = info
    warning_once = warning


@dataclass
class _TP:
    rank: int = 0
    size: int = 1


class _QuantizeMethodBase:
    """The engines' abstract base of quant methods (nothing of it runs here)."""


class _NotHere(nn.Module):
    """A module class the loader tests ``isinstance`` against; no such module exists here."""


class _Strategy(str, Enum):
    """compressed-tensors' ``QuantizationStrategy`` values (the real enum where installed)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    TOKEN = "token"
    TENSOR_GROUP = "tensor_group"
    ATTN_HEAD = "attn_head"


def _quantization_strategy() -> type[Enum]:
    try:
        from compressed_tensors.quantization import QuantizationStrategy
    except ImportError:
        return _Strategy
    return QuantizationStrategy  # type: ignore[no-any-return]


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


# ---------------------------------------------------------------------------
# the engines' code


@dataclass
class _Vllm:
    log: _Log
    tp: _TP
    set_default_quant_scales: Callable[..., None]
    BaseKVCacheMethod: type
    CompressedTensorsKVCacheMethod: type
    ModelOptKVCacheMethod: type
    AutoWeightsLoader: type
    hf_to_vllm_mapper: Any
    get_cache_scale_mapper: Callable[[], Any]
    get_checkpoint_weight_mapper: Callable[[], Any]
    maybe_remap_kv_scale_name: Callable[[str, dict[str, Any]], str | None]


def _load_vllm(folder: Path) -> _Vllm:
    log, tp = _Log(), _TP()
    kvi = load(
        folder,
        "vllm/v1/kv_cache_interface.py",
        [
            "KVQuantMode",
            "get_kv_quant_mode",
            "is_quantized_kv_cache",
            "kv_cache_uses_per_token_head_scales",
        ],
        engine_namespace(
            {"IntEnum": IntEnum},
            # no out-of-tree KV cache dtype handler is registered in a plain install
            {
                "vllm.config.cache": module(
                    "vllm.config.cache", get_kv_cache_dtype_handler=lambda dtype: None
                )
            },
        ),
    )
    attention = load(
        folder,
        "vllm/model_executor/layers/attention/attention.py",
        ["set_default_quant_scales"],
        engine_namespace({"torch": torch, "nn": nn}),
    )
    weight_utils = load(
        folder,
        "vllm/model_executor/model_loader/weight_utils.py",
        ["default_weight_loader", "maybe_remap_kv_scale_name"],
        engine_namespace({"torch": torch, "logger": log}),
    )
    platform = SimpleNamespace(is_fp8_fnuz=lambda: False)
    kv_cache = load(
        folder,
        "vllm/model_executor/layers/quantization/kv_cache.py",
        ["KVCacheScaleParameter", "BaseKVCacheMethod"],
        engine_namespace(
            {
                "torch": torch,
                "logger": log,
                "QuantizationConfig": object,
                "QuantizeMethodBase": _QuantizeMethodBase,
                "is_weights_pre_processed": lambda: False,
                "current_platform": platform,
                "is_quantized_kv_cache": kvi["is_quantized_kv_cache"],
                "kv_cache_uses_per_token_head_scales": kvi["kv_cache_uses_per_token_head_scales"],
            }
        ),
    )
    base = kv_cache["BaseKVCacheMethod"]
    ct = load(
        folder,
        "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
        ["CompressedTensorsKVCacheMethod"],
        engine_namespace(
            {
                "torch": torch,
                "Any": Any,
                "Literal": Literal,
                "partial": partial,
                "BaseKVCacheMethod": base,
                "CompressedTensorsConfig": object,
                "QuantizationStrategy": _quantization_strategy(),
                "get_tensor_model_parallel_rank": lambda: tp.rank,
                "get_tensor_model_parallel_world_size": lambda: tp.size,
            }
        ),
    )
    modelopt = load(
        folder,
        "vllm/model_executor/layers/quantization/modelopt.py",
        ["ModelOptKVCacheMethod"],
        engine_namespace({"BaseKVCacheMethod": base}),
    )
    utils = load(
        folder,
        "vllm/model_executor/models/utils.py",
        [
            "ShardId",
            "ShardIds",
            "WeightsMapper",
            "_get_tied_embedding_params",
            "maybe_prefix",
            "StageMissingLayer",
            "PPMissingLayer",
            "AutoWeightsLoader",
        ],
        engine_namespace(
            {
                "itertools": itertools,
                "re": regex,
                "torch": torch,
                "nn": nn,
                "dataclass": dataclass,
                "field": field,
                "replace": replace,
                "Mapping": Mapping,
                "Iterable": Iterable,
                "Callable": Callable,
                "Any": Any,
                "Literal": Literal,
                "TypeAlias": TypeAlias,
                "logger": log,
                "default_weight_loader": weight_utils["default_weight_loader"],
                "VocabParallelEmbedding": _NotHere,
                "support_quantized_model_reload_from_hp_weights": _identity,
            }
        ),
    )
    mapper_module = module("vllm.model_executor.models.utils", WeightsMapper=utils["WeightsMapper"])
    base_config = load(
        folder,
        "vllm/model_executor/layers/quantization/base_config.py",
        [
            "QuantizationConfig.get_cache_scale_mapper",
            "QuantizationConfig.get_checkpoint_weight_mapper",
        ],
        engine_namespace({"re": regex}, {"vllm.model_executor.models.utils": mapper_module}),
    )
    llama = load(
        folder,
        "vllm/model_executor/models/llama.py",
        ["LlamaModel.hf_to_vllm_mapper"],
        engine_namespace({"WeightsMapper": utils["WeightsMapper"]}),
    )
    return _Vllm(
        log=log,
        tp=tp,
        set_default_quant_scales=attention["set_default_quant_scales"],
        BaseKVCacheMethod=base,
        CompressedTensorsKVCacheMethod=ct["CompressedTensorsKVCacheMethod"],
        ModelOptKVCacheMethod=modelopt["ModelOptKVCacheMethod"],
        AutoWeightsLoader=utils["AutoWeightsLoader"],
        hf_to_vllm_mapper=llama["LlamaModel.hf_to_vllm_mapper"],
        get_cache_scale_mapper=base_config["QuantizationConfig.get_cache_scale_mapper"],
        get_checkpoint_weight_mapper=base_config["QuantizationConfig.get_checkpoint_weight_mapper"],
        maybe_remap_kv_scale_name=weight_utils["maybe_remap_kv_scale_name"],
    )


@dataclass
class _Sglang:
    log: _Log
    BaseKVCacheMethod: type
    CompressedTensorsKVCacheMethod: type
    ModelOptFp8KVCacheMethod: type
    legacy_load_weights: Callable[[Any, Iterable[tuple[str, torch.Tensor]]], None]


def _load_sglang(folder: Path) -> _Sglang:
    log = _Log()
    common = load(
        folder,
        "sglang/srt/layers/utils/common.py",
        ["get_layer_id"],
        engine_namespace({"re": re}),
    )
    weight_utils = load(
        folder,
        "sglang/srt/model_loader/weight_utils.py",
        ["maybe_remap_kv_scale_name", "default_weight_loader"],
        engine_namespace(
            {"torch": torch, "Optional": typing.Optional, "logger": log}
            | {"print_warning_once": log.warning}
        ),
    )
    kv_cache = load(
        folder,
        "sglang/srt/layers/quantization/kv_cache.py",
        ["BaseKVCacheMethod"],
        engine_namespace(
            {
                "torch": torch,
                "logger": log,
                "is_fp8_fnuz": lambda: False,
                "QuantizationConfig": object,
                "QuantizeMethodBase": _QuantizeMethodBase,
            }
        ),
    )
    base = kv_cache["BaseKVCacheMethod"]
    ct = load(
        folder,
        "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py",
        ["CompressedTensorsKVCacheMethod"],
        engine_namespace({"BaseKVCacheMethod": base}),
    )
    modelopt = load(
        folder,
        "sglang/srt/layers/quantization/modelopt_quant.py",
        ["ModelOptFp8KVCacheMethod"],
        engine_namespace({"BaseKVCacheMethod": base, "ModelOptFp8Config": object}),
    )
    llama = load(
        folder,
        "sglang/srt/models/llama.py",
        ["LlamaForCausalLM._legacy_load_weights"],
        engine_namespace(
            {
                "torch": torch,
                "Iterable": Iterable,
                "Tuple": tuple,
                "logger": log,
                "get_layer_id": common["get_layer_id"],
                "maybe_remap_kv_scale_name": weight_utils["maybe_remap_kv_scale_name"],
                "default_weight_loader": weight_utils["default_weight_loader"],
            }
        ),
    )
    return _Sglang(
        log=log,
        BaseKVCacheMethod=base,
        CompressedTensorsKVCacheMethod=ct["CompressedTensorsKVCacheMethod"],
        ModelOptFp8KVCacheMethod=modelopt["ModelOptFp8KVCacheMethod"],
        legacy_load_weights=llama["LlamaForCausalLM._legacy_load_weights"],
    )


@pytest.fixture(scope="module")
def vllm(pytestconfig: pytest.Config) -> _Vllm:
    return _load_vllm(_folder(VLLM, pytestconfig))


@pytest.fixture(scope="module")
def sglang(pytestconfig: pytest.Config) -> _Sglang:
    return _load_sglang(_folder(SGLANG, pytestconfig))


# ---------------------------------------------------------------------------
# the exported checkpoint as the engines read it


@dataclass(frozen=True)
class _Exported:
    path: Path
    config: dict[str, Any]
    hf_quant_config: dict[str, Any] | None
    tensors: dict[str, torch.Tensor]

    @property
    def quantization_config(self) -> dict[str, Any]:
        return dict(self.config.get("quantization_config") or {})

    def kv_convention(self) -> str:
        """Which of the engines' quant configs serves this checkpoint's KV scales."""
        quant = (self.hf_quant_config or {}).get("quantization", {})
        if quant.get("kv_cache_quant_algo") == "FP8":
            return "modelopt"
        if self.quantization_config.get("quant_method") == "compressed-tensors":
            return "compressed-tensors"
        raise AssertionError(f"{self.path}: no KV quant config an engine would select")

    def scale_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors the engines' KV-scale mappers handle (the rest are model weights)."""
        suffixes = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")
        suffixes += ("k_zero_point", "v_zero_point", "q_zero_point")
        for name, tensor in self.tensors.items():
            if name.rsplit(".", 1)[-1] in suffixes or name.endswith(
                (".k_cache.scale", ".v_cache.scale")
            ):
                yield name, tensor.clone()


def _read_export(path: Path) -> _Exported:
    config = json.loads((path / "config.json").read_text())
    hf_quant = path / "hf_quant_config.json"
    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else [path / "model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return _Exported(
        path=path,
        config=config,
        hf_quant_config=json.loads(hf_quant.read_text()) if hf_quant.is_file() else None,
        tensors=tensors,
    )


def _random_source(root: Path, key: str, seed: int, **extra: Any) -> Path:
    """A source checkpoint with fresh random K/V scales in ``[0.005, 0.105)``."""
    options = {**SOURCES[key], **extra}
    gen = torch.Generator().manual_seed(seed)
    per_head = options.get("granularity") == "per-head"
    kinds = ("kv",) if options["convention"] == "legacy-kv_scale" else ("k", "v")
    scales: dict[tuple[int, str], float | torch.Tensor] = {}
    for layer, kind in itertools.product(range(NUM_LAYERS), kinds):
        if per_head:
            values = 0.005 + 0.1 * torch.rand(NUM_KV_HEADS, generator=gen)
            scales[(layer, kind)] = values.to(torch.bfloat16).reshape(NUM_KV_HEADS, 1, 1)
        else:
            scales[(layer, kind)] = float(0.005 + 0.1 * torch.rand((), generator=gen))
    options.setdefault("weights", "none")
    return write_checkpoint(
        root,
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        scales=scales,
        **options,
    )


def _canonical(src: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """kvquant's canonical fp32 (K, V) per layer of the source: ``[]`` or ``[Hkv]``."""
    found = discover_scales(src)
    scales = resolve_scales(found.scales, found.geometry, missing_scales="error")
    out = []
    for layer in scales.layers:
        assert layer.k is not None and layer.v is not None
        assert layer.k.dtype == torch.float32 and layer.v.dtype == torch.float32
        out.append((layer.k, layer.v))
    return out


def _expected(value: torch.Tensor, granularity: str) -> torch.Tensor:
    """What the export must carry: per-tensor takes the max over heads, per-head broadcasts."""
    if granularity == "per-tensor":
        return value.amax().reshape(())
    return value.expand(NUM_KV_HEADS).clone() if value.dim() == 0 else value


def _rank_heads(rank: int, tp_size: int) -> list[int]:
    """The KV heads of ``rank``: contiguous blocks, or one replicated head when TP > Hkv."""
    if tp_size <= NUM_KV_HEADS:
        per_rank = NUM_KV_HEADS // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (tp_size // NUM_KV_HEADS)]


# ---------------------------------------------------------------------------
# vLLM


class _VllmAttention(nn.Module):
    """vLLM's ``Attention`` as far as KV-cache quantization goes (``_init_kv_cache_quant``)."""

    def __init__(self, code: _Vllm, method: Any, num_kv_heads: int) -> None:
        super().__init__()
        self.kv_cache_dtype = "fp8"
        self.num_kv_heads = num_kv_heads
        code.set_default_quant_scales(self, register_buffer=True)
        self.quant_method = method
        method.create_weights(self)


class _VllmLlamaModel(nn.Module):
    def __init__(self, code: _Vllm, attentions: list[_VllmAttention]) -> None:
        super().__init__()
        self._code = code
        layers = []
        for attn in attentions:
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.attn = attn
            layers.append(layer)
        self.layers = nn.ModuleList(layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = self._code.AutoWeightsLoader(self)
        return set(loader.load_weights(weights, mapper=self._code.hf_to_vllm_mapper))


class _VllmLlamaForCausalLM(nn.Module):
    def __init__(self, code: _Vllm, quant_config: Any, attentions: list[_VllmAttention]) -> None:
        super().__init__()
        self._code = code
        self.quant_config = quant_config  # set by vLLM's SupportsQuant
        self.model = _VllmLlamaModel(code, attentions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set(self._code.AutoWeightsLoader(self).load_weights(weights))


def _vllm_method(code: _Vllm, exported: _Exported) -> Any:
    num_heads = exported.config["num_attention_heads"]
    num_kv_heads = exported.config["num_key_value_heads"]
    qc = SimpleNamespace(
        total_num_heads=num_heads,
        total_num_kv_heads=num_kv_heads,
        get_cache_scale_mapper=code.get_cache_scale_mapper,
        get_checkpoint_weight_mapper=code.get_checkpoint_weight_mapper,
        _ignore_unexpected_suffixes=[],
    )
    if exported.kv_convention() == "modelopt":
        return qc, (lambda: code.ModelOptKVCacheMethod(qc))
    qc.kv_cache_scheme = exported.quantization_config["kv_cache_scheme"]
    code.CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(qc.kv_cache_scheme)
    return qc, (lambda: code.CompressedTensorsKVCacheMethod(qc))


def _vllm_load(code: _Vllm, exported: _Exported, tp_rank: int, tp_size: int) -> list[Any]:
    """Load ``exported``'s scales as vLLM rank ``tp_rank`` of ``tp_size``; return its layers."""
    code.tp.rank, code.tp.size = tp_rank, tp_size
    code.log.clear()
    qc, make_method = _vllm_method(code, exported)
    local_kv_heads = max(1, NUM_KV_HEADS // tp_size)
    attentions = [_VllmAttention(code, make_method(), local_kv_heads) for _ in range(NUM_LAYERS)]
    model = _VllmLlamaForCausalLM(code, qc, attentions)
    params = dict(model.named_parameters())
    loaded = model.load_weights(exported.scale_weights())
    expected = {
        f"model.layers.{i}.self_attn.attn.{kind}_scale" for i in range(NUM_LAYERS) for kind in "kv"
    }
    assert loaded == expected, f"vLLM loaded {sorted(loaded)}, expected {sorted(expected)}"
    for name, _ in exported.scale_weights():
        remapped = code.maybe_remap_kv_scale_name(name, params)
        assert remapped in expected, f"maybe_remap_kv_scale_name({name!r}) -> {remapped!r}"
    for attn in attentions:
        attn.quant_method.process_weights_after_loading(attn)
    return attentions


_VLLM_Q_SCALE_NOTES = (
    "Checkpoint does not provide a q scaling factor",
    "Using uncalibrated q_scale",
)


def _vllm_warnings(code: _Vllm) -> list[str]:
    """vLLM's warnings, less those about q / prob scales (kvquant quantizes no queries)."""
    return [w for w in code.log.warnings() if not w.startswith(_VLLM_Q_SCALE_NOTES)]


VLLM_CASES = [(key, "per-tensor") for key in SOURCES] + [(key, "per-head") for key in SOURCES]


@pytest.mark.parametrize(("source", "granularity"), VLLM_CASES)
def test_vllm_loads_canonical_scales(
    vllm: _Vllm, tmp_path: Path, source: str, granularity: str
) -> None:
    seed = secrets.randbits(31)
    src = _random_source(tmp_path / "src", source, seed)
    out = tmp_path / "out"
    export_checkpoint(src, out, engine="vllm", granularity=granularity)
    exported = _read_export(out)
    canonical = _canonical(src)
    tp_sizes = (1, 2, 4, 16) if granularity == "per-head" else (1, 2)
    for tp_size in tp_sizes:
        for rank in range(tp_size):
            attentions = _vllm_load(vllm, exported, rank, tp_size)
            assert _vllm_warnings(vllm) == [], f"seed={seed}"
            for layer, (attn, (k, v)) in enumerate(zip(attentions, canonical, strict=True)):
                for kind, value in (("k", k), ("v", v)):
                    want = _expected(value, granularity)
                    if granularity == "per-head":
                        want = want[_rank_heads(rank, tp_size)]
                    got = getattr(attn, f"_{kind}_scale")
                    where = f"seed={seed} layer {layer} {kind} TP {rank}/{tp_size}"
                    assert got.dtype == torch.float32, where
                    assert torch.equal(got.reshape(-1), want.reshape(-1)), (where, got, want)
                    assert getattr(attn, f"_{kind}_scale_float") == float(want.max()), where


def test_vllm_modelopt_fp8_weights(vllm: _Vllm, tmp_path: Path) -> None:
    """A ModelOpt FP8-weight source stays ModelOpt; vLLM's ModelOpt KV method takes its scales."""
    seed = secrets.randbits(31)
    src = _random_source(
        tmp_path / "src", "modelopt", seed, weights="tiny-random", fp8_weights=True, shards=3
    )
    report = export_checkpoint(src, tmp_path / "out", engine="vllm")
    assert report.target_convention == "modelopt"
    exported = _read_export(tmp_path / "out")
    assert exported.kv_convention() == "modelopt"
    for rank in range(2):
        attentions = _vllm_load(vllm, exported, rank, 2)
        assert _vllm_warnings(vllm) == [], f"seed={seed}"
        for attn, (k, v) in zip(attentions, _canonical(src), strict=True):
            assert torch.equal(attn._k_scale, k.reshape(())), f"seed={seed}"
            assert torch.equal(attn._v_scale, v.reshape(())), f"seed={seed}"
            assert (attn._k_scale_float, attn._v_scale_float) == (float(k), float(v))


def test_vllm_per_head_needs_attn_head_scheme(vllm: _Vllm, tmp_path: Path) -> None:
    """Control: the per-tensor loader refuses per-head tensors, so the scheme is what routes them."""
    src = _random_source(tmp_path / "src", "ct-head", secrets.randbits(31))
    export_checkpoint(src, tmp_path / "out", engine="vllm", granularity="per-head")
    exported = _read_export(tmp_path / "out")
    qcfg = dict(exported.quantization_config)
    qcfg["kv_cache_scheme"] = {**qcfg["kv_cache_scheme"], "strategy": "tensor"}
    tampered = replace(exported, config={**exported.config, "quantization_config": qcfg})
    with pytest.raises((AssertionError, ValueError), match="into parameter"):
        _vllm_load(vllm, tampered, 0, 1)


def test_vllm_quant_configs_keep_the_base_mappers_and_kv_methods(
    pytestconfig: pytest.Config,
) -> None:
    """What the skeleton assumes of vLLM's config classes, checked in their source.

    Neither the compressed-tensors nor a ModelOpt config overrides the base
    ``QuantizationConfig``'s KV-scale name mappers the test runs, and the ModelOpt
    KV cache method adds nothing to ``BaseKVCacheMethod``.
    """
    folder = _folder(VLLM, pytestconfig)
    quant = "vllm/model_executor/layers/quantization/"
    for relpath in (quant + "compressed_tensors/compressed_tensors.py", quant + "modelopt.py"):
        for cls, members in class_members(folder, relpath).items():
            overridden = members & {"get_cache_scale_mapper", "get_checkpoint_weight_mapper"}
            assert not overridden, f"{relpath}: {cls} overrides {overridden}"
    assert class_members(folder, quant + "modelopt.py")["ModelOptKVCacheMethod"] == {"__init__"}


def test_sglang_modelopt_kv_method_is_the_base_one(pytestconfig: pytest.Config) -> None:
    folder = _folder(SGLANG, pytestconfig)
    members = class_members(folder, "sglang/srt/layers/quantization/modelopt_quant.py")
    assert members["ModelOptFp8KVCacheMethod"] == {"__init__"}


# ---------------------------------------------------------------------------
# SGLang


class _RadixAttention(nn.Module):
    """SGLang's ``RadixAttention`` as far as KV-cache quantization goes."""

    def __init__(self, method: Any) -> None:
        super().__init__()
        self.k_scale = None
        self.v_scale = None
        self.k_scale_float = None
        self.v_scale_float = None
        self.quant_method = method
        method.create_weights(self)


class _SglangLlamaForCausalLM(nn.Module):
    def __init__(self, attentions: list[_RadixAttention]) -> None:
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=False)
        self.model = nn.Module()
        self.model.start_layer, self.model.end_layer = 0, len(attentions)
        layers = []
        for attn in attentions:
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.attn = attn
            layers.append(layer)
        self.model.layers = nn.ModuleList(layers)


def _sglang_load(code: _Sglang, exported: _Exported) -> list[_RadixAttention]:
    code.log.clear()
    method: type
    qc: Any
    if exported.kv_convention() == "modelopt":
        method, qc = code.ModelOptFp8KVCacheMethod, object()
    else:
        qc = SimpleNamespace(kv_cache_scheme=exported.quantization_config["kv_cache_scheme"])
        # SGLang's get_quant_method returns no KV method (scales ignored, a warning) otherwise
        assert code.CompressedTensorsKVCacheMethod.is_supported_scheme(qc.kv_cache_scheme)
        method = code.CompressedTensorsKVCacheMethod
    attentions = [_RadixAttention(method(qc)) for _ in range(NUM_LAYERS)]
    model = _SglangLlamaForCausalLM(attentions)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    code.legacy_load_weights(model, exported.scale_weights())
    assert code.log.warnings() == [], code.log.warnings()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    expected = {
        f"model.layers.{i}.self_attn.attn.{kind}_scale" for i in range(NUM_LAYERS) for kind in "kv"
    }
    assert changed == expected, f"SGLang loaded {sorted(changed)}, expected {sorted(expected)}"
    for attn in attentions:
        attn.quant_method.process_weights_after_loading(attn)
    return attentions


SGLANG_CASES = [*SOURCES, "modelopt-fp8-weights"]


@pytest.mark.parametrize("source", SGLANG_CASES)
def test_sglang_loads_canonical_scales(sglang: _Sglang, tmp_path: Path, source: str) -> None:
    """SGLang takes per-tensor scales only (every TP rank holds the same two numbers)."""
    seed = secrets.randbits(31)
    if source == "modelopt-fp8-weights":
        extra = {"weights": "tiny-random", "fp8_weights": True}
        src = _random_source(tmp_path / "src", "modelopt", seed, **extra)
    else:
        src = _random_source(tmp_path / "src", source, seed)
    report = export_checkpoint(src, tmp_path / "out", engine="sglang")
    assert report.granularity == "per-tensor"
    exported = _read_export(tmp_path / "out")
    attentions = _sglang_load(sglang, exported)
    for layer, (attn, (k, v)) in enumerate(zip(attentions, _canonical(src), strict=True)):
        for kind, value in (("k", k), ("v", v)):
            want = _expected(value, "per-tensor")
            got = getattr(attn, f"{kind}_scale")
            where = f"seed={seed} layer {layer} {kind}"
            assert got.dtype == torch.float32 and got.shape == (), where
            assert torch.equal(got.detach(), want), (where, got, want)
            assert getattr(attn, f"{kind}_scale_float") == float(want), where


def test_sglang_per_head_is_refused_by_export_and_ignored_by_sglang(
    sglang: _Sglang, tmp_path: Path
) -> None:
    """kvquant refuses SGLang per-head; SGLang would silently ignore vLLM's per-head scheme."""
    src = _random_source(tmp_path / "src", "ct-head", secrets.randbits(31))
    with pytest.raises(ExportError, match="per-tensor KV scales only"):
        export_checkpoint(src, tmp_path / "sglang", engine="sglang", granularity="per-head")
    assert not (tmp_path / "sglang").exists()
    export_checkpoint(src, tmp_path / "vllm", engine="vllm", granularity="per-head")
    scheme = _read_export(tmp_path / "vllm").quantization_config["kv_cache_scheme"]
    assert not sglang.CompressedTensorsKVCacheMethod.is_supported_scheme(scheme)
