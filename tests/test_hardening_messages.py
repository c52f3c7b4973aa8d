"""Every error is one line that names what the user wrote (issue 21, items 4 and the usage box).

Bad options and missing arguments of every command print `error: ...` naming the option or
argument and exit 2, like every other error, instead of Typer's five-line usage box (--help and
a bare `qtool` still print the help). Hostile inputs (a node reading a tensor nothing defines,
an operator ONNX does not know, folders where files belong and files where folders belong) fail
in one line naming the file, node, tensor or option, and never move or replace a user's folder.
"""

from __future__ import annotations

import pytest


def one_line(result, *words: str) -> str:
    """The run's error line, checked: exit 2, one line on stderr, naming every word."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "╭" not in result.output, result.output
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# --- usage errors: one line, naming the option or argument ---------------------------------------

USAGE = {
    "analyze --samples 0": (["analyze", "r.yaml", "--samples", "0"], ["'--samples'", "analyze"]),
    "stats merge, no files": (["stats", "merge"], ["'files'", "stats merge"]),
    "stats merge, no --output": (["stats", "merge", "a.npz"], ["'--output'"]),
    "calibrate, no recipe": (["calibrate"], ["'recipe'", "calibrate"]),
    "quantize, unknown option": (["quantize", "r.yaml", "--bogus"], ["--bogus"]),
    "qat, no recipe": (["qat"], ["'recipe'"]),
    "evaluate --batch-size x": (["evaluate", "--batch-size", "x"], ["'--batch-size'"]),
    "evaluate --accuracy-level 7": (["evaluate", "--accuracy-level", "7"], ["'--accuracy-level'"]),
    "calibrate --shard, no value": (["calibrate", "r.yaml", "--shard"], ["'--shard'"]),
    "doctor, extra argument": (["doctor", "extra"], ["extra", "doctor"]),
    "unknown command": (["nosuch"], ["'nosuch'"]),
}


@pytest.mark.parametrize("case", USAGE)
def test_usage_errors_are_one_line_naming_the_option(cli, case) -> None:
    args, words = USAGE[case]
    line = one_line(cli(*args), *words)
    assert "--help" in line  # where to read the usage instead of a box


@pytest.mark.parametrize("args", [[], ["stats"]])
def test_a_group_without_a_command_still_prints_its_help(cli, args) -> None:
    result = cli(*args)
    assert result.exit_code == 2
    assert "Usage: qtool" in result.output and "Commands" in result.output


@pytest.mark.parametrize("args", [["--help"], ["quantize", "--help"], ["stats", "merge", "-h"]])
def test_help_is_unchanged(cli, args) -> None:
    result = cli(*args)
    if args[-1] == "-h":  # no short help option: an ordinary usage error, in one line
        one_line(result, "-h")
        return
    assert result.exit_code == 0 and "Usage: qtool" in result.output
    assert "╭─ Options" in result.output
