"""The install compiled the kernels: the CPU library always, the CUDA library wherever nvcc is.

CI runs this on machines with nvcc and no GPU: loading libqtool_cuda.so and finding every
declared symbol is how it proves the CUDA sources compile and link.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import qtool.kernels as k

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "kernels" / "qtool_kernels.h"


def _declared(prefix: str) -> set[str]:
    return set(re.findall(rf"\b({prefix}\w+)\s*\(", HEADER.read_text()))


def _build_info() -> dict:
    return json.loads(k.BUILD_INFO.read_text())


def test_cpu_library_built_and_exports_every_declared_symbol() -> None:
    assert k.CPU_LIB.is_file()
    assert _build_info()["cpu"]["built"] is True
    lib = ctypes.CDLL(str(k.CPU_LIB))
    names = _declared("qt_cpu_")
    assert len(names) >= 10
    missing = [n for n in names if not hasattr(lib, n)]
    assert not missing
    assert k.backends()["cpu"].startswith("loaded")


def test_build_info_is_consistent_with_files() -> None:
    info = _build_info()
    assert info["cuda"]["built"] == k.CUDA_LIB.is_file()
    if not info["cuda"]["built"]:
        assert info["cuda"]["reason"]
        assert k.backends()["cuda"] == f"not built: {info['cuda']['reason']}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.skipif(os.environ.get("QTOOL_NO_CUDA") == "1", reason="QTOOL_NO_CUDA=1")
def test_cuda_library_built_when_nvcc_is_available() -> None:
    info = _build_info()
    assert info["cuda"]["built"] is True, info["cuda"]
    assert set(info["cuda"]["archs"]) >= {"sm_80", "sm_90", "compute_90"}
    lib = ctypes.CDLL(str(k.CUDA_LIB))  # static cudart: loads without a driver
    missing = [n for n in _declared("qt_cuda_") if not hasattr(lib, n)]
    assert not missing
    assert not k.backends()["cuda"].startswith("not built")


def _project_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kernels", src / "kernels")
    shutil.copytree(
        ROOT / "qtool", src / "qtool", ignore=shutil.ignore_patterns("_lib", "__pycache__")
    )
    return src


def _pip_wheel(src: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    return subprocess.run(
        [*cmd, "-w", str(out), str(src)], capture_output=True, text=True, env=env, timeout=300
    )


def test_regular_wheel_build_ships_the_library(tmp_path: Path) -> None:
    """`pip install .` path: a non-editable, platform-tagged wheel that carries the .so files."""
    env = {**os.environ, "QTOOL_NO_CUDA": "1"}  # keep it fast; the skip path is checked too
    proc = _pip_wheel(_project_copy(tmp_path), tmp_path / "dist", env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("qtool-*.whl")
    assert not wheel.name.endswith("-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = json.loads(zf.read("qtool/_lib/build_info.json"))
    assert "qtool/_lib/libqtool_cpu.so" in names
    assert "qtool/_lib/libqtool_cuda.so" not in names
    # the presets travel with the package: `base: int8-cnn` works outside a checkout
    assert "qtool/config/presets/int8-cnn.yaml" in names
    assert info["cuda"] == {"built": False, "reason": "skipped: QTOOL_NO_CUDA=1"}


def test_failing_nvcc_fails_the_build(tmp_path: Path) -> None:
    """An nvcc that is found but fails must stop the install, not ship a CPU-only package."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    nvcc = fake_bin / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'fake nvcc: simulated compile error' >&2\nexit 3\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_NO_CUDA"}
    env["PATH"] = f"{fake_bin}{os.pathsep}{env.get('PATH', '')}"
    proc = _pip_wheel(_project_copy(tmp_path), tmp_path / "dist", env)
    assert proc.returncode != 0
    assert "libqtool_cuda.so failed" in proc.stdout + proc.stderr
    assert "simulated compile error" in proc.stdout + proc.stderr
