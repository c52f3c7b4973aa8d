"""Gate for the CUDA tests: they run only where libqtool_cuda.so loads and sees a device.

Everything under tests/gpu/ gets the `gpu` marker and is skipped with the backend's own
explanation (e.g. "not built: nvcc not found", "built, no CUDA device visible") elsewhere.

A test that takes the `cuda_variant` fixture runs once per CUDA observe design (kernels/cuda.cu:
every design must give the CPU's results bit for bit), with the design set for the process and
the default restored after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import qtool.kernels as k

_HERE = Path(__file__).resolve().parent


def _usable() -> bool:
    return k.backends()["cuda"].startswith("loaded")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs the CUDA kernel backend and a device")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cuda_variant" in metafunc.fixturenames:
        # without a device the tests are skipped anyway; one placeholder keeps them collected
        names = k.cuda_variants() if _usable() else ["no-cuda"]
        metafunc.parametrize("cuda_variant", names, indirect=True)


@pytest.fixture
def cuda_variant(request: pytest.FixtureRequest):
    k.set_cuda_variant(request.param)
    yield request.param
    k.set_cuda_variant(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = k.backends()["cuda"]
    usable = state.startswith("loaded")
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not usable:
                item.add_marker(pytest.mark.skip(reason=f"CUDA backend {state}"))
