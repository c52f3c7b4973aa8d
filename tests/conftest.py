"""Shared fixtures: one copy of the digits example, calibrated and quantized once per session.

Calibrating the example takes seconds, so the CLI tests share a single run (calibrate, then
quantize --stats) and only start new runs where the behaviour under test needs one.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from qtool import kernels
from qtool.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_cli(*args: object) -> Result:
    """Run `qtool ARGS` in-process; bugs (non-QtoolError exceptions) propagate with traceback."""
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@dataclass(frozen=True)
class DigitsRun:
    """The copied example folder and the outputs of `calibrate` + `quantize --stats` in out/."""

    folder: Path
    recipe: Path
    out: Path
    calibrate: Result
    quantize: Result


@pytest.fixture(params=list(kernels.CPU_ISAS))
def isa(request):
    """Each kernel instruction set in turn (the ones this CPU lacks are skipped), reset after."""
    name = request.param
    if name not in kernels.supported_cpu_isas():
        pytest.skip(f"this CPU cannot run the {name} kernels")
    kernels.set_cpu_isa(name)
    yield name
    kernels.set_cpu_isa(None)


@pytest.fixture
def threads():
    """kernels.set_cpu_threads, reset to the default after the test."""
    yield kernels.set_cpu_threads
    kernels.set_cpu_threads(None)


@pytest.fixture(scope="session")
def cli():
    """The in-process runner, as a fixture so test modules need not import conftest."""
    return run_cli


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of examples/digits, so tests never write into the repository."""
    dest = tmp_path_factory.mktemp("example") / "digits"
    shutil.copytree(EXAMPLES / "digits", dest, ignore=shutil.ignore_patterns("out", "__pycache__"))
    return dest


@pytest.fixture(scope="session")
def digits_run(digits_dir: Path) -> DigitsRun:
    recipe = digits_dir / "recipe.yaml"
    out = digits_dir / "out"
    calibrated = run_cli("calibrate", recipe, "-o", out, "--no-progress")
    quantized = run_cli(
        "quantize", recipe, "--stats", out / "stats.npz", "-o", out, "--no-progress"
    )
    return DigitsRun(digits_dir, recipe, out, calibrated, quantized)
