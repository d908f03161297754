"""docs/cli.md says what ``reflow COMMAND --help`` leaves to argparse: which flags are required, and defaults."""

from __future__ import annotations

import argparse

from reflow.cli.main import build_parser, cli_reference


def _options(parser: argparse.ArgumentParser, command: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{command} {name}")
        elif action.option_strings and action.help not in (None, argparse.SUPPRESS):
            yield command, action


def test_the_reference_marks_required_flags_and_every_help_gives_its_default() -> None:
    rows = cli_reference().splitlines()
    for command, action in _options(build_parser(), "reflow"):
        flag = ", ".join(action.option_strings)
        if action.required:
            assert any(r.startswith(f"| `{command}` | `{flag}`") and "(required) |" in r for r in rows), (command, flag)
        elif action.default not in (None, False, [], "", argparse.SUPPRESS):
            assert "default" in action.help, (command, flag, action.default)
    assert "| `reflow bench` | `--output, -o` DIR (required) |" in cli_reference()
    assert "| `reflow simulate` | `--output, -o` DIR (required) |" in cli_reference()
