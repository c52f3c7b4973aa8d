"""The files between benchmarks/peers.py (qtool's venv) and one peer runner (the peer's venv).

A peer runs in its own virtual environment (each pins other onnx/onnxruntime versions), so the
two sides share files, not objects: the float model (qtool's `model.fp32.onnx`), the calibration
batches as one `.npz`, and a JSON the runner writes with the settings it really used and its
package versions. This module needs only numpy and the standard library, so that every peer's
interpreter can import it (runners add their own folder to sys.path).

npz layout: `__inputs__` (the input names, in order), `__batches__` (the batch count), and one
array `b{batch}_i{input}` per batch and input, so names with any characters survive and each
batch comes back exactly as qtool's reader made it (same order, same sizes, same dtypes).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

KINDS = ("cnn", "transformer")


def save_batches(path: Path, batches: list[dict[str, np.ndarray]]) -> None:
    """Write calibration batches (each {input name: array}) to one uncompressed npz."""
    if not batches:
        raise ValueError("no calibration batches to save")
    names = list(batches[0])
    arrays: dict[str, np.ndarray] = {
        "__inputs__": np.array(names, dtype=np.str_),
        "__batches__": np.array(len(batches), dtype=np.int64),
    }
    for b, batch in enumerate(batches):
        if list(batch) != names:
            raise ValueError(f"batch {b} has inputs {list(batch)}, batch 0 has {names}")
        for i, name in enumerate(names):
            arrays[f"b{b}_i{i}"] = np.ascontiguousarray(batch[name])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a str path
        np.savez(f, **arrays)


def load_batches(path: Path) -> list[dict[str, np.ndarray]]:
    """The batches save_batches wrote, in order."""
    with np.load(path, allow_pickle=False) as data:
        names = [str(n) for n in data["__inputs__"]]
        count = int(data["__batches__"])
        return [{name: data[f"b{b}_i{i}"] for i, name in enumerate(names)} for b in range(count)]


def split_samples(batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The same samples one per item (batch dimension kept at 1), for tools that count items."""
    return [
        {name: array[k : k + 1] for name, array in batch.items()}
        for batch in batches
        for k in range(len(next(iter(batch.values()))))
    ]


def sample_count(batches: list[dict[str, np.ndarray]]) -> int:
    return sum(len(next(iter(batch.values()))) for batch in batches)


class BatchReader:
    """ORT's CalibrationDataReader protocol (get_next / rewind) over saved batches; the peers'
    readers (ORT's, INC's, ModelOpt's, Quark's) accept any object with these methods."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = batches
        self._it = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._batches)

    def get_first(self) -> dict[str, np.ndarray]:
        """ModelOpt peeks at the first batch to find its MatMuls' shapes."""
        return self._batches[0]

    def __len__(self) -> int:
        return len(self._batches)


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


Quantizer = Callable[[Path, list[dict[str, np.ndarray]], Path, str], dict]


def main(quantize: Quantizer, packages: tuple[str, ...], argv: list[str] | None = None) -> int:
    """A runner's whole command line: read the inputs, quantize, write `--result` JSON.

    `quantize(fp32, batches, out, kind)` writes the quantized model to `out` and returns the
    settings it used. The JSON carries them, the versions of `packages`, the runner's own CPU
    seconds (user + system of this process and its children, ORT's threads included) and, on
    failure, the one-line reason (the traceback goes to stderr); the exit code is 1 then.
    """
    p = argparse.ArgumentParser(description="quantize qtool's float model with one peer tool")
    p.add_argument("--model", type=Path, required=True, help="the float model (model.fp32.onnx)")
    p.add_argument("--data", type=Path, required=True, help="calibration batches (.npz)")
    p.add_argument("--out", type=Path, required=True, help="the quantized model to write")
    p.add_argument("--kind", choices=KINDS, required=True, help="which recommended settings")
    p.add_argument("--result", type=Path, required=True, help="JSON: settings, versions, times")
    args = p.parse_args(argv)
    result: dict = {
        "versions": {pkg: version(pkg) for pkg in packages},
        "python": platform.python_version(),
    }
    wall = time.perf_counter()
    try:
        batches = load_batches(args.data)
        result["calibration_samples"] = sample_count(batches)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["settings"] = quantize(args.model, batches, args.out, args.kind)
        if not args.out.is_file():
            raise RuntimeError(f"the tool returned but wrote no model at {args.out}")
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the reason goes into the JSON, the trace to stderr
        traceback.print_exc()
        result["status"] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    result["wall_s"] = time.perf_counter() - wall
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":  # pragma: no cover - a library for the runners
    sys.exit("import this module from a runner")
