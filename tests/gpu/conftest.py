"""Gate for the CUDA tests: they run only where libqtool_cuda.so loads and sees a device.

Everything under tests/gpu/ gets the `gpu` marker and is skipped with the backend's own
explanation (e.g. "not built: nvcc not found", "built, no CUDA device visible") elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import qtool.kernels as k

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs the CUDA kernel backend and a device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = k.backends()["cuda"]
    usable = state.startswith("loaded")
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not usable:
                item.add_marker(pytest.mark.skip(reason=f"CUDA backend {state}"))
