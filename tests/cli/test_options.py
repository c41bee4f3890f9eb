"""The shared option flags (kvquant/cli/options.py): one spelling, the config's choices and defaults."""

from __future__ import annotations

import argparse
import inspect

import pytest

from kvquant.cli import build_parser
from kvquant.cli.options import OPTION_FLAGS, add_option_flags, config_from_args
from kvquant.registry.options import ResolveOptions


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_declares_an_option_with_the_same_flag_choices_and_help() -> None:
    seen: set[str] = set()
    for name, sub in _subparsers().items():
        for action in sub._actions:
            option = OPTION_FLAGS.get(action.dest)
            if option is None or not action.option_strings:
                continue
            seen.add(option.name)
            assert action.option_strings == [option.flag], name
            assert action.help == option.help and action.default is None, name
            expected = None if option.choice is None else list(option.choice.values())
            assert (None if action.choices is None else list(action.choices)) == expected, name
    assert seen == set(OPTION_FLAGS)


@pytest.mark.parametrize("name", sorted(OPTION_FLAGS))
def test_the_help_marks_the_configs_default(name: str) -> None:
    from kvquant import KVQuantConfig

    default = inspect.signature(KVQuantConfig.__init__).parameters[name].default
    help_text = OPTION_FLAGS[name].help
    if default is None:  # group_size: the fp32-group rule, spelled out
        assert "default" in help_text
    else:
        assert f"{default} (default" in help_text


def test_config_from_args_passes_only_what_was_given() -> None:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, ("missing_kv", "group_size", "rope_policy"))
    assert config_from_args(parser.parse_args([]), ResolveOptions) == ResolveOptions()
    args = parser.parse_args(["--missing-kv", "reuse", "--group-size", "8"])
    assert config_from_args(args, ResolveOptions) == ResolveOptions(
        missing_kv="reuse", group_size=8
    )


def test_config_from_args_builds_a_checked_kvquant_config() -> None:
    pytest.importorskip("transformers")
    from kvquant import KVQuantConfig

    args = build_parser().parse_args(["serve", "m", "--backend", "torch"])
    config = config_from_args(args, KVQuantConfig)
    assert config == KVQuantConfig(backend="torch")
