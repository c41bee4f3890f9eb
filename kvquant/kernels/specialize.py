"""Which integer arguments of kvquant's Triton kernels Triton may specialise on.

Triton compiles one variant of a kernel per *specialisation key*: besides the
``tl.constexpr`` values, every integer argument contributes whether it equals 1
and whether it is divisible by 16. An argument whose value follows the call (a
prompt's length, a block table's width, the split count of a decode) then makes
later calls compile again when the value crosses one of those lines: a chat
whose prompts grow from call to call compiled a new decode variant in a call
that was otherwise warm, and under kvquant's decode graphs such a compile lands
in the capture. The kernels mark those arguments:

* ``varying``: no specialisation at all (``do_not_specialize``), for values
  whose size says nothing the kernel could use (``num_splits``);
* ``unaligned``: only the ``== 1`` specialisation is kept
  (``do_not_specialize_on_alignment``), so that decode (one token, one query
  block) keeps its own constant-folded variant while every other length shares
  one (``n_tokens``, ``Lq``, a block table's row stride).

Strides of the pages and of tensors whose shape is fixed by the model keep
their full specialisation: they never change between calls.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import triton

__all__ = ["OPTIONS", "jit", "jit_options"]

_ALIGNMENT_KNOB = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters

OPTIONS: dict[str, dict[str, Any]] = {}
"""The specialisation options of each kernel decorated by :func:`jit`, by function name.

(The Triton interpreter drops them from its kernel objects; the tests read them here.)"""


def jit_options(
    *, varying: tuple[str, ...] = (), unaligned: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Keyword arguments of ``triton.jit`` for the named integer arguments.

    Args:
        varying: arguments Triton must not specialise on at all.
        unaligned: arguments Triton specialises on ``== 1`` only (not on
            divisibility by 16). On a Triton without that option they are left
            fully specialised (a few more variants, the same code).

    Returns:
        ``do_not_specialize`` (and ``do_not_specialize_on_alignment``) lists.
    """
    options: dict[str, Any] = {"do_not_specialize": list(varying)}
    if _ALIGNMENT_KNOB:
        # Some Triton releases keep the divisibility key of a ``do_not_specialize`` argument:
        # the varying ones are named in both lists.
        options["do_not_specialize_on_alignment"] = [*varying, *unaligned]
    return options


def jit(*, varying: tuple[str, ...] = (), unaligned: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """``triton.jit`` with :func:`jit_options`, recorded in :data:`OPTIONS`."""

    def decorate(fn: Any) -> Any:
        options = jit_options(varying=varying, unaligned=unaligned)
        OPTIONS[fn.__name__] = options
        return triton.jit(fn, **options)

    return decorate
