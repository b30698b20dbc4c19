"""Every command's ``--help`` speaks to users: no source paths, no paths outside the
repository, no docstring markup, no talk of issues."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from redbatch.cli import build_parser
from tests.conftest import test_env

LEAKS = {
    "a source path": re.compile(r"\bredbatch/"),
    "a path outside the repository": re.compile(r"\.\./"),
    "an issue": re.compile(r"\bissues?\b", re.IGNORECASE),
    "docstring markup": re.compile(r"``"),
}


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
                ) -> list[tuple[str, ...]]:
    """Every command path under ``parser``: ("up",), ("jobs", "submit"), ..."""
    found: list[tuple[str, ...]] = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += subcommands(sub, (*prefix, name))
    return found


COMMANDS = subcommands(build_parser())


def test_every_command_is_covered() -> None:
    assert {(), ("up",), ("bench",), ("jobs", "submit")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "redbatch")
def test_help_leaks_no_internals(command: tuple[str, ...]) -> None:
    done = subprocess.run([sys.executable, "-m", "redbatch", *command, "--help"],
                          capture_output=True, text=True, timeout=60, env=test_env(),
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "usage: redbatch" in done.stdout
    leaks = [what for what, pattern in LEAKS.items() if pattern.search(done.stdout)]
    assert not leaks, f"{' '.join(command)} --help shows {leaks}:\n{done.stdout}"
