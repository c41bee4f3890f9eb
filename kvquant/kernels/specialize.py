"""Which integer arguments of kvquant's Triton kernels Triton may specialise on.

Triton compiles one variant per specialisation key (the ``tl.constexpr`` values
and, per integer argument, ``== 1`` and ``% 16 == 0``), so an argument that
follows the call (a prompt's length, a block table's width, a split count)
compiled new variants in otherwise warm calls, and inside decode-graph captures.
The kernels mark those arguments ``varying`` (no specialisation,
``do_not_specialize``: ``num_splits``) or ``unaligned`` (only ``== 1`` kept,
``do_not_specialize_on_alignment``, so decode keeps its own variant:
``n_tokens``, ``Lq``, a block table's row stride). Strides fixed by the model
keep their full specialisation.

Design: docs/dev/backends.md.
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
