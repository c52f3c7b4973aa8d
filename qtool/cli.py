"""The `qtool` command line: thin wrappers that parse options and print results.

Every user error is a QtoolError: it is printed as one line and the process exits with 2, so CI
scripts can tell bad input (2) from a failed accuracy gate (1) and from success (0).
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from qtool import __version__
from qtool.errors import QtoolError
from qtool.progress import showing


def _hide_flag_types(command, ctx) -> None:
    """Typer's rich help prints a type column, which for a flag (--version, --help, --progress)
    is a meaningless `<bool>`: an empty metavar leaves that cell blank."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


# The click Typer parses with: Typer >= 0.2x vendors its own copy (typer._click), older Typer uses
# click itself. Its exception module is where Typer's public BadParameter lives.
_click_errors = importlib.import_module(typer.BadParameter.__module__)
# Raised (click >= 8.2) by `qtool` and `qtool stats` without a command, after their help printed.
_NO_ARGS_IS_HELP = getattr(_click_errors, "NoArgsIsHelpError", ())


def usage_error_line(exc: Exception) -> str:
    """Click's message for a bad option or argument, as the one line every other error is.

    Click names the option or argument itself ("Invalid value for '--samples': ...", "Missing
    argument 'files'."); the command's help is named after it instead of a usage box."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    return message if ctx is None else f"{message} (see '{ctx.command_path} --help')"


class _Help:
    """What qtool's commands and groups share: flags without a type column in --help, and
    parse errors that carry their command's context."""

    def format_help(self, ctx, formatter) -> None:
        _hide_flag_types(self, ctx)
        super().format_help(ctx, formatter)

    def parse_args(self, ctx, args):
        """An error the option parser raises without a context ("Option '--shard' requires an
        argument") gets this command's, so its one line can name the command's --help."""
        try:
            return super().parse_args(ctx, args)
        except _click_errors.UsageError as exc:
            if exc.ctx is None:
                exc.ctx = ctx
            raise


class _Group(_Help, TyperGroup):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Typer's main, except that a bad option or argument of any command (click's UsageError,
        BadParameter, MissingParameter, raised while parsing) is printed as a one-line `error:`
        and exits 2, like a QtoolError, instead of Typer's usage box. `qtool` and `qtool stats`
        without a command still print their help."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # Typer's rich help printed itself as it was formatted
            sys.exit(exc.exit_code)
        except _click_errors.ClickException as exc:
            errors.print(
                f"[bold red]error:[/] {escape(usage_error_line(exc))}",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(exc.exit_code)
        except typer.Abort:
            errors.print("[bold red]error:[/] aborted", highlight=False)
            sys.exit(1)
        # Without standalone mode click returns an Exit's code, or the command's return value
        # (None: every command here returns None).
        sys.exit(code if isinstance(code, int) else 0)


class _Command(_Help, TyperCommand):
    pass


app = typer.Typer(
    cls=_Group,
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
ProgressOpt = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Progress on stderr: on a terminal the phase and progress bars; elsewhere (CI "
        "logs, pipes) a line per phase with its time and a progress line at most every 10 s "
        "(at least every 10 s while a phase runs). --no-progress: none of it.",
    ),
]


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
        bool,
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Show the version and exit.",
        ),
    ] = False,
) -> None:
    """qtool: calibrate, quantize and evaluate INT8 QDQ ONNX models from a YAML recipe."""


ShardOpt = Annotated[
    str | None,
    typer.Option(
        "--shard",
        help="Calibrate on shard INDEX/COUNT of the batches only (batch b when b % COUNT == "
        "INDEX), for `qtool stats merge` to combine.",
        show_default=False,
    ),
]


@app.command(cls=_Command)
@user_errors
def calibrate(
    recipe: RecipeArg,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
    shard: ShardOpt = None,
) -> None:
    """Stream the calibration set through the float model and write the stats file.

    Under torchrun the processes split the batches and merge their statistics exactly; rank 0
    writes the files, the same bytes one process writes.
    """
    from qtool import distributed
    from qtool.app.calibrate import calibrate as run_calibrate
    from qtool.app.common import prepare
    from qtool.config.recipe import load_recipe

    part = None if shard is None else distributed.Shard.parse(shard)
    loaded = load_recipe(recipe, output_dir)
    try:
        group = distributed.current()
        with showing(progress and group.primary):
            prepared = prepare(loaded)
            stats = run_calibrate(loaded, prepared, progress=progress, shard=part)
    finally:
        distributed.shutdown()
    if not group.primary:
        return
    samples = max((s.samples for s in stats), default=0)
    where = "" if part is None or part.whole else f" (shard {part})"
    processes = "" if group.world == 1 else f" in {group.world} processes"
    console.print(
        f"calibrated {len(stats)} tensors on {samples} samples{where}{processes} "
        f"-> {loaded.stats_path}",
        highlight=False,
    )


stats_app = typer.Typer(
    cls=_Group, help="Work with stats files from `qtool calibrate`.", no_args_is_help=True
)
app.add_typer(stats_app, name="stats")


@stats_app.command("merge", cls=_Command)
@user_errors
def stats_merge(
    files: Annotated[
        list[Path],
        typer.Argument(help="Stats files of `calibrate --shard` runs.", show_default=False),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The merged stats file.", show_default=False)
    ],
) -> None:
    """Merge the stats files of shard runs (and the hessians.npz beside each) exactly.

    Refuses files of different models or bins and overlapping shards. When the shards cover the
    whole calibration set, the merged file is byte-identical to one `qtool calibrate` run.
    """
    from qtool.calibration.merge import merge_stats_files
    from qtool.io import commit_files

    merged = merge_stats_files(files, output)
    commit_files(merged.files)
    covers = "all shards" if merged.shard is None else f"shards {merged.shard.describe()}"
    samples = max((s.samples for s in merged.stats), default=0)
    console.print(
        f"merged {len(files)} files ({covers}): {len(merged.stats)} tensors on {samples} "
        f"samples -> {output}"
        + ("" if merged.hessians_path is None else f" (+ {merged.hessians_path})"),
        highlight=False,
    )


def _runtime_lines(report: dict) -> list[str]:
    """What runs the model, in the words that hold for its target: ORT's CPU fusion as the
    target's truth on ort-cpu; for TensorRT the placement check (and the engine where one was
    built) first, and ORT's CPU fusion named as qtool's verifier, not TensorRT."""
    lines = []
    typed = report.get("float_type")
    if typed:
        counts = ", ".join(f"{n} {kind}" for kind, n in typed["nodes_by_type"].items())
        kept = ", ".join(f"{rule} {n}" for rule, n in typed["kept_fp32"].items()) or "none"
        lines.append(
            f"float type {typed['float_type']}: nodes compute in {counts}; kept FP32 by rule: "
            f"{kept}; {len(typed['casts'])} Casts at the boundaries allowed"
        )
    runtime = report["runtime"]
    ort = (
        f"runs {runtime['planned']} quantized nodes unfused only (float8: no fused CPU variant)"
        if runtime.get("unfused_only")
        else f"fuses {runtime['fused']} of {runtime['planned']} quantized nodes"
    )
    if runtime.get("emulated"):
        ort += " (on the FP32 emulation of the BF16 file)"
    if report["target"] == "ort-cpu":
        return [*lines, f"ONNX Runtime (CPU provider) {ort}"]
    trt = report.get("tensorrt")
    if trt is not None:
        placement = trt["placement"]
        broken = sum(rule["violations"] for rule in placement["rules"])
        verdict = "every rule holds" if placement["passed"] else f"{broken} violations"
        lines.append(f"TensorRT placement, {placement['basis']}: {verdict}")
        engine = trt["engine"]
        if engine.get("built"):
            types = ", ".join(f"{k} {v}" for k, v in engine["layers_by_output_type"].items())
            lines.append(f"TensorRT {engine['tensorrt_version']} built the engine: layers {types}")
        else:
            lines.append(f"TensorRT engine not built: {engine['why']}")
    lines.append(f"ONNX Runtime CPU check (qtool's verifier, not {report['target']}): {ort}")
    return lines


@app.command(cls=_Command)
@user_errors
def quantize(
    recipe: RecipeArg,
    stats: Annotated[
        Path | None, typer.Option("--stats", help="Stats file from `qtool calibrate`.")
    ] = None,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
    auto: Annotated[
        bool,
        typer.Option(
            "--auto",
            help="Choose each node's precision: the smallest model within the budget "
            "(the recipe's mixed_precision: section, else its evaluation gate); exit 1 when "
            "no plan meets it.",
        ),
    ] = False,
) -> None:
    """Compute ranges, write the QDQ model and report.json; calibrates first without --stats."""
    from qtool.app.quantize import quantize as run_quantize
    from qtool.config.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    with showing(progress):
        result = run_quantize(loaded, stats, progress=progress, auto=auto)
    summary = result.report["summary"]
    ops = ", ".join(f"{k} {v}" for k, v in summary["quantized_by_op_type"].items())
    console.print(
        f"quantized {summary['quantized_nodes']} of {summary['nodes']} nodes "
        f"({ops + '; ' if ops else ''}method {loaded.calibration.method}, target "
        f"{loaded.quantization.target})",
        highlight=False,
    )
    for line in _runtime_lines(result.report):
        console.print(line, highlight=False, markup=False)
    if summary["weight_formats"]:
        console.print(
            f"weights for {result.report['cpu']['description']}: "
            + ", ".join(f"{k} {v}" for k, v in summary["weight_formats"].items()),
            highlight=False,
        )
    dynamic = result.report.get("dynamic")
    if dynamic:
        kinds = ", ".join(f"{k} {v}" for k, v in dynamic["runs_as"].items())
        console.print(
            f"dynamic int8 (inputs quantized at run time, one range {dynamic['ranges']}, no "
            f"calibrated range): {len(dynamic['nodes'])} nodes, ORT runs them as {kinds}",
            highlight=False,
        )
    ort_words = "" if result.report["target"] == "ort-cpu" else "ONNX Runtime CPU check: "
    for group, entry in result.report["low_bit"].items():
        console.print(
            f"{ort_words}{group}: {entry['nodes']} nodes, {entry['effect']}", highlight=False
        )
    speed = result.report.get("low_bit_speed")
    if speed and "not_measured" in speed:
        console.print(f"speed against FP32: {speed['not_measured']}", highlight=False)
    elif speed:
        console.print(
            f"measured on {speed['cpu']} (batch {speed['batch']}, {speed['threads']} thread): "
            f"{speed['speedup']:.2f}x FP32's speed, {speed['verdict']}",
            highlight=False,
        )
    for warning in result.warnings:
        errors.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    console.print(f"model  -> {result.model_path}\nreport -> {result.report_path}", highlight=False)
    mixed = result.report.get("mixed_precision")
    if mixed is not None:
        from qtool.search.mixed_report import summary_table

        console.print(summary_table(mixed))
        console.print(f"plan   -> {mixed['files']['plan']}", highlight=False)
        for note in mixed["notes"]:
            console.print(f"note: {note}", highlight=False, markup=False)
        if not mixed["passed"]:
            errors.print(f"[bold red]FAIL:[/] {escape(mixed['reason'])}", highlight=False)
            raise typer.Exit(code=1)


@app.command(cls=_Command)
@user_errors
def qat(
    recipe: RecipeArg,
    stats: Annotated[
        Path | None,
        typer.Option("--stats", help="Stats file from `qtool calibrate` (else calibrates)."),
    ] = None,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the last epoch checkpoint.")
    ] = False,
) -> None:
    """Quantization-aware training of a PyTorch model on the PTQ plan; writes the QDQ model.

    Under torchrun the processes train data-parallel (DDP, a global batch of batch_size x
    processes); rank 0 writes the checkpoints, the model and report.json.
    """
    from qtool import distributed
    from qtool.app.qat import run_qat
    from qtool.config.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    try:
        group = distributed.current()
        with showing(progress and group.primary):
            result = run_qat(loaded, resume=resume, progress=progress, stats_path=stats)
    finally:
        distributed.shutdown()
    if result is None:  # not rank 0: it reports
        return
    block = result.report["qat"]
    accuracy = block["accuracy"]
    if accuracy:
        console.print(
            f"accuracy: FP32 {accuracy['fp32']:.2f}%, fake-quant before training "
            f"{accuracy['fake_quant_before']:.2f}%, after {accuracy['fake_quant_after']:.2f}%, "
            f"exported (ORT fused) {accuracy['exported_fused']:.2f}%",
            highlight=False,
        )
    same = block["equivalence"]
    console.print(
        f"trained {block['epochs']} epochs ({block['loss']}, final loss {block['final_loss']:.5f}) "
        f"in {block['train_seconds']:.1f} s ({block['train_cpu_seconds_rank0']:.1f} CPU s"
        + ("" if block["processes"] == 1 else f" on rank 0 of {block['processes']} processes")
        + f"); ORT vs fake-quant max |diff| "
        f"{same['max_abs_diff_fused']:.3g} fused, {same['max_abs_diff_unfused']:.3g} unfused "
        f"(one output step {same['output_step']:.3g})",
        highlight=False,
    )
    for line in _runtime_lines(result.report):
        console.print(line, highlight=False, markup=False)
    for warning in result.warnings:
        errors.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    console.print(f"model  -> {result.model_path}\nreport -> {result.report_path}", highlight=False)


@app.command(cls=_Command)
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
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            help="Model output the gates judge and labels belong to (default: the first).",
        ),
    ] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            help="What --max-drop counts: accuracy | agreement (top-1 agreement with FP32) | "
            "perplexity (next-token labels: a text data source). Default: perplexity on text, "
            "accuracy with other labels, else agreement, which is refused on an output that is "
            "not class scores unless named here.",
        ),
    ] = None,
    max_drop: Annotated[
        float | None,
        typer.Option(
            "--max-drop",
            help="Exit 1 when --metric drops by more than this many points; for perplexity, "
            "when the quantized model's perplexity exceeds FP32's by more than this many "
            "percent (relative: 2 allows 47.4 -> 48.3).",
        ),
    ] = None,
    min_cosine: Annotated[
        float | None,
        typer.Option(
            "--min-cosine",
            help="Exit 1 when the output's cosine to FP32 is below this. The gate for "
            "embeddings, where top-1 agreement means nothing.",
        ),
    ] = None,
    min_sqnr: Annotated[
        float | None,
        typer.Option("--min-sqnr", help="Exit 1 when the output's SQNR vs FP32 (dB) is lower."),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write every result as JSON.")
    ] = None,
    junit_path: Annotated[
        Path | None,
        typer.Option("--junit", help="Also write a JUnit XML report, one testcase per gate."),
    ] = None,
    allow_foreign_fp32: Annotated[
        bool,
        typer.Option(
            "--allow-foreign-fp32",
            help="Compare even when the quantized model records another float model.",
        ),
    ] = False,
    latency_runs: Annotated[int, typer.Option("--latency-runs", min=1)] = 50,
    threads: Annotated[int | None, typer.Option("--threads", min=1)] = None,
    accuracy_level: Annotated[
        int | None,
        typer.Option(
            "--accuracy-level",
            min=0,
            max=4,
            help="MatMulNBits compute for 4-bit MatMuls: 1 fp32, 2 fp16, 3 bf16, 4 int8 "
            "(ORT's default). Overrides evaluation.accuracy_level.",
        ),
    ] = None,
    rows: Annotated[
        str | None,
        typer.Option(
            "--rows",
            help="Metric rows of every output, comma-separated: accuracy, perplexity, top1, kl, "
            "sqnr, cosine. Default: by output kind (perplexity, top1 and kl for next-token "
            "scores; top1 for class scores; sqnr and cosine for embeddings and other dense "
            "outputs). Overrides evaluation.rows.",
        ),
    ] = None,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Compare the float and quantized models on every output, fused (as ONNX Runtime runs it)
    and unfused (QDQ semantics): accuracy, top-1 agreement (class scores), perplexity and KL
    (next-token labels of a text source), SQNR, cosine, the fused model against its own QDQ
    semantics, latency, size.

    Gates (--max-drop, --min-cosine, --min-sqnr) are judged on the fused model, and any failed
    gate makes the exit code 1. Use --min-cosine for embedding models: top-1 agreement means
    nothing there, and a --max-drop that would count it is refused (exit 2).
    """
    from qtool.app.evaluate import EvaluateOptions
    from qtool.app.evaluate import run as run_evaluation
    from qtool.metrics.tables import (
        fused_unfused_notes,
        kind_notes,
        low_bit_notes,
        render_table,
        unfused_only_notes,
    )

    options = EvaluateOptions(
        output=output,
        metric=metric,
        max_drop=max_drop,
        min_cosine=min_cosine,
        min_sqnr=min_sqnr,
        rows=rows,
        accuracy_level=accuracy_level,
        allow_foreign_fp32=allow_foreign_fp32,
        threads=threads,
        latency_runs=latency_runs,
        progress=progress,
        json_path=json_path,
        junit_path=junit_path,
    )
    with showing(progress):
        evaluation = run_evaluation(options, recipe, output_dir, fp32, quant, data, batch_size)
    result = evaluation.result
    console.print(render_table(result))
    notes = [*unfused_only_notes(result), *kind_notes(result), *fused_unfused_notes(result)]
    for note in [*notes, *low_bit_notes(result)]:
        console.print(note, highlight=False, markup=False)
    for warning in result.warnings:
        errors.print(
            f"[bold yellow]warning:[/] {escape(warning.message)}", highlight=False, soft_wrap=True
        )
    for gate in evaluation.gates:
        if gate.passed:
            console.print(f"PASS: {gate.describe()}", highlight=False, markup=False)
        else:
            errors.print(f"[bold red]FAIL:[/] {escape(gate.describe())}", highlight=False)
    if not evaluation.passed:
        raise typer.Exit(code=1)


@app.command(cls=_Command)
@user_errors
def analyze(
    recipe: RecipeArg,
    stats: Annotated[
        Path | None,
        typer.Option("--stats", help="Stats file (default: the recipe's; calibrates if none)."),
    ] = None,
    mode: Annotated[
        str,
        typer.Option("--mode", help="one-at-a-time | all-but-one | layer | all (or a comma list)."),
    ] = "all",
    candidates: Annotated[
        str | None,
        typer.Option(
            "--candidates",
            help="Precisions to try per node, e.g. int8,int4 (int4: weighted nodes, opset 21). "
            "Default: int8, and int4 on an opset-21 ort-cpu model.",
        ),
    ] = None,
    samples: Annotated[
        int, typer.Option("--samples", min=1, help="Evaluation samples to score on.")
    ] = 128,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            help="accuracy | agreement | perplexity | cosine | sqnr. Default: the gate `qtool "
            "evaluate` judges (evaluation.metric / min_cosine / min_sqnr; perplexity on text, "
            "accuracy with other labels).",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG plot path (default: OUTPUT/sensitivity.png)."),
    ] = None,
    cache: Annotated[
        bool, typer.Option("--cache/--no-cache", help="Reuse measurements of earlier runs.")
    ] = True,
    output_dir: OutputOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Measure each quantized node's sensitivity: quantized alone, kept float alone, and its
    SQNR layer by layer; writes sensitivity.json, plan.yaml and a plot."""
    from qtool.app.analyze import run
    from qtool.config.recipe import load_recipe

    loaded = load_recipe(recipe, output_dir)
    with showing(progress):
        run(
            loaded,
            console,
            stats=stats,
            mode=mode,
            candidates=candidates,
            samples=samples,
            metric=metric,
            plot=plot,
            use_cache=cache,
            progress=progress,
        )


@app.command(cls=_Command)
def doctor() -> None:
    """Show versions and which compiled kernel backends and ONNX Runtime providers are usable."""
    import onnx
    import onnxruntime

    from qtool import kernels
    from qtool.ort.cpu import detect_cpu
    from qtool.ort.sessions import provider_status

    console.print(f"qtool {__version__} (python {sys.version.split()[0]})", highlight=False)
    console.print(
        f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}", highlight=False
    )
    providers = provider_status()
    running = [name for name, state in providers.items() if state == "runs"]
    console.print(f"ORT providers that run here: {', '.join(running)}", highlight=False)
    for name, state in providers.items():
        if state != "runs":
            console.print(
                f"ORT provider {name}: {state}", highlight=False, markup=False, soft_wrap=True
            )
    for name, state in kernels.backends().items():
        console.print(f"kernels[{name}]: {state}", highlight=False, markup=False)
    console.print(f"default device: {kernels.default_device()}", highlight=False)
    cpu = detect_cpu()
    console.print(f"CPU: {cpu.describe()}", highlight=False, markup=False)
    if cpu.u8s8_saturates:
        verdict = (
            "no VNNI: ORT's uint8 x int8 kernels add product pairs in saturating 16-bit sums; "
            "quantize writes weights that cannot overflow them (quantization.saturation)"
        )
    elif cpu.vnni:
        verdict = "VNNI: int8 dot products accumulate in 32 bits (no saturation)"
    else:
        verdict = "uint8 x int8 kernels do not saturate on this CPU"
    console.print(f"int8 kernels: {verdict}", highlight=False, markup=False)


if __name__ == "__main__":
    app()
