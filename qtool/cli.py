"""The `qtool` command line: thin wrappers that parse options and print results.

Every user error is a QtoolError: it is printed as one line and the process exits with 2, so CI
scripts can tell bad input (2) from a failed accuracy gate (1) and from success (0).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from qtool import __version__
from qtool.errors import QtoolError

app = typer.Typer(
    name="qtool",
    help="Post-training quantization of ONNX and PyTorch models to INT8 QDQ ONNX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML file.", show_default=False)]
OutputOpt = Annotated[
    Path | None, typer.Option("--output-dir", "-o", help="Override the recipe's output.dir.")
]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]


def user_errors(command):
    """Print a QtoolError as one line and exit 2; anything else is a bug and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except QtoolError as exc:
            errors.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=exc.exit_code) from None

    return wrapper


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"qtool {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True)
    ] = False,
) -> None:
    """qtool: calibrate, quantize and evaluate INT8 QDQ ONNX models from a YAML recipe."""


@app.command()
@user_errors
def calibrate(
    recipe: RecipeArg, output_dir: OutputOpt = None, progress: ProgressOpt = True
) -> None:
    """Stream the calibration set through the float model and write the stats file."""
    from qtool.pipeline import calibrate as run_calibrate
    from qtool.pipeline import prepare
    from qtool.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    prepared = prepare(loaded)
    stats = run_calibrate(loaded, prepared, progress=progress)
    samples = max((s.samples for s in stats), default=0)
    console.print(
        f"calibrated {len(stats)} tensors on {samples} samples -> {loaded.stats_path}",
        highlight=False,
    )


@app.command()
@user_errors
def quantize(
    recipe: RecipeArg,
    stats: Annotated[
        Path | None, typer.Option("--stats", help="Stats file from `qtool calibrate`.")
    ] = None,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Compute ranges, write the QDQ model and report.json; calibrates first without --stats."""
    from qtool.pipeline import quantize as run_quantize
    from qtool.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    result = run_quantize(loaded, stats, progress=progress)
    summary = result.report["summary"]
    console.print(
        f"quantized {summary['quantized_nodes']} of {summary['nodes']} nodes "
        f"({', '.join(f'{k} {v}' for k, v in summary['quantized_by_op_type'].items())}; "
        f"method {loaded.calibration.method}, target {loaded.quantization.target})",
        highlight=False,
    )
    console.print(f"model  -> {result.model_path}\nreport -> {result.report_path}", highlight=False)


@app.command()
@user_errors
def evaluate(
    recipe: Annotated[
        Path | None, typer.Argument(help="Recipe YAML (uses its output and evaluation data).")
    ] = None,
    fp32: Annotated[Path | None, typer.Option("--fp32", help="Float ONNX model.")] = None,
    quant: Annotated[Path | None, typer.Option("--quant", help="Quantized ONNX model.")] = None,
    data: Annotated[
        Path | None,
        typer.Option("--data", help=".npz with arrays named after the model inputs (+ labels)."),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 64,
    max_drop: Annotated[
        float | None,
        typer.Option(
            "--max-drop", help="Exit 1 when accuracy (or agreement) drops by more points."
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write results as JSON.")
    ] = None,
    latency_runs: Annotated[int, typer.Option("--latency-runs", min=1)] = 50,
    threads: Annotated[int | None, typer.Option("--threads", min=1)] = None,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Compare the float and quantized models: accuracy, fidelity, latency, size."""
    from qtool.errors import RecipeError
    from qtool.evaluate import render_table
    from qtool.io import atomic_write_text
    from qtool.pipeline import evaluate as run_evaluate

    if recipe is not None:
        fp32_path, quant_path, batches, default_drop = _recipe_evaluation(recipe, output_dir)
    else:
        if fp32 is None or quant is None or data is None:
            raise RecipeError("evaluate needs a RECIPE, or all of --fp32, --quant and --data")
        fp32_path, quant_path = fp32, quant
        batches = _npz_batches(fp32, data, batch_size)
        default_drop = None
    result = run_evaluate(
        fp32_path,
        quant_path,
        batches,
        threads=threads,
        latency_runs=latency_runs,
        progress=progress,
    )
    console.print(render_table(result))
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(result.to_dict(), indent=2) + "\n")
    limit = max_drop if max_drop is not None else default_drop
    drop = result.accuracy_drop_points()
    metric = "accuracy" if result.fp32.accuracy is not None else "top-1 agreement"
    if limit is not None:
        if drop > limit:
            errors.print(
                f"[bold red]FAIL:[/] {metric} dropped {drop:.2f} points (limit {limit:.2f})",
                highlight=False,
            )
            raise typer.Exit(code=1)
        console.print(
            f"PASS: {metric} dropped {drop:.2f} points (limit {limit:.2f})", highlight=False
        )


def _recipe_evaluation(recipe: Path, output_dir: Path | None):
    from qtool.data import iter_batches
    from qtool.errors import RecipeError
    from qtool.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    if loaded.evaluation is None:
        raise RecipeError(f"{recipe}: evaluation: is required for `qtool evaluate RECIPE`")
    spec = loaded.evaluation
    batches = iter_batches(spec.data, loaded.inputs, spec.batch_size, seed=loaded.seed)
    return loaded.float_model_path, loaded.quant_model_path, batches, spec.max_drop


def _npz_batches(model_path: Path, data: Path, batch_size: int):
    """Batches from an .npz keyed by the model's input names; the model declares the inputs."""
    import onnx

    from qtool.data import iter_batches
    from qtool.errors import DataError, ModelError
    from qtool.recipe import DataSpec, InputSpec

    if not model_path.is_file():
        raise ModelError(f"{model_path}: model file not found")
    if not data.is_file():
        raise DataError(f"{data}: data file not found")
    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = [
            d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim
        ]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        inputs.append(InputSpec(value.name, tuple(dims), dtype))
    spec = DataSpec("--data", npz=data)
    return iter_batches(spec, tuple(inputs), batch_size)


@app.command()
def doctor() -> None:
    """Show versions and which compiled kernel backends and ONNX Runtime providers are usable."""
    import onnx
    import onnxruntime

    from qtool import kernels

    console.print(f"qtool {__version__} (python {sys.version.split()[0]})", highlight=False)
    console.print(
        f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}", highlight=False
    )
    console.print(
        f"ORT providers: {', '.join(onnxruntime.get_available_providers())}", highlight=False
    )
    for name, state in kernels.backends().items():
        console.print(f"kernels[{name}]: {state}", highlight=False, markup=False)
    console.print(f"default device: {kernels.default_device()}", highlight=False)


if __name__ == "__main__":
    app()
