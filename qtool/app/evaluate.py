"""The evaluate job: find the two models and the data, choose the gates, evaluate, judge, report.

Behind `qtool evaluate`, which only parses options and prints. Two ways in: a recipe (its float
and quantized models, its evaluation data and `evaluation:` settings) or explicit files (--fp32,
--quant, --data .npz). Every setting can come from the recipe or an option, and the option wins;
each keeps the words of where it came from for error messages. This is the one place of the
evaluate path that reads the Recipe (tests/test_architecture.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qtool.config.recipe import Recipe, load_recipe
from qtool.data.batches import iter_batches
from qtool.data.spec import DataSpec, InputSpec
from qtool.errors import DataError, ModelError, OutputError, RecipeError
from qtool.io import commit_files, not_a_file
from qtool.metrics.evaluate import Batch, evaluate_models
from qtool.metrics.gates import GateResult, Gates, judge_gates
from qtool.metrics.junit import junit_xml
from qtool.metrics.results import EvalResult
from qtool.metrics.spec import (
    GATE_METRICS,
    TOKEN_ROWS,
    EvaluationSpec,
    gate_problem,
    rows_problem,
)


@dataclass(frozen=True)
class EvaluateOptions:
    """The command line's settings; None means "not given" (the recipe's value, if any, holds).

    `rows` is the option's text, a comma-separated list of metrics/spec.py ROWS."""

    output: str | None = None
    metric: str | None = None
    max_drop: float | None = None
    min_cosine: float | None = None
    min_sqnr: float | None = None
    rows: str | None = None
    accuracy_level: int | None = None
    allow_foreign_fp32: bool = False
    threads: int | None = None
    latency_runs: int = 50
    progress: bool = True
    json_path: Path | None = None
    junit_path: Path | None = None


@dataclass
class Evaluation:
    """What the command prints: the result and every gate, judged."""

    result: EvalResult
    gates: list[GateResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates)


def _float_reference(recipe: Recipe) -> Path:
    """model.fp32.onnx, or the recipe's own ONNX model where quantize wrote no float copy (a
    model over 2 GB without `output.float_model: always`): the provenance check accepts the
    source model the quantized one records."""
    path = recipe.float_model_path
    source = recipe.model.onnx
    if not path.exists() and source is not None and Path(source).is_file():
        return Path(source)
    return path


def run(
    options: EvaluateOptions,
    recipe: Path | None = None,
    output_dir: Path | None = None,
    fp32: Path | None = None,
    quant: Path | None = None,
    data: Path | None = None,
    batch_size: int = 64,
) -> Evaluation:
    """Evaluate a recipe's models (`recipe`, `output_dir`) or explicit files (`fp32`, `quant`,
    `data`), judge the gates and write the requested JSON and JUnit reports."""
    rows = _check_options(options)
    _check_report_paths(options)
    if recipe is not None:
        if fp32 is not None or quant is not None or data is not None:
            raise RecipeError("evaluate takes a RECIPE or --fp32/--quant/--data, not both")
        loaded = load_recipe(recipe, output_dir)
        if loaded.evaluation is None:
            raise RecipeError(f"{recipe}: evaluation: is required for `qtool evaluate RECIPE`")
        spec: EvaluationSpec | None = loaded.evaluation
        fp32_path, quant_path = _float_reference(loaded), quantized_path(loaded)
        batches = iter_batches(spec.data, loaded.inputs, spec.batch_size, seed=loaded.seed)
        text = spec.data.text is not None
    else:
        if fp32 is None or quant is None or data is None:
            raise RecipeError("evaluate needs a RECIPE, or all of --fp32, --quant and --data")
        fp32_path, quant_path = fp32, quant
        batches = npz_batches(fp32, data, batch_size)
        spec = None  # no recipe: only the options set gates
        text = False

    def choose(key: str, flag_value):
        """The option when given (it overrides the recipe), else the recipe's value; with where
        it came from, for error messages."""
        if flag_value is not None or spec is None:
            return flag_value, f"--{key.replace('_', '-')}"
        return getattr(spec, key), f"{recipe}: evaluation.{key}"

    chosen_output, output_where = choose("output", options.output)
    chosen_metric, metric_where = choose("metric", options.metric)
    max_drop, max_drop_where = choose("max_drop", options.max_drop)
    chosen_rows, rows_where = choose("rows", rows)
    gates = Gates(
        metric=chosen_metric,
        max_drop=max_drop,
        min_cosine=choose("min_cosine", options.min_cosine)[0],
        min_sqnr=choose("min_sqnr", options.min_sqnr)[0],
        max_drop_source=max_drop_where,
    )
    labels_required_by = None
    if chosen_metric in ("accuracy", "perplexity"):
        labels_required_by = metric_source(metric_where, chosen_metric)
    elif chosen_rows is not None:
        wanted = [row for row in ("accuracy", *TOKEN_ROWS) if row in chosen_rows]
        if wanted:
            labels_required_by = metric_source(rows_where, wanted[0])
    # Next-token scoring: on text (its labels are the next tokens), or when asked for by name.
    token_labels = text or chosen_metric == "perplexity"
    token_labels |= chosen_rows is not None and bool(set(chosen_rows) & set(TOKEN_ROWS))
    result = evaluate(
        fp32_path,
        quant_path,
        batches,
        output=chosen_output,
        output_where=output_where,
        labels_required_by=labels_required_by,
        allow_foreign_fp32=options.allow_foreign_fp32,
        threads=options.threads,
        latency_runs=options.latency_runs,
        progress=options.progress,
        accuracy_level=choose("accuracy_level", options.accuracy_level)[0],
        rows=chosen_rows,
        token_labels=token_labels,
    )
    evaluation = Evaluation(result, judge_gates(result, gates))
    write_reports(evaluation, options.json_path, options.junit_path)
    return evaluation


def _check_options(options: EvaluateOptions) -> tuple[str, ...] | None:
    """Refuse unusable option values with the words the recipe reader uses; the parsed rows."""
    flags = {
        "max_drop": options.max_drop,
        "min_cosine": options.min_cosine,
        "min_sqnr": options.min_sqnr,
    }
    for key, value in flags.items():
        problem = None if value is None else gate_problem(key, value)
        if problem is not None:
            raise RecipeError(f"--{key.replace('_', '-')}: {problem}")
    if options.metric is not None and options.metric not in GATE_METRICS:
        raise RecipeError(
            f"--metric: must be one of {', '.join(GATE_METRICS)}, got {options.metric!r}"
        )
    if options.rows is None:
        return None
    rows = tuple(part.strip() for part in options.rows.split(",") if part.strip())
    problem = rows_problem(rows)
    if problem is not None:
        raise RecipeError(f"--rows: {problem}")
    return rows


def metric_source(where: str, metric: str) -> str:
    """'--metric accuracy' or 'recipe.yaml: evaluation.metric: accuracy', as the user wrote it."""
    return f"{where} {metric}" if where.startswith("--") else f"{where}: {metric}"


def evaluate(fp32_path: Path, quant_path: Path, batches, **options) -> EvalResult:
    """Evaluate recipe-style batches (qtool.data.batches.Batch); `options` go to evaluate_models."""
    for path in (fp32_path, quant_path):
        problem = not_a_file(path, "model file")
        if problem is not None:
            advice = " (run `qtool quantize` first)" if not Path(path).exists() else ""
            raise ModelError(f"{path}: {problem}{advice}")
    pairs: Iterable[Batch] = ((batch.inputs, batch.labels) for batch in batches)
    return evaluate_models(Path(fp32_path), Path(quant_path), pairs, **options)


def write_reports(evaluation: Evaluation, json_path: Path | None, junit_path: Path | None) -> None:
    """Both reports or neither (one commit): a CI job never reads a JSON of this run beside a
    JUnit file of the last one."""
    files: dict[Path, bytes] = {}
    if json_path is not None:
        report = evaluation.result.to_dict(evaluation.gates)
        files[json_path] = (json.dumps(report, indent=2, allow_nan=False) + "\n").encode()
    if junit_path is not None:
        files[junit_path] = junit_xml(evaluation.result, evaluation.gates)
    commit_files(files)


def _check_report_paths(options: EvaluateOptions) -> None:
    """Refuse report paths that cannot be written before the models run (minutes on a large
    model), naming the option."""
    paths = {"--json": options.json_path, "--junit": options.junit_path}
    for option, path in paths.items():
        if path is not None and Path(path).is_dir():
            raise OutputError(f"{option} {path}: is a directory; name the report file")
    if options.json_path is not None and options.json_path == options.junit_path:
        raise OutputError(f"--json and --junit both name {options.json_path}")


def quantized_path(recipe: Recipe) -> Path:
    """The recipe's quantized model; after `quantize --auto`, the one report.json names (the
    chosen plan decides int4 or int8, or model.failed.onnx), in the recipe's output folder."""
    if recipe.report_path.is_file():
        try:
            report = json.loads(recipe.report_path.read_text())
        except (OSError, ValueError):
            return recipe.quant_model_path
        written = report.get("files", {}).get("quantized_model")
        if "mixed_precision" in report and isinstance(written, str):
            return recipe.output_dir / Path(written).name
    return recipe.quant_model_path


def npz_batches(model_path: Path, data: Path, batch_size: int):
    """Batches from an .npz keyed by the model's input names; the model declares the inputs.

    Symbolic dims (`[N, 3, H, W]`) stay symbolic, so data of any size along them is accepted
    (ORT checks it fits the graph), and a mismatch names the model file and its declared shape.
    """
    problem = not_a_file(model_path, "model file")
    if problem is not None:
        raise ModelError(f"--fp32 {model_path}: {problem}")
    problem = not_a_file(data, "data file")
    if problem is not None:
        raise DataError(f"--data {data}: {problem}")
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt file
        raise ModelError(f"{model_path}: not a readable ONNX model ({exc})") from None
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value.type.tensor_type.shape.dim
        )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        inputs.append(InputSpec(value.name, dims, dtype))
    spec = DataSpec(f"--data {data}", npz=data)
    return iter_batches(spec, tuple(inputs), batch_size, shapes_from=f"{model_path}")
