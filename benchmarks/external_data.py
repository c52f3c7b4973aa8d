"""A model over protobuf's 2 GB limit through `qtool quantize` and `qtool evaluate`: time and peak
memory against the model's size and against a bare ONNX Runtime session on the same model.

The model is generated (a MatMul + Relu chain, 8 x 8192 x 8192 float32 = 2.15 GB by default) and
stored with external data, as such models are shipped. Each command runs in its own measured
process (benchmarks._measure.run_measured: peak RSS is the kernel's high-water mark).

    python -m benchmarks.external_data [--layers 8] [--n 8192] [--cpu auto] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks._measure import run_measured

REPO = Path(__file__).resolve().parent.parent

# A bare ORT session on the float model, one batch: the floor any tool pays for running it.
_FLOOR = """
import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])["x"]
s.run(None, {"x": x})
"""


def write_model(folder: Path, n: int, layers: int) -> Path:
    """The generated chain, written with onnx's own external-data writer."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((n, n), dtype=np.float32)
        w *= 1.0 / np.sqrt(n)
        inits.append(numpy_helper.from_array(w, f"layer{i}.weight"))
        del w
        nodes += [
            helper.make_node("MatMul", [x, f"layer{i}.weight"], [f"h{i}"], name=f"/l{i}/MatMul"),
            helper.make_node("Relu", [f"h{i}"], [f"a{i}"], name=f"/l{i}/Relu"),
        ]
        x = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", n])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big.onnx"
    (folder / "big.onnx.data").unlink(missing_ok=True)  # onnx.save appends to an existing file
    onnx.save(model, str(path), save_as_external_data=True, location="big.onnx.data")
    x_data = rng.standard_normal((16, n)).astype(np.float32)
    np.savez(folder / "data.npz", x=x_data)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--cpu",
        default="auto",
        help="quantization.cpu: avx512-vnni skips the no-VNNI weight format search (its cost "
        "is per weight tensor, not external data's)",
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qtool-extdata-"))
    work.mkdir(parents=True, exist_ok=True)
    source = write_model(work, args.n, args.layers)
    model_bytes = sum(p.stat().st_size for p in (source, work / "big.onnx.data"))
    recipe = work / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"onnx": str(source)},
                "inputs": {"x": [1, args.n]},
                "calibration": {"data": {"npz": "data.npz"}, "batch_size": 8, "method": "minmax"},
                "evaluation": {"data": {"npz": "data.npz"}, "batch_size": 8},
                "quantization": {"cpu": args.cpu},
                "output": {"dir": "out"},
            }
        )
    )
    qtool = [sys.executable, "-m", "qtool.cli"]
    runs = {
        "ORT session + 1 batch (floor)": [
            sys.executable,
            "-c",
            _FLOOR,
            str(source),
            str(work / "data.npz"),
        ],
        "qtool quantize": [*qtool, "quantize", str(recipe), "--no-progress"],
        "qtool evaluate": [
            *qtool,
            "evaluate",
            str(recipe),
            "--no-progress",
            "--json",
            str(work / "eval.json"),
        ],
    }
    rows = {}
    for name, cmd in runs.items():
        m = run_measured(cmd, work / f"{name.split()[1]}.log", args.timeout, cwd=REPO)
        rows[name] = m.to_dict()
        if not m.ok:
            break
    gb = model_bytes / 1e9
    print(
        f"model: {gb:.2f} GB ({args.layers} x {args.n} x {args.n} float32), "
        f"quantization.cpu {args.cpu}, work dir {work}\n"
    )
    print("| run | status | wall s | CPU s | peak RSS GB | peak / model size |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        peak = r["peak_mb"] / 1024
        print(
            f"| {name} | {r['status']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {peak:.2f} | "
            f"{peak * 2**30 / model_bytes:.2f}x |"
        )
    (work / "external_data.json").write_text(
        json.dumps({"model_bytes": model_bytes, "runs": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
