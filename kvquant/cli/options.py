"""The scale and kernel options subcommands share: each flag declared once, built into one value.

``--scale-format``, ``--missing-scales``, ``--missing-kv``, ``--group-size``,
``--rope-policy``, ``--backend`` and ``--recent-tokens`` are the options of
:class:`~kvquant.KVQuantConfig`
(and, the first five, of :class:`~kvquant.registry.options.ResolveOptions`) under the
same names. A subcommand adds the ones it takes (:func:`add_option_flags`: choices from
the typed choices of :mod:`kvquant.choices`) and builds its value from what was given
(:func:`config_from_args`); an option not given keeps that value's own default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvquant.choices import Backend, Choice, MissingKV, MissingScales, RopePolicy

__all__ = ["OPTION_FLAGS", "OptionFlag", "add_option_flags", "config_from_args"]

T = TypeVar("T")


@dataclass(frozen=True)
class OptionFlag:
    """One option as a command-line flag.

    Attributes:
        name: the option's name (a keyword of ``KVQuantConfig`` and the ``args`` attribute).
        help: what it does; the default is marked ``(default)`` beside its word.
        choice: the typed choice whose words the flag takes, or None for a free value.
        type: argparse ``type`` of the value (``str``: the text as given).
    """

    name: str
    help: str
    choice: type[Choice] | None = None
    type: Callable[[str], Any] = str

    @property
    def flag(self) -> str:
        """The flag's spelling: ``--`` and the name with dashes."""
        return "--" + self.name.replace("_", "-")


def recent_tokens_arg(text: str) -> int | str:
    """``--recent-tokens``' value: ``auto`` or a count (argparse reports anything else)."""
    return "auto" if text == "auto" else int(text)


OPTION_FLAGS: dict[str, OptionFlag] = {
    f.name: f
    for f in (
        OptionFlag(
            "scale_format",
            "scale format to resolve to: auto (default), per-tensor, per-head, fp32-group, "
            "or a registered format's name",
        ),
        OptionFlag(
            "missing_scales",
            "when the checkpoint has no KV scales: dynamic (default; fp32-group scales "
            "computed as tokens arrive), error, or unit (1.0, warned)",
            MissingScales,
        ),
        OptionFlag(
            "missing_kv",
            "when a layer has only K or only V: error (default) or reuse the one present",
            MissingKV,
        ),
        OptionFlag(
            "group_size",
            "fp32-group group size (a divisor of head_dim; default 64 capped at head_dim)",
            type=int,
        ),
        OptionFlag(
            "rope_policy",
            "for K scales calibrated before RoPE (Quark default): widen (default; by "
            "sqrt(2)) or keep as stored (warned)",
            RopePolicy,
        ),
        OptionFlag(
            "backend",
            "kernels: auto (default; Triton on CUDA, the PyTorch reference elsewhere), "
            "triton or torch",
            Backend,
        ),
        OptionFlag(
            "recent_tokens",
            "each sequence's newest tokens also kept at full precision: auto (default; 16 "
            "in generate's cache, none under continuous batching), a count, or 0 for none",
            type=recent_tokens_arg,
        ),
    )
}
"""Every shared option flag, by option name."""


def add_option_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Declare the shared option flags ``names`` (keys of :data:`OPTION_FLAGS`) on ``parser``.

    Each defaults to None (not given), so the value :func:`config_from_args` builds keeps
    its own default.
    """
    for name in names:
        option = OPTION_FLAGS[name]
        parser.add_argument(
            option.flag,
            dest=option.name,
            default=None,
            type=option.type,
            choices=None if option.choice is None else option.choice.values(),
            help=option.help,
        )


def config_from_args(args: argparse.Namespace, build: Callable[..., T]) -> T:
    """The options the command line gave, as one value: ``build(**given)``.

    Args:
        args: the parsed arguments of a subcommand that declared some of
            :data:`OPTION_FLAGS` (:func:`add_option_flags`).
        build: what to build: :class:`~kvquant.KVQuantConfig` (checks every value) or
            :class:`~kvquant.registry.options.ResolveOptions`.

    Returns:
        The value, every option that was not given at its default.
    """
    given = {
        name: getattr(args, name) for name in OPTION_FLAGS if getattr(args, name, None) is not None
    }
    return build(**given)
