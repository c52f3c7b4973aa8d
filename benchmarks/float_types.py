"""FP16 and FP8 against NVIDIA ModelOpt on the same files (issue 20).

For each example, qtool writes its float model (`model.fp32.onnx`) and quantizes it:

- FP16: nothing quantized, `quantization.float_type: fp16` (the typing pass and its keep rules);
  ModelOpt: AutoCast `convert_to_mixed_precision(low_precision_type="fp16")`, I/O kept FP32;
- FP8: the `fp8-tensorrt` settings (FP8 E4M3 Q/DQ on the inputs of the Conv/Gemm/MatMul nodes
  TensorRT's FP8 kernels take, FP16 elsewhere) with min-max ranges (amax / 448) and with the MSE
  search on E4M3's grid; ModelOpt:
  `quantize(quantize_mode="fp8")` with its max and entropy calibrations (its FP16 elsewhere),
  from the FP8 run's float model and on the same calibration batches.

Every model is scored by qtool's `evaluate_models` against the same float model on the example's
evaluation set: FP16 fused and unfused, FP8 unfused only (ORT's CPU provider cannot run float8
fused). ModelOpt runs in its own venv (benchmarks/.peers/modelopt, as peers.py builds it).

    python -m benchmarks.float_types --examples digits,minilm,effnet_lite
    # after a change to qtool only: ModelOpt's models from the last run, if made on the same
    # float-model bytes (else it runs again)
    python -m benchmarks.float_types --examples effnet_lite --reuse-modelopt
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

import onnx
from onnx import TensorProto
from rich.console import Console
from rich.table import Table

from benchmarks.accuracy import EXAMPLES, calibration_batches, evaluation_pairs, versions
from benchmarks.peer_runners._handoff import save_batches
from benchmarks.peers import PEER_ROOT, PEERS, Peer, peer_python, run_runner
from qtool.app.quantize import quantize
from qtool.config.recipe import Recipe, load_recipe
from qtool.metrics.evaluate import evaluate_models
from qtool.metrics.signal import json_float
from qtool.plan.settings import QuantizationSpec
from qtool.runtime.bf16_emulation import emulated
from qtool.write.float_type import type_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# ModelOpt's FP8 and FP16 runner (benchmarks/peer_runners/run_modelopt_float.py), in the venv
# peers.py builds for ModelOpt.
MODELOPT = Peer("modelopt_float", "ModelOpt", PEERS["modelopt"].packages, needs_torch=True)
MODELOPT_VENV = "modelopt"
FP8_OPS = ("Conv", "Gemm", "MatMul")
# The SHA-256 of the float model a ModelOpt run quantized, beside its output (--reuse-modelopt).
FROM_FILE = "from_fp32.sha256"


def _fp16(spec: QuantizationSpec) -> QuantizationSpec:
    return dataclasses.replace(
        spec, target="tensorrt", op_types=(), precision=None, float_type="fp16", overrides=()
    )


def _fp8(spec: QuantizationSpec) -> QuantizationSpec:
    return dataclasses.replace(
        spec, target="tensorrt", op_types=FP8_OPS, precision="fp8", float_type="fp16"
    )


# label -> (quantization, calibration method or None for the recipe's)
QTOOL_RUNS = {
    "qtool fp16": (_fp16, None),
    "qtool fp8 (minmax)": (_fp8, "minmax"),
    "qtool fp8 (mse)": (_fp8, "mse"),
}
MODELOPT_RUNS = {
    "ModelOpt fp16 (AutoCast)": ("fp16", "max", "qtool fp16"),
    "ModelOpt fp8 (max)": ("fp8", "max", "qtool fp8 (minmax)"),
    "ModelOpt fp8 (entropy)": ("fp8", "entropy", "qtool fp8 (minmax)"),
}
# After ModelOpt's FP8 run: qtool FP8 on exactly the nodes ModelOpt quantized (it leaves some in
# FP16 by its TensorRT-guided rules), the others excluded, so the SQNRs compare like for like.
SAME_NODES = "qtool fp8 (minmax, ModelOpt's nodes)"


def quantized_nodes(path: Path) -> list[str]:
    """The Conv/Gemm/MatMul nodes of a model whose data input and second input (the weight, or
    attention's other activation) both come from a DequantizeLinear, directly or through the
    typing pass's Cast to FP16 (a weight whose scale FP16 cannot hold): a node reading a
    quantized tensor with a float weight (an FP16 depthwise Conv after a quantized output) does
    not count."""
    model = onnx.load(str(path), load_external_data=False)
    producer = {out: node for node in model.graph.node for out in node.output}

    def dequantized(name: str) -> bool:
        source = producer.get(name)
        if source is not None and source.op_type == "Cast":
            source = producer.get(source.input[0])
        return source is not None and source.op_type == "DequantizeLinear"

    return [
        node.name
        for node in model.graph.node
        if node.op_type in FP8_OPS and len(node.input) > 1 and all(map(dequantized, node.input[:2]))
    ]


def _recipe(base: Recipe, label: str, folder: Path) -> Recipe:
    change, method = QTOOL_RUNS[label]
    calibration = base.calibration
    if method is not None:
        calibration = dataclasses.replace(calibration, method=method)
    return dataclasses.replace(
        base,
        quantization=change(base.quantization),
        calibration=calibration,
        algorithms=type(base.algorithms)(),
        mixed_precision=None,
        output_dir=folder,
    )


def _score(fp32: Path, model: Path, recipe: Recipe, foreign: bool) -> dict:
    result = evaluate_models(
        fp32,
        model,
        evaluation_pairs(recipe),
        allow_foreign_fp32=foreign,
        latency_runs=1,
        progress=False,
    )
    gated = result.gated()
    scores = {}
    for variant in ("fused", "unfused"):
        metrics = gated.variant(variant)
        if metrics is not None:
            scores[variant] = {
                "sqnr_db": json_float(metrics.sqnr_db),
                "cosine": metrics.cosine,
                "agreement": metrics.agreement,
                "accuracy": metrics.accuracy,
            }
    return {
        "scores": scores,
        "judged": result.judged_variant,
        "unfused_only": result.unfused_only,
        "size_bytes": result.quant.file_bytes,
        "fp32_bytes": result.fp32.file_bytes,
        "fp32_accuracy": result.fp32.accuracy,
        "samples": result.samples,
    }


def _storage_sqnr(fp32: Path, model: Path, recipe: Recipe) -> float | str:
    """The FP16 file with every FP16 tensor rounded after the op that writes it, FP32
    arithmetic: what strong typing stores. ORT's CPU provider runs FP16 ops it has no kernel
    for in FP32 between Casts it inserts, and drops the Casts between two such ops, so its own
    FP16 numbers keep more than the file's types say."""
    path = model.with_name(model.stem + ".storage.onnx")
    onnx.save(emulated(onnx.load(str(model)), TensorProto.FLOAT16), str(path))
    scored = _score(fp32, path, recipe, True)
    return scored["scores"][scored["judged"]]["sqnr_db"]


def _fp16_limit(example: str, recipe: Recipe, work: Path) -> dict:
    """FP32's own FP16 rounding limit: every node of the float model typed FP16 by the typing
    pass and every FP16 tensor and weight rounded, the arithmetic in FP32 (no kernel's own
    rounding): the bar an FP16 file is held to. The typing pass's structural keep rules still
    apply (normalizations and summing reductions stay FP32; with no calibrated ranges the
    overflow rules cannot), so a qtool FP16 file whose only kept nodes are those lands on it
    exactly; a limit with nothing kept at all is not what this measures."""
    row = {"example": example, "label": "FP16 rounding limit (storage)", "method": "-"}
    folder = work / example / "fp16_limit"
    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(recipe.float_model_path))
    every = {node.name: "fp16" for node in model.graph.node}
    typed = type_model(model, every, "fp16", {}, {}).model
    path = folder / "limit.onnx"
    onnx.save(emulated(typed, TensorProto.FLOAT16), str(path))
    row.update(_score(recipe.float_model_path, path, recipe, True))
    row["storage_sqnr_db"] = row["scores"][row["judged"]]["sqnr_db"]
    return row


def run_example(example: str, work: Path, args, console: Console) -> list[dict]:
    base = load_recipe(EXAMPLES[example])
    rows: list[dict] = []
    float_models: dict[str, Path] = {}
    recipes: dict[str, Recipe] = {}
    for label in QTOOL_RUNS:
        folder = work / example / label.replace(" ", "_").replace("(", "").replace(")", "")
        shutil.rmtree(folder, ignore_errors=True)
        recipe = _recipe(base, label, folder)
        row = {"example": example, "label": label, "method": recipe.calibration.method}
        started = time.perf_counter()
        try:
            result = quantize(recipe, progress=False)
            row["seconds"] = time.perf_counter() - started
            row.update(_score(recipe.float_model_path, result.model_path, recipe, False))
            report = result.report
            row["float_type"] = report.get("float_type")
            row["tensorrt_placement_passed"] = report["tensorrt"]["placement"]["passed"]
            row["quantized_nodes"] = len(quantized_nodes(result.model_path))
            if label == "qtool fp16":
                row["storage_sqnr_db"] = _storage_sqnr(
                    recipe.float_model_path, result.model_path, recipe
                )
        except Exception as exc:  # noqa: BLE001 - a failed row says why
            row["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        float_models[label], recipes[label] = recipe.float_model_path, recipe
        rows.append(row)
        console.print(_line(row), highlight=False)
        if label == "qtool fp16" and "status" not in row:
            limit = _fp16_limit(example, recipe, work)
            rows.append(limit)
            console.print(_line(limit), highlight=False)
    try:
        python = peer_python(PEERS[MODELOPT_VENV], args.peer_root, args.install_timeout)
    except RuntimeError as exc:
        rows.append({"example": example, "label": "ModelOpt", "status": f"install: {exc}"})
        return rows
    for label, (mode, method, source) in MODELOPT_RUNS.items():
        folder = work / example / label.replace(" ", "_").replace("(", "").replace(")", "")
        recipe = recipes[source]
        fp32 = float_models[source]
        row = {"example": example, "label": label, "method": method, "from": source}
        try:
            earlier = _earlier_run(folder, fp32) if args.reuse_modelopt else None
            if earlier is not None:
                model, info = earlier
                row["seconds"], row["reused"] = info.get("wall_s"), True
            else:
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                data = folder / "calibration.npz"
                batches = calibration_batches(recipe, recipe.calibration.batch_size)
                save_batches(data, [b.inputs for b in batches])
                started = time.perf_counter()
                model, info, _ = run_runner(
                    MODELOPT,
                    python,
                    fp32,
                    data,
                    folder,
                    "cnn" if example != "minilm" else "transformer",
                    args.timeout,
                    extra=("--mode", mode, "--method", method),
                )
                row["seconds"] = time.perf_counter() - started
                (folder / FROM_FILE).write_text(_sha256(fp32))
            row["settings"], row["versions"] = info.get("settings"), info.get("versions")
            row.update(_score(fp32, model, recipe, True))
            row["quantized_nodes"] = len(quantized_nodes(model))
            if mode == "fp16":
                row["storage_sqnr_db"] = _storage_sqnr(fp32, model, recipe)
        except Exception as exc:  # noqa: BLE001 - a failed row says why
            row["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        console.print(_line(row), highlight=False)
        if label == "ModelOpt fp8 (max)" and "status" not in row:
            same = _same_nodes(example, recipes["qtool fp8 (minmax)"], model, work)
            rows.append(same)
            console.print(_line(same), highlight=False)
    return rows


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _earlier_run(folder: Path, fp32: Path) -> tuple[Path, dict] | None:
    """ModelOpt's model and result from an earlier run in `folder`, if it succeeded on these
    very float-model bytes (qtool's export is deterministic), else None (run it again)."""
    model, result, stamp = folder / "model.quant.onnx", folder / "runner.json", folder / FROM_FILE
    if not (model.is_file() and result.is_file() and stamp.is_file()):
        return None
    if stamp.read_text().strip() != _sha256(fp32):
        return None
    info = json.loads(result.read_text())
    return (model, info) if info.get("status") == "ok" else None


def _same_nodes(example: str, base: Recipe, modelopt: Path, work: Path) -> dict:
    """qtool FP8 (min-max) on the nodes ModelOpt quantized, the other weighted nodes excluded."""
    folder = work / example / "qtool_fp8_same_nodes"
    shutil.rmtree(folder, ignore_errors=True)
    chosen = set(quantized_nodes(modelopt))
    float_model = onnx.load(str(base.float_model_path), load_external_data=False)
    others = [
        n.name for n in float_model.graph.node if n.op_type in FP8_OPS and n.name not in chosen
    ]
    quantization = dataclasses.replace(base.quantization, exclude=tuple(others))
    recipe = dataclasses.replace(base, quantization=quantization, output_dir=folder)
    row = {"example": example, "label": SAME_NODES, "method": recipe.calibration.method}
    try:
        result = quantize(recipe, progress=False)
        row.update(_score(recipe.float_model_path, result.model_path, recipe, False))
        row["quantized_nodes"] = len(quantized_nodes(result.model_path))
    except Exception as exc:  # noqa: BLE001 - a failed row says why
        row["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return row


def _line(row: dict) -> str:
    if "status" in row:
        return f"{row['example']:12} {row['label']:28} {row['status']}"
    judged = row["scores"][row["judged"]]
    ratio = row["fp32_bytes"] / row["size_bytes"]
    return (
        f"{row['example']:12} {row['label']:28} SQNR {judged['sqnr_db']} dB, cosine "
        f"{judged['cosine']:.5f} ({row['judged']}), {row['size_bytes'] / 1e6:.2f} MB "
        f"({ratio:.2f}x smaller)"
    )


def _db(value: float | str) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(console: Console, rows: list[dict]) -> None:
    table = Table(title="FP16 and FP8 vs ModelOpt (SQNR and cosine vs FP32; FP8 unfused on CPU)")
    columns = (
        "example",
        "run",
        "FP8 nodes",
        "SQNR dB",
        "FP16 stored",
        "cosine",
        "top-1 agr.",
        "size",
        "vs FP32",
    )
    for column in columns:
        table.add_column(column)
    for row in rows:
        if "status" in row:
            table.add_row(row["example"], row["label"], "", row["status"], *[""] * 5)
            continue
        judged = row["scores"][row["judged"]]
        agreement = judged["agreement"]
        table.add_row(
            row["example"],
            row["label"],
            str(row.get("quantized_nodes", "-")),
            _db(judged["sqnr_db"]),
            _db(row["storage_sqnr_db"]) if "storage_sqnr_db" in row else "-",
            f"{judged['cosine']:.5f}",
            "-" if agreement is None else f"{agreement * 100:.2f}%",
            f"{row['size_bytes'] / 1e6:.2f} MB",
            f"{row['fp32_bytes'] / row['size_bytes']:.2f}x smaller",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", default="digits,minilm,effnet_lite")
    p.add_argument("--peer-root", type=Path, default=PEER_ROOT)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--install-timeout", type=float, default=2400.0)
    p.add_argument("--json", type=Path, default=RESULTS / "float_types.json")
    p.add_argument("--work", type=Path, default=RESULTS / "float_types")
    p.add_argument(
        "--reuse-modelopt",
        action="store_true",
        help="score ModelOpt's models from an earlier run made on the same float-model bytes "
        "instead of running ModelOpt again (qtool's rows always run)",
    )
    args = p.parse_args(argv)
    console = Console()
    rows: list[dict] = []
    for example in [e.strip() for e in args.examples.split(",") if e.strip()]:
        rows.extend(run_example(example, args.work, args, console))
    print_table(console, rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=2, default=str))
    console.print(f"json -> {args.json}")


if __name__ == "__main__":
    main()
