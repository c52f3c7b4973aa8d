"""NNCF's weight compression (`nncf.compress_weights`) on an ONNX decoder, run in NNCF's own venv
(benchmarks/.peers/nncf/venv, the one benchmarks/peers.py installs: nncf, onnx, onnxruntime).

Data-free by default: weights only, NNCF's defaults except the mode and, for the 4-bit modes, the
group size (32, the block size of the ONNX Runtime rows it is compared with). With `--data` (the
calibration windows qtool uses) and `--ratio`: data-aware, AWQ and scale estimation on, the
given share of the 4-bit layers at 4 bits (the rest at NNCF's backup INT8_ASYM), ranked by
NNCF's default data-aware sensitivity metric. NNCF's default for 4-bit keeps
the embedding and the last layer at its backup precision (INT8_ASYM, per channel); `--all-layers`
changes that.

Tied lm_head: the exports store a tied embedding once, so the lm_head MatMul's weight is
Transpose(embedding), not an initializer. NNCF 3.4 takes such a MatMul for a weighted one and then
fails to find its weight ("ValidationError: There is no tensor with the name val_4601"), so every
MatMul / Gemm whose weight comes through a Transpose of an initializer goes into NNCF's
ignored_scope (it stays float, as it does in ONNX Runtime's MatMulNBits rows, which skip it for
the same reason); the settings list those nodes.

Writes the settings it really used, versions and its own CPU seconds to `--result` (the same
JSON contract as the other runners, see _handoff.main); peak RSS and wall time are
measured from outside (benchmarks/_measure.run_measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402

MODES = ("int4_sym", "int4_asym", "int8_asym", "int8_sym")


def transposed_weight_matmuls(model) -> list[str]:
    """Names of the MatMul / Gemm nodes whose second input is a Transpose of an initializer."""
    initializers = {t.name for t in model.graph.initializer}
    transposes = {
        n.output[0]
        for n in model.graph.node
        if n.op_type == "Transpose" and n.input[0] in initializers
    }
    return [
        n.name
        for n in model.graph.node
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in transposes
    ]


def dataset(path: Path, inputs: set[str]):
    """nncf.Dataset of one feed per calibration window ([1, length] each, the decoder's inputs
    as the npz holds them for n windows; its other arrays, such as the labels, are left out)."""
    import nncf
    import numpy as np

    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files if name in inputs}
    count = len(next(iter(arrays.values())))
    return nncf.Dataset([{k: v[i : i + 1] for k, v in arrays.items()} for i in range(count)])


def compress(
    model_path: Path,
    out: Path,
    mode: str,
    group_size: int,
    all_layers: bool,
    data: Path | None = None,
    ratio: float = 1.0,
) -> dict:
    import nncf
    import onnx

    model = onnx.load(str(model_path))
    transposed = transposed_weight_matmuls(model)
    options: dict = {"mode": getattr(nncf.CompressWeightsMode, mode.upper())}
    if transposed:
        options["ignored_scope"] = nncf.IgnoredScope(names=transposed)
    if mode.startswith("int4"):
        options.update(group_size=group_size, ratio=ratio, all_layers=all_layers)
    if data is not None:  # data-aware: NNCF's best 4-bit recipe for LLMs
        inputs = {i.name for i in model.graph.input}
        options.update(dataset=dataset(data, inputs), awq=True, scale_estimation=True)
    compressed = nncf.compress_weights(model, **options)
    onnx.save(compressed, str(out))
    settings = {
        "api": "nncf.compress_weights (ONNX backend, data-free)",
        "mode": mode.upper(),
        "ignored_scope": transposed,
        "ignored_because": "weight is Transpose(initializer) (tied lm_head); NNCF 3.4 fails on it",
    }
    if data is not None:
        settings.update(
            api="nncf.compress_weights (ONNX backend, data-aware)",
            dataset=f"{data.name}: the windows qtool calibrates on",
            awq=True,
            scale_estimation=True,
            sensitivity_metric="NNCF default for data-aware (hessian input activation)",
        )
    if mode.startswith("int4"):
        settings.update(
            group_size=group_size,
            ratio=ratio,
            all_layers=all_layers,
            backup_mode="INT8_ASYM (NNCF default: embedding and last layer)",
        )
    else:
        settings["granularity"] = "per channel (NNCF default for 8-bit)"
    return settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NNCF weight compression of an ONNX decoder")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--all-layers", action="store_true")
    p.add_argument("--data", type=Path, help="calibration feeds (.npz): data-aware AWQ + SE")
    p.add_argument("--ratio", type=float, default=1.0, help="4-bit share (rest: backup mode)")
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args(argv)
    packages = ("nncf", "onnx", "onnxruntime", "numpy")
    result: dict = {
        "versions": {pkg: _handoff.version(pkg) for pkg in packages},
        "python": platform.python_version(),
    }
    wall = time.perf_counter()
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["settings"] = compress(
            args.model,
            args.out,
            args.mode,
            args.group_size,
            args.all_layers,
            args.data,
            args.ratio,
        )
        if not args.out.is_file():
            raise RuntimeError(f"nncf returned but wrote no model at {args.out}")
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the reason goes into the JSON, the trace to stderr
        traceback.print_exc()
        result["status"] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    result["wall_s"] = time.perf_counter() - wall
    own = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = own.ru_utime + own.ru_stime
    args.result.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
