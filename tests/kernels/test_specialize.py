"""How many compiled variants of each Triton kernel a growing context asks for.

Triton compiles a kernel once per specialisation key (its constexprs, and for
each integer argument whether it is 1 and whether 16 divides it). The tests
record every launch the interpreter runs, compute the key Triton would give it
on a GPU from the options the kernels declare (:data:`kvquant.kernels.specialize.OPTIONS`),
and count the distinct keys over calls whose lengths, block-table widths and
split counts differ, as a chat's calls do. A control counts the same launches
with every argument specialised, so each test also shows that its calls do
move the values the options are for.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from paged_cases import build_case

from kvquant import kernels
from kvquant.kernels import specialize
from kvquant.schemes import Pages

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")
try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # pragma: no cover - a Triton without the native key function
    pytest.skip(
        "this Triton has no native_specialize_impl to compute keys", allow_module_level=True
    )

Launch = tuple[str, dict[str, Any]]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """Every interpreted kernel launch: the kernel's name and its bound arguments."""
    seen: list[Launch] = []
    run = interpreter.InterpretedFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        names = list(inspect.signature(self.fn).parameters)
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        seen.append((self.fn.__name__, bound))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    # a GPU's split counts (132 multiprocessors), not the CPU placeholder's
    monkeypatch.setattr("kvquant.kernels.attention.launch.device_sm_count", lambda device: 132)
    yield seen


def _key(name: str, bound: dict[str, Any], declared: bool) -> tuple[Any, ...]:
    options = specialize.OPTIONS[name] if declared else {}
    plain = set(options.get("do_not_specialize", ()))
    unaligned = set(options.get("do_not_specialize_on_alignment", ()))
    key = []
    for arg, value in bound.items():
        values = value if isinstance(value, tuple) else (value,)  # strides come as tuples
        if arg.isupper() or not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
            key.append((arg, repr(value)))  # a constexpr (upper case by convention), None
        else:
            spec = tuple(
                native_specialize_impl(
                    BaseBackend, v, False, arg not in plain, arg not in unaligned
                )
                for v in values
            )
            key.append((arg, spec))
    return tuple(key)


def _variants(launches: list[Launch], declared: bool = True) -> dict[str, int]:
    keys: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
    for name, bound in launches:
        keys[name].add(_key(name, bound, declared))
    return {name: len(k) for name, k in keys.items()}


def test_every_launched_kernel_declares_its_specialisation(launches: list[Launch]) -> None:
    case = build_case([40], hq=2, hkv=1, d=16)
    case.attend(kernels.paged_attention, backend="triton")
    assert {name for name, _ in launches} <= set(specialize.OPTIONS)


def test_decode_over_a_growing_context_compiles_a_variant_per_split_mode_and_merge_tile(
    launches: list[Launch],
) -> None:
    # block-table widths 4, 16, 32, 45, 61, 64, 70: the first context unsplit, then 4 to 18
    # splits (12 and 16 share a merge tile of 16 rows)
    for n in (40, 230, 490, 700, 950, 1000, 1100):
        case = build_case([n], hq=2, hkv=1, d=16, seed=n)
        out = torch.full_like(case.query, float("nan"))
        case.attend(kernels.paged_attention, out=out, backend="triton")
        torch.testing.assert_close(out.float(), case.reference(), atol=2e-3, rtol=2e-3)
    tiles = {b["SPLITS_P2"] for name, b in launches if name == "reduce_kernel"}
    control = _variants(launches, declared=False)
    assert control["paged_attn_kernel"] > 2 and control["reduce_kernel"] > len(tiles), control
    # the attention: one unsplit and one split variant (SPLIT is a constexpr); the merge: one
    # per tile (a constexpr), whatever the split count and the block table's width
    assert _variants(launches) == {"paged_attn_kernel": 2, "reduce_kernel": len(tiles)}


def test_writes_of_any_length_compile_one_prefill_and_one_decode_variant(
    launches: list[Launch],
) -> None:
    case = build_case([64], hq=2, hkv=1, d=16)
    pages = Pages(torch.zeros_like(case.pages.k), torch.zeros_like(case.pages.v))
    for n in (1, 7, 16, 33, 48, 1):
        key = torch.randn(1, n, 1, 16, dtype=torch.float16)
        value = torch.randn(1, n, 1, 16, dtype=torch.float16)
        slots = torch.arange(n, dtype=torch.int64).view(1, n)
        kernels.write_kv(key, value, pages, slots, case.scheme, backend="triton")
    control = _variants(launches, declared=False)
    assert control["write_kv_kernel"] > 2, control
    assert _variants(launches) == {"write_kv_kernel": 2}
