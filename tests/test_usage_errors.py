"""Usage errors exit 3 ("could not judge"), never 2 ("a check failed", which drains a Slurm node).

Issue 18: argparse exits 2 on an unknown flag, and contrib/slurm-healthcheck.sh drains on 2: one bad
rollout of GPUMON_ARGS drained every node. Every parser and subparser of the CLI is walked, so a
command added later cannot bring argparse's 2 back.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gpumon.cli import EXIT_CANNOT_RUN, build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path the parser accepts: (), ("check",), ("canary", "run"), ..."""
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(build_parser())


def test_the_walk_finds_every_command() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"check", "run-bootstrap", "daemon", "status", "set-healthy", "list-checks", "probe-fabric",
            "canary record", "canary run", "canary replay"} <= names


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "gpumon")
def test_an_unknown_flag_exits_3_and_says_nothing_was_checked(
        command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--no-such-flag"])
    assert exc.value.code == EXIT_CANNOT_RUN == 3
    err = capsys.readouterr().err
    # a command with a required argument names that one first
    assert "usage error (exit 3, nothing was checked)" in err


@pytest.mark.parametrize("argv", [
    ["status", "--history", "many"],          # a bad value
    ["run-bootstrap", "--only"],              # a missing value
    ["set-healthy", "gpu/1"],                 # a missing required flag (--reason)
    [],                                       # no command
    ["chekc"],                                # a misspelt command
])
def test_bad_values_and_missing_arguments_exit_3(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 3


def test_the_installed_command_and_the_standalone_canary_exit_3() -> None:
    for argv in (["-m", "gpumon", "check", "--jsno"], ["-m", "gpumon.sdc.cli", "run", "--jsno"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, (argv, proc.stderr)
        assert proc.stdout == ""


def test_help_and_version_still_exit_0() -> None:
    for argv in (["--help"], ["check", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 0


def test_help_lists_the_shipped_scenarios_and_an_unknown_one_is_named_plainly() -> None:
    from gpumon.sim.scenario import builtin_scenarios

    out = subprocess.run([sys.executable, "-m", "gpumon", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    flat = " ".join(out.split())
    for name in builtin_scenarios():
        assert name in flat
    proc = subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", "nosuch"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.startswith("gpumon: configuration error: --simulate: no scenario named 'nosuch' "
                                  "(shipped: "), proc.stderr
    assert "<config>" not in proc.stderr
