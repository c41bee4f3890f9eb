"""One options object: ``kvquant.patch(model, KVQuantConfig(...))``, keyword sugar, load-time config."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hf_tiny import build

import kvquant
import kvquant.integrations.hf as kvhf
from kvquant.errors import OptionError, OptionTypeError
from kvquant.integrations.hf.config import OPTION_NAMES
from kvquant.integrations.hf.quantizer import KVQuantConfig


def _state(model: Any) -> tuple[Any, ...]:
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation, hooks, sorted(n for n, _ in model.named_buffers())


def test_a_config_positionally_is_the_keywords() -> None:
    model = build("llama")
    handle = kvquant.patch(model, kvquant.KVQuantConfig(backend="torch", page_size=8))
    assert handle.state.options.page_size == 8 and handle.state.options.backend == "torch"
    # the keyword sugar builds the same config: the same patch, so the same handle
    assert kvquant.patch(model, backend="torch", page_size=8) is handle
    assert kvquant.patch(model, config=KVQuantConfig(backend="torch", page_size=8)) is handle
    handle.remove()


def test_config_and_keywords_together_are_refused_before_any_change() -> None:
    model = build("llama")
    before = _state(model)
    with pytest.raises(OptionError, match=r"KVQuantConfig\(\.\.\., page_size=\.\.\.\)"):
        kvquant.patch(model, KVQuantConfig(), page_size=8)
    with pytest.raises(OptionTypeError, match=r"expected a kvquant\.KVQuantConfig") as err:
        kvquant.patch(model, {"page_size": 8})  # type: ignore[arg-type]
    assert isinstance(err.value, TypeError)
    assert _state(model) == before


@pytest.mark.parametrize(
    "build_it",
    [lambda: kvquant.patch(build("llama"), pagesize=8), lambda: KVQuantConfig(pagesize=8)],
)
def test_a_misspelt_option_is_refused_with_the_closest_name(build_it: Any) -> None:
    with pytest.raises(
        OptionTypeError, match=r"unknown option 'pagesize'\. Did you mean 'page_size'\?"
    ) as err:
        build_it()
    assert isinstance(err.value, TypeError)  # as Python's own unexpected-keyword error


def test_bad_values_are_refused_at_construction_and_after_update() -> None:
    with pytest.raises(OptionError, match=r"page_size=0"):
        KVQuantConfig(page_size=0)
    cfg = KVQuantConfig()
    cfg.update(page_size=0)  # transformers' own setter skips the constructor
    with pytest.raises(OptionError, match=r"page_size=0"):
        kvquant.patch(build("llama"), cfg)


def test_saved_config_round_trips_and_compares_by_value() -> None:
    cfg = KVQuantConfig(page_size=32, cuda_graphs=False)
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert set(saved) == {"quant_method", "config_version", *OPTION_NAMES}
    assert saved["config_version"] == 1
    again = KVQuantConfig.from_dict(saved)
    assert again == cfg and again != KVQuantConfig()
    assert repr(cfg) == "KVQuantConfig(page_size=32, cuda_graphs=False)"
    assert repr(KVQuantConfig()) == "KVQuantConfig()"


def test_from_pretrained_takes_the_same_object(tmp_path: Any) -> None:
    build("llama").save_pretrained(tmp_path)
    cfg = KVQuantConfig(backend="torch", page_size=8)
    model = kvhf.from_pretrained(tmp_path, quantization_config=cfg, dtype=torch.float32)
    state = model._kvquant_state
    assert state.options.page_size == 8
    assert state.options == cfg.options(state.options.source)


def test_a_saved_config_carries_its_version_and_a_newer_one_is_refused() -> None:
    saved = KVQuantConfig(page_size=32).to_dict()
    older = {k: v for k, v in saved.items() if k != "config_version"}  # saved before versions
    assert KVQuantConfig.from_dict(older) == KVQuantConfig(page_size=32)
    with pytest.raises(OptionError, match=r"saved by a newer kvquant \(config_version=2\)"):
        KVQuantConfig.from_dict({**saved, "config_version": 2})
    with pytest.raises(OptionError, match=r"config_version='1'; expected an int"):
        KVQuantConfig.from_dict({**saved, "config_version": "1"})
