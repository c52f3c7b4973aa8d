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


def _fake_tool(folder: Path, name: str, log: Path) -> None:
    """A stand-in compiler: logs its arguments, creates the file named after -o, answers
    --version. Keeps a build test to the seconds its Python logic needs."""
    script = folder / name
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'if [ "$1" = "--version" ]; then echo "fake release 0.0"; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done\n'
    )
    script.chmod(0o755)


@pytest.mark.parametrize(
    "archs,want",
    [("90", ["sm_90", "compute_90"]), ("80;90", ["sm_80", "sm_90", "compute_90"]), (None, None)],
)
def test_cuda_archs_choose_sass_and_ptx(tmp_path: Path, archs: str | None, want) -> None:
    """QTOOL_CUDA_ARCHS picks the SASS targets, PTX comes for the last; the default is A100 and
    Hopper (sm_80, sm_90) with compute_90 PTX, so an H100/H200 runs its own machine code."""
    fake_bin, log = tmp_path / "bin", tmp_path / "calls.log"
    fake_bin.mkdir()
    _fake_tool(fake_bin, "nvcc", log)
    _fake_tool(fake_bin, "fake-cxx", log)
    env = {k: v for k, v in os.environ.items() if k not in ("QTOOL_NO_CUDA", "QTOOL_CUDA_ARCHS")}
    env.update(PATH=f"{fake_bin}{os.pathsep}{env.get('PATH', '')}", CXX="fake-cxx")
    if archs is not None:
        env["QTOOL_CUDA_ARCHS"] = archs
    proc = _pip_wheel(_project_copy(tmp_path), tmp_path / "dist", env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("qtool-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        info = json.loads(zf.read("qtool/_lib/build_info.json"))
    want = want or ["sm_80", "sm_90", "compute_90"]
    assert info["cuda"]["archs"] == want
    (nvcc_call,) = [ln for ln in log.read_text().splitlines() if "kernels/cuda.cu" in ln]
    for arch in want:
        number = arch.split("_")[1]
        code = f"arch=compute_{number},code={arch}"
        assert code in nvcc_call
    assert nvcc_call.count("code=sm_") == len(want) - 1
    assert "-fmad=false" in nvcc_call


def test_malformed_cuda_archs_fail_the_build(tmp_path: Path) -> None:
    fake_bin, log = tmp_path / "bin", tmp_path / "calls.log"
    fake_bin.mkdir()
    _fake_tool(fake_bin, "nvcc", log)
    _fake_tool(fake_bin, "fake-cxx", log)
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_NO_CUDA"}
    env.update(
        PATH=f"{fake_bin}{os.pathsep}{env.get('PATH', '')}", CXX="fake-cxx",
        QTOOL_CUDA_ARCHS="sm90",
    )  # fmt: skip
    proc = _pip_wheel(_project_copy(tmp_path), tmp_path / "dist", env)
    assert proc.returncode != 0
    assert "QTOOL_CUDA_ARCHS='sm90'" in proc.stdout + proc.stderr


# fused_observe_kernel<VEC, HIST, ZEROS, MATCH, POW2, SHARED> and lean_observe_kernel<HIST,
# ZEROS, POW2> in the PTX's mangled names
_FUSED = re.compile(r"fused_observe_kernelILi(\d)ELb(\d)ELb(\d)ELb(\d)ELb(\d)ELb(\d)EE")
_LEAN = re.compile(r"lean_observe_kernelILb(\d)ELb(\d)ELb(\d)EE")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_exact_kernels_hold_no_fused_multiply_add(tmp_path: Path) -> None:
    """The CUDA results equal the CPU's bit for bit only if no a*b+c is rounded once where the CPU
    rounds twice. nvcc contracts by default (-fmad=true); the shared math writes its operations
    as _rn intrinsics, which it never contracts. Compiled here WITHOUT -fmad=false, the PTX of
    every kernel whose result must be exact holds no fma at all. The observe kernels with float32
    power-of-two bins hold the one fma per value that qt_hist_bin_pow2 asks for (qt_fma, exact by
    design); their instantiations with double bins, identical but for that formula, hold none, so
    no other expression of theirs was contracted. Runs wherever nvcc is, no GPU needed."""
    ptx = tmp_path / "cuda.ptx"
    cmd = ["nvcc", "-std=c++17", "-O3", "-arch=compute_90", "-ptx", "kernels/cuda.cu", "-o", ptx]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = ptx.read_text()
    entries = re.split(r"\.entry ", text)[1:]
    bodies = {e.split("(", 1)[0]: e for e in entries}
    exact = ["block_mse_kernel", "mse_kernel", "histogram_shared_kernel", "minmax_partial_kernel"]
    for short in exact:
        (name,) = [n for n in bodies if re.search(rf"\d{short}E", n)]
        assert "fma.rn" not in bodies[name], short
    fused = {n: _FUSED.search(n).groups() for n in bodies if _FUSED.search(n)}
    assert len(fused) >= 8
    lean = {n: _LEAN.search(n).groups() for n in bodies if _LEAN.search(n)}
    assert len(lean) >= 4
    kinds = [(name, (g[1], g[4])) for name, g in fused.items()]  # (hist, pow2)
    kinds += [(name, (g[0], g[2])) for name, g in lean.items()]
    for name, (hist, pow2) in kinds:
        f32 = bodies[name].count("fma.rn.f32")
        assert "fma.rn.f64" not in bodies[name], name
        # at least one per value read in the unrolled loop (4 float4 = 16, or 4 floats)
        assert (f32 >= 4) if hist == "1" and pow2 == "1" else f32 == 0, (name, f32)
