"""Side-by-side accuracy benchmark: qtool vs ONNX Runtime's quantize_static on the real examples.

calibration.py measures speed and memory on random-weight models, where "accuracy" means nothing;
this one answers the other question a user has: on a real trained model with real data, does
qtool's quantized model stay as close to FP32 as ONNX Runtime's own quantizer does? Both tools
start from the same float graph (the `model.fp32.onnx` qtool writes), see the same calibration
batches and are judged on the same held-out evaluation set by the same code
(`qtool.evaluate.evaluate_models`). See benchmarks/README.md.

    python -m benchmarks.accuracy --examples digits,minilm --methods minmax,entropy,percentile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.calibration import machine_info, save_json
from qtool.data import Batch, iter_batches
from qtool.evaluate import EvalResult, evaluate_models
from qtool.pipeline import quantize
from qtool.recipe import Recipe, load_recipe

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = {
    "digits": REPO / "examples" / "digits" / "recipe.yaml",
    "minilm": REPO / "examples" / "minilm" / "recipe.yaml",
}
METHODS = ("minmax", "entropy", "percentile")
PERCENTILE = 99.99
TOOLS = ("ort", "qtool")


# --------------------------------------------------------------------------- data


def equal_batch_size(samples: int, preferred: int) -> int:
    """The largest batch size <= the recipe's that divides the sample count.

    ORT's percentile calibrator stacks the per-batch activations at the end and fails when the
    last batch is shorter, so every batch must have the same size; picking a divisor keeps every
    sample without padding or dropping any. qtool is given the same size so
    both tools see literally the same batches (its statistics do not depend on it anyway).
    """
    return next(b for b in range(min(preferred, samples), 0, -1) if samples % b == 0)


def calibration_batches(recipe: Recipe, batch_size: int) -> list[Batch]:
    """The recipe's calibration set through qtool's own reader (same validation, same order)."""
    spec = recipe.calibration
    return list(iter_batches(spec.data, recipe.inputs, batch_size, spec.max_samples, recipe.seed))


def count_samples(recipe: Recipe) -> int:
    spec = recipe.calibration
    batches = iter_batches(spec.data, recipe.inputs, spec.batch_size, spec.max_samples, recipe.seed)
    return sum(len(b) for b in batches)


def evaluation_pairs(recipe: Recipe) -> Iterator[tuple[dict, object]]:
    """A fresh pass over the evaluation set (a generator is consumed by one evaluation)."""
    spec = recipe.evaluation
    for batch in iter_batches(spec.data, recipe.inputs, spec.batch_size, None, recipe.seed):
        yield batch.inputs, batch.labels


# --------------------------------------------------------------------------- the two tools


def run_qtool(recipe: Recipe) -> tuple[Path, Path]:
    """qtool's whole pipeline in-process (prepare, calibrate, ranges, QDQ); returns (fp32, int8)."""
    result = quantize(recipe, progress=False)
    return recipe.float_model_path, result.model_path


def run_ort(
    fp32: Path,
    batches: list[Batch],
    method: str,
    op_types: list[str],
    out: Path,
    skip_symbolic_shape: bool = False,
) -> Path:
    """ORT's documented flow: quant_pre_process, then quantize_static with the settings that match
    qtool's ort-cpu target (QDQ, uint8 activations, int8 per-channel weights, same op types);
    every other option at ORT's default (entropy: 128 bins; percentile: 2048 bins, symmetric).
    `skip_symbolic_shape`: ORT's symbolic shape inference fails on some opset-21 graphs (an
    Expand that int8 embedding tables need), so pre-processing can leave it out."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict | None:
            batch = next(self._it, None)
            return None if batch is None else batch.inputs

    calibrate_method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    extra = {"CalibPercentile": PERCENTILE} if method == "percentile" else {}
    out.mkdir(parents=True, exist_ok=True)
    pre = out / "model.preprocessed.onnx"
    model = out / "model.int8.onnx"
    # ORT's calibrators print their progress with print(): keep it out of the table, in a log.
    with open(out / "ort.log", "w") as log, contextlib.redirect_stdout(log):
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=skip_symbolic_shape)
        quantize_static(
            str(pre),
            str(model),
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=op_types,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=calibrate_method,
            extra_options=extra,
        )
    return model


def _timed(fn, *args) -> tuple[object, float]:
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


def _failure(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]


def run_one(example: str, method: str, base: Recipe, batch_size: int, work: Path, args) -> dict:
    """One (example, method) row. A tool that raises becomes a `failed: ...` cell (the traceback
    goes to the work folder) so one crash does not hide the other rows."""
    run_dir = work / example / method
    shutil.rmtree(run_dir, ignore_errors=True)  # earlier outputs must never count as this run's
    calibration = dataclasses.replace(
        base.calibration, method=method, percentile=PERCENTILE, batch_size=batch_size
    )
    recipe = dataclasses.replace(base, calibration=calibration, output_dir=run_dir / "qtool")
    row: dict = {"example": example, "method": method, "qtool": {}, "ort": {}}
    models: dict[str, Path] = {}
    try:
        (fp32, qmodel), seconds = _timed(run_qtool, recipe)
        models["qtool"] = qmodel
        row["qtool"] = {"status": "ok", "model": str(qmodel), "quantize_s": seconds}
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        row["qtool"] = {"status": _failure(exc)}
        _log_traceback(run_dir / "qtool.error.txt")
        return row  # no float model means no common starting point for ORT either
    row["fp32_model"] = str(fp32)
    row["fp32_sha256"] = hashlib.sha256(fp32.read_bytes()).hexdigest()
    try:
        batches = calibration_batches(recipe, batch_size)
        op_types = list(recipe.quantization.op_types)
        omodel, seconds = _timed(run_ort, fp32, batches, method, op_types, run_dir / "ort")
        models["ort"] = omodel
        row["ort"] = {"status": "ok", "model": str(omodel), "quantize_s": seconds}
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        row["ort"] = {"status": _failure(exc)}
        _log_traceback(run_dir / "ort.error.txt")
    fp32_metrics = None
    for tool, path in models.items():
        try:
            result = evaluate_models(
                fp32,
                path,
                evaluation_pairs(recipe),
                threads=args.threads,
                latency_runs=args.latency_runs,
                progress=False,
            )
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            row[tool]["status"] = f"evaluation {_failure(exc)}"
            _log_traceback(run_dir / f"{tool}.eval.error.txt")
            continue
        row[tool]["eval"] = result.to_dict()
        # The FP32 side of both evaluations is the same model on the same data: one number.
        if fp32_metrics is None:
            fp32_metrics = {"accuracy": result.fp32.accuracy, "samples": result.samples}
        elif fp32_metrics["accuracy"] != result.fp32.accuracy:
            raise AssertionError("FP32 accuracy differs between two evaluations of one model")
        row[tool]["metrics"] = _metrics(result)
    row["fp32"] = fp32_metrics or {}
    row["closer"] = {m: _closer(row, m) for m in _metric_names(row)}
    return row


def _log_traceback(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(traceback.format_exc())


# --------------------------------------------------------------------------- metrics

# metric key -> (table label, number format); which way is closer to FP32 is in _closer
_FORMATS = {
    "accuracy": ("top-1 accuracy", "{:.2%}"),
    "agreement": ("top-1 agreement", "{:.2%}"),
    "cosine": ("embedding cosine", "{:.5f}"),
    "sqnr_db": ("SQNR dB", "{:.2f}"),
}


def _metrics(result: EvalResult) -> dict:
    """The numbers compared: accuracy (with its drop) when labelled, else cosine; SQNR always."""
    if result.has_labels:
        return {
            "accuracy": result.quant.accuracy,
            "drop_points": result.accuracy_drop_points(),
            "agreement": result.agreement,
            "sqnr_db": result.sqnr_db,
        }
    return {"cosine": result.cosine, "sqnr_db": result.sqnr_db}


def _metric_names(row: dict) -> list[str]:
    names: list[str] = []
    for tool in TOOLS:
        for key in row[tool].get("metrics", {}):
            if key in _FORMATS and key not in names:
                names.append(key)
    return names


def _closer(row: dict, metric: str) -> str:
    """Which quantized model is closer to FP32 on `metric`; "tie" when the two are equal at the
    precision the table prints (a difference nobody can see is not a win).

    Accuracy is closer when |FP32 - quantized| is smaller (a quantized model that happens to score
    higher than FP32 is not "better" at reproducing it); agreement, cosine and SQNR are
    quantized-vs-FP32 measures where higher is closer."""
    values = {t: row[t].get("metrics", {}).get(metric) for t in TOOLS}
    if any(v is None for v in values.values()):
        return "-"
    fmt = _FORMATS[metric][1]
    if fmt.format(values["ort"]) == fmt.format(values["qtool"]):
        return "tie"
    if metric == "accuracy":
        ref = row["fp32"]["accuracy"]
        score = {t: -abs(ref - v) for t, v in values.items()}
    else:
        score = values
    return max(TOOLS, key=lambda t: score[t])


# --------------------------------------------------------------------------- output


def _cell(row: dict, tool: str, metric: str) -> str:
    side = row[tool]
    if side.get("status", "ok") != "ok":
        return "[red]failed[/red]"
    value = side.get("metrics", {}).get(metric)
    if value is None:
        return "-"
    text = _FORMATS[metric][1].format(value)
    if metric == "accuracy":
        text += f" ({-side['metrics']['drop_points'] + 0.0:+.2f})"
    return text


def print_table(console: Console, report: dict) -> None:
    t = Table(
        title="Accuracy vs FP32: ONNX Runtime quantize_static vs qtool (same float model, "
        "same calibration batches, same evaluation set)"
    )
    for col in ("example", "method", "metric", "FP32", "ORT", "qtool", "closer to FP32"):
        t.add_column(col, justify="left" if col in ("example", "method", "metric") else "right")
    for row in report["runs"]:
        names = _metric_names(row) or ["-"]
        for i, metric in enumerate(names):
            label = _FORMATS[metric][0] if metric in _FORMATS else "-"
            fp32 = "-"
            if metric == "accuracy":
                fp32 = _FORMATS["accuracy"][1].format(row["fp32"]["accuracy"])
            elif metric in _FORMATS:
                fp32 = "1.00000" if metric == "cosine" else ("inf" if metric == "sqnr_db" else "-")
            method = row["method"] + (f" ({PERCENTILE})" if row["method"] == "percentile" else "")
            closer = row.get("closer", {}).get(metric, "-")
            t.add_row(
                row["example"] if i == 0 else "",
                method if i == 0 else "",
                label,
                fp32,
                _cell(row, "ort", metric) if metric in _FORMATS else _status(row, "ort"),
                _cell(row, "qtool", metric) if metric in _FORMATS else _status(row, "qtool"),
                f"[bold]{closer}[/bold]" if closer in TOOLS else closer,
                end_section=i == len(names) - 1,
            )
    console.print(t)
    if any("accuracy" in _metric_names(r) for r in report["runs"]):
        console.print("  top-1 accuracy: quantized top-1 (change in points vs FP32)")
    console.print(
        "  closer to FP32: smaller |change| for accuracy, higher for agreement, cosine and SQNR; "
        "tie = equal as printed"
    )
    for name, info in report["examples"].items():
        console.print(
            f"  {name}: {info['calibration_samples']} calibration samples in "
            f"{info['calibration_samples'] // info['batch_size']} batches of "
            f"{info['batch_size']} (recipe: {info['recipe_batch_size']}), "
            f"{info.get('evaluation_samples', '?')} evaluation samples"
        )
    failures = [
        f"  {r['example']} {r['method']} {tool}: {r[tool]['status']}"
        for r in report["runs"]
        for tool in TOOLS
        if r[tool] and r[tool].get("status") != "ok"
    ]
    if failures:
        console.print("[red]Failures (tracebacks under the work folder):[/red]")
        for line in failures:
            console.print(line, markup=False)


def _status(row: dict, tool: str) -> str:
    return "[red]failed[/red]" if row[tool].get("status", "ok") != "ok" else "-"


def versions() -> dict:
    """machine_info() from the calibration benchmark plus the packages this one also uses."""
    import sklearn
    import transformers

    import qtool

    return {
        **machine_info(),
        "qtool": qtool.__version__,
        "scikit-learn": sklearn.__version__,
        "transformers": transformers.__version__,
    }


# --------------------------------------------------------------------------- main


def _csv(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        if not items or not set(items) <= set(choices):
            raise argparse.ArgumentTypeError(f"expected a comma list from {list(choices)}")
        return list(dict.fromkeys(items))

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--examples", type=_csv(tuple(EXAMPLES)), default=list(EXAMPLES))
    p.add_argument("--methods", type=_csv(METHODS), default=list(METHODS))
    p.add_argument("--latency-runs", type=int, default=10, help="per evaluation (not the point)")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (evaluation)")
    p.add_argument("--json", type=Path, default=RESULTS / "accuracy.json")
    p.add_argument("--work", type=Path, default=RESULTS / "accuracy", help="models and outputs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 140  # piped into a log: do not wrap the table at 80 columns
    work = args.work.resolve()
    report: dict = {
        "versions": versions(),
        "settings": {
            "examples": args.examples,
            "methods": args.methods,
            "percentile": PERCENTILE,
            "latency_runs": args.latency_runs,
            "threads": args.threads,
            "qtool": "qtool.pipeline.quantize(recipe with calibration.method replaced)",
            "ort": "quant_pre_process(qtool's model.fp32.onnx) + quantize_static(QDQ, QUInt8 "
            "activations, QInt8 per-channel weights, the recipe's op types, CalibPercentile "
            f"{PERCENTILE} for percentile, other options at ORT's defaults)",
        },
        "examples": {},
        "runs": [],
    }
    failed = False
    for example in args.examples:
        recipe_path = EXAMPLES[example]
        base = load_recipe(recipe_path, output_dir=work / example / "unused")
        samples = count_samples(base)
        batch_size = equal_batch_size(samples, base.calibration.batch_size)
        info = {
            "recipe": str(recipe_path.relative_to(REPO)),
            "recipe_method": base.calibration.method,
            "op_types": list(base.quantization.op_types),
            "calibration_samples": samples,
            "batch_size": batch_size,
            "recipe_batch_size": base.calibration.batch_size,
        }
        report["examples"][example] = info
        for method in args.methods:
            with console.status(f"{example} {method}: qtool, ORT, evaluation"):
                row = run_one(example, method, base, batch_size, work, args)
            report["runs"].append(row)
            for tool in TOOLS:
                evaluated = row[tool].get("eval")
                if evaluated:
                    info["evaluation_samples"] = evaluated["samples"]
            failed |= any(row[t].get("status") != "ok" for t in TOOLS)
            save_json(report, args.json)
            console.log(
                f"{example} {method}: "
                + ", ".join(
                    f"{t} {row[t].get('status', '-')}"
                    + (f" ({row[t]['quantize_s']:.1f} s)" if "quantize_s" in row[t] else "")
                    for t in TOOLS
                )
            )
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save_json(report, args.json)
    print_table(console, report)
    console.print(f"JSON: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
