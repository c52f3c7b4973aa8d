"""The deployment CPU: which instruction sets ONNX Runtime's integer kernels will use there.

The CPU is part of the quantization target. On x86 with AVX2 (or AVX-512BW) but no VNNI, MLAS
multiplies uint8 activations by int8 weights with `vpmaddubsw`, which adds each pair of products
along the reduction axis into a *saturating* 16-bit sum: 255 * 127 * 2 = 64770 does not fit, so
full-range int8 weights can lose 10-25 dB there. VNNI (`vpdpbusd`, AVX512-VNNI or AVX-VNNI) and AMX
accumulate in 32 bits, and ARM's kernels widen before adding, so neither saturates. qtool reads the
flags of the machine it runs on by default, or takes a named CPU from the recipe, because the
machine that quantizes is often not the one that serves.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

# Names a recipe can give for `quantization.cpu`; "auto" means the machine qtool runs on.
CPU_NAMES = ("auto", "avx2", "avx512", "avx512-vnni", "avx-vnni", "amx", "arm64", "arm64-dotprod")

_X86_FLAGS = {
    "avx2": "avx2",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "amx_int8": "amx_int8",
}
_ARM_FLAGS = {"asimddp": "dotprod", "i8mm": "i8mm", "sve": "sve"}

# The feature sets a named CPU stands for.
_NAMED: dict[str, tuple[str, frozenset[str]]] = {
    "avx2": ("x86_64", frozenset({"avx2"})),
    "avx512": ("x86_64", frozenset({"avx2", "avx512f", "avx512bw"})),
    "avx512-vnni": ("x86_64", frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})),
    "avx-vnni": ("x86_64", frozenset({"avx2", "avx_vnni"})),
    "amx": (
        "x86_64",
        frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_int8"}),
    ),
    "arm64": ("aarch64", frozenset()),
    "arm64-dotprod": ("aarch64", frozenset({"dotprod"})),
}


@dataclass(frozen=True)
class CpuFeatures:
    """The integer-kernel-relevant features of one CPU, and where the description came from."""

    arch: str  # "x86_64", "aarch64" or what platform.machine() says
    features: frozenset[str]
    source: str  # "this machine (/proc/cpuinfo)" or "recipe: quantization.cpu = avx2"
    model_name: str = ""

    @property
    def vnni(self) -> bool:
        return bool(self.features & {"avx512_vnni", "avx_vnni", "amx_int8"})

    @property
    def u8s8_saturates(self) -> bool:
        """True where ORT's uint8 x int8 kernels add product pairs in saturating 16-bit sums."""
        is_x86 = self.arch in ("x86_64", "AMD64", "i686", "x86")
        return is_x86 and bool(self.features & {"avx2", "avx512bw"}) and not self.vnni

    def describe(self) -> str:
        names = ", ".join(sorted(self.features)) or "no SIMD extensions that matter"
        model = f"{self.model_name}; " if self.model_name else ""
        return f"{model}{self.arch}: {names}"

    def label(self) -> str:
        """Where the description came from and what it says, for one-line messages."""
        where = "this machine" if self.source.startswith("this machine") else self.source
        vnni = "VNNI" if self.vnni else "no VNNI"
        return f"{where} ({self.describe()}; {vnni})"

    def to_dict(self) -> dict:
        return {
            "description": self.label(),
            "arch": self.arch,
            "model_name": self.model_name,
            "features": sorted(self.features),
            "vnni": self.vnni,
            "u8s8_saturates": self.u8s8_saturates,
            "source": self.source,
        }


def _cpuinfo_fields(text: str) -> tuple[set[str], str]:
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    return flags, model


def detect_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """The features of the machine qtool runs on (Linux /proc/cpuinfo; elsewhere the arch only)."""
    arch = platform.machine() or "unknown"
    try:
        flags, model = _cpuinfo_fields(cpuinfo.read_text(encoding="utf-8", errors="replace"))
        source = f"this machine ({cpuinfo})"
    except OSError:
        flags, model, source = set(), "", "this machine (no /proc/cpuinfo: features unknown)"
    table = _ARM_FLAGS if arch in ("aarch64", "arm64") else _X86_FLAGS
    features = frozenset(name for flag, name in table.items() if flag in flags)
    return CpuFeatures(arch, features, source, model)


def resolve_cpu(name: str) -> CpuFeatures:
    """The CPU a recipe names (`quantization.cpu`), or this machine's for "auto"."""
    if name == "auto":
        return detect_cpu()
    arch, features = _NAMED[name]
    return CpuFeatures(arch, features, f"recipe: quantization.cpu = {name}")
