"""kvquant.integrations.hf.compat decides what differs between transformers 5.17, 5.24 and 5.25.

Each decision is checked against what the installed release is known to do (CI runs this
folder on each), so a function that answers for the wrong release fails here.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import transformers
from hf_tiny import build

from kvquant.integrations.hf import compat

RELEASE = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])

KNOWN: dict[tuple[int, ...], dict[str, Any]] = {
    (5, 17): {
        "keyword": "past_key_values",
        "flavour": "groups",
        "crop_keeps": True,
        "engine": False,
    },
    (5, 24): {"keyword": "cache", "flavour": "allocators", "crop_keeps": False, "engine": False},
    (5, 25): {"keyword": "cache", "flavour": "allocators", "crop_keeps": False, "engine": True},
}


@pytest.mark.skipif(RELEASE not in KNOWN, reason=f"transformers {RELEASE} has no known answers")
def test_decisions_are_the_installed_releases() -> None:
    want = KNOWN[RELEASE]
    model = build("llama")
    assert compat.cache_keyword(model.model) == want["keyword"]
    assert compat.batching_flavour() == want["flavour"]
    assert compat.POSITIVE_CROP_KEEPS is want["crop_keeps"]
    total = compat.memory_breakdown()()[1]
    assert isinstance(total, int) and total > 0
    from transformers.utils.import_utils import is_serve_available

    if is_serve_available():  # the test extras install the serving extras
        assert compat.serve_loads_in_engine_process() is want["engine"]


def test_cache_of_a_call_prefers_the_newer_keyword() -> None:
    a, b = object(), object()
    assert compat.cache_argument({"cache": a, "past_key_values": b}) == ("cache", a)
    assert compat.cache_argument({"past_key_values": b}) == ("past_key_values", b)
    assert compat.cache_argument({"input_ids": 1}) == (None, None)
    assert compat.call_cache({"cache": None, "past_key_values": b}) is None
    assert compat.call_cache({"past_key_values": b}) is b


def test_unwrap_cache_reads_through_a_module_wrapper_only() -> None:
    inner = object()

    class Wrapper(torch.nn.Module):
        def past_key_values(self) -> object:
            return inner

    class NotAModule:
        def past_key_values(self) -> object:
            return inner

    assert compat.unwrap_cache(Wrapper()) is inner
    plain = NotAModule()
    assert compat.unwrap_cache(plain) is plain and compat.unwrap_cache(None) is None
