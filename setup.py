"""Build hook: compile the statistics kernels in kernels/ into qtool/_lib/ at install time.

Project metadata lives in pyproject.toml; this file only adds the `build_kernels` step to
`build`, so both `pip install .` and `pip install -e .` compile the kernels:

- `libqtool_cpu.so`: always, with g++ (or $CXX). A failure fails the install.
- `libqtool_cuda.so`: when `nvcc` is found on PATH or in $CUDA_HOME/bin (or $CUDA_PATH/bin),
  with machine code (SASS) for each architecture of $QTOOL_CUDA_ARCHS (default `80;90`: A100,
  H100/H200) plus PTX of the newest, which the driver compiles for newer GPUs. Hopper gets its own
  sm_90 code rather than PTX compiled at load time (HOPPER.md of the device notes: code built for
  an older target runs, but without Hopper's instructions). If nvcc is found and the compilation
  fails, the install fails loudly rather than silently shipping a CPU-only package.
- `build_info.json`: which backends were built, with which compiler, and why not.

The CPU library is built for the baseline x86-64 (or any other architecture); its AVX2 and
AVX-512 kernels are compiled with per-function target options and chosen at run time from CPUID
(kernels/cpu_simd.h), so one build runs on every x86-64 and builds on ARM. Never add
-march=native here: the wheel would crash on older CPUs.

Rebuild in the source tree after editing kernels/: `python setup.py build_kernels --inplace`.

Environment:
  QTOOL_NO_CUDA=1   skip the CUDA library even when nvcc is available.
  QTOOL_CUDA_ARCHS  compute capabilities to build SASS for, e.g. `90` (a quicker build for a
                    Hopper-only machine) or `80;90;100`; PTX is added for the last one.
  CXX               host C++ compiler for the CPU library (default g++).

A plain C interface loaded with ctypes keeps the build free of torch, CuPy and pybind. Editable
installs build into the source tree (qtool/_lib/, gitignored); regular installs into build_lib.
The wheel is tagged platform-specific because it carries shared libraries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
KERNEL_DIR = ROOT / "kernels"
LIB_SUBDIR = Path("qtool") / "_lib"
CPU_LIB = "libqtool_cpu.so"
CUDA_LIB = "libqtool_cuda.so"
BUILD_INFO = "build_info.json"

# -ffp-contract=off: no FMA contraction of the shared math (the SIMD kernels use FMA only where
# cpu_simd.h proves the bin is unchanged).
CXX_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c++17", "-pthread", "-ffp-contract=off"]
# -fmad=false: no FMA contraction anywhere in the device code. The shared math does not rely on it
# (qt_math.h writes its operations as _rn intrinsics, which are never contracted), but any other
# float expression added later then rounds as the host's does. --threads 0: one nvcc thread per
# target architecture.
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-shared",
    "-Xcompiler",
    "-fPIC,-ffp-contract=off",
    "-fmad=false",
    "--threads",
    "0",
]
DEFAULT_CUDA_ARCHS = "80;90"


def cuda_archs() -> list[str]:
    """$QTOOL_CUDA_ARCHS as compute capabilities ("90"), in build order; an error when malformed."""
    raw = os.environ.get("QTOOL_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(a.isdigit() and len(a) in (2, 3) for a in archs):
        raise RuntimeError(f"QTOOL_CUDA_ARCHS={raw!r}: expected compute capabilities like '80;90'")
    return archs


def gencode_flags(archs: list[str]) -> tuple[list[str], list[str]]:
    """nvcc -gencode flags (SASS per arch, PTX of the last) and the names build_info records."""
    flags, names = [], []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        names.append(f"sm_{arch}")
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    names.append(f"compute_{archs[-1]}")
    return flags, names


def _find_nvcc() -> str | None:
    """nvcc on PATH first, then the toolkit named by CUDA_HOME / CUDA_PATH."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _run(cmd: list[str], what: str) -> None:
    print(f"[qtool build_kernels] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"qtool: building {what} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )


def _version(tool: str) -> str:
    proc = subprocess.run([tool, "--version"], capture_output=True, text=True)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    release = [ln for ln in lines if "release" in ln]  # nvcc: "Cuda compilation tools, release X"
    return (release or lines or ["unknown"])[0]


class BuildKernels(Command):
    """Compile kernels/ into shared libraries next to the qtool package."""

    description = "compile the qtool C++/CUDA statistics kernels"
    user_options: list = [("inplace", "i", "build into qtool/_lib/ of the source tree")]
    boolean_options = ["inplace"]

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self.inplace = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))
        if self.inplace:
            self.editable_mode = True

    def _out_dir(self) -> Path:
        # Editable installs import qtool from the source tree, so the libraries must live there.
        return ROOT / LIB_SUBDIR if self.editable_mode else Path(self.build_lib) / LIB_SUBDIR

    def get_source_files(self) -> list[str]:
        return sorted(str(p.relative_to(ROOT)) for p in KERNEL_DIR.glob("*") if p.is_file())

    def get_outputs(self) -> list[str]:
        names = [CPU_LIB, BUILD_INFO]
        if os.environ.get("QTOOL_NO_CUDA") != "1" and _find_nvcc():
            names.append(CUDA_LIB)
        return [str(Path(self.build_lib) / LIB_SUBDIR / n) for n in names]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def run(self) -> None:
        out = self._out_dir()
        out.mkdir(parents=True, exist_ok=True)
        # Stale libraries (copied as package data, or from an earlier build) must not survive.
        for name in (CPU_LIB, CUDA_LIB, BUILD_INFO):
            (out / name).unlink(missing_ok=True)

        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            raise RuntimeError(f"qtool: C++ compiler {cxx!r} not found; install g++ or set CXX")
        _run([cxx, *CXX_FLAGS, "kernels/cpu.cpp", "-o", str(out / CPU_LIB)], CPU_LIB)
        info: dict = {"cpu": {"built": True, "library": CPU_LIB, "compiler": _version(cxx)}}

        nvcc = _find_nvcc()
        if os.environ.get("QTOOL_NO_CUDA") == "1":
            info["cuda"] = {"built": False, "reason": "skipped: QTOOL_NO_CUDA=1"}
        elif nvcc is None:
            info["cuda"] = {"built": False, "reason": "nvcc not found (PATH, CUDA_HOME)"}
        else:
            gencode, archs = gencode_flags(cuda_archs())
            cmd = [nvcc, *NVCC_FLAGS, *gencode, "kernels/cuda.cu", "-o", str(out / CUDA_LIB)]
            _run(cmd, CUDA_LIB)
            info["cuda"] = {
                "built": True,
                "library": CUDA_LIB,
                "compiler": _version(nvcc),
                "archs": archs,
            }
        (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


class BuildWithKernels(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class BinaryDistribution(Distribution):
    """Marks the wheel platform-specific: it ships compiled libraries."""

    def has_ext_modules(self) -> bool:
        return True


setup(
    cmdclass={"build": BuildWithKernels, "build_kernels": BuildKernels},
    distclass=BinaryDistribution,
)
