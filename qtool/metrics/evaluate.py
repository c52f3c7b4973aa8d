"""Compare an FP32 ONNX model with its quantized version in ONNX Runtime, fused and unfused.

The quantized model runs twice per batch: as ONNX Runtime fuses it (ORT_ENABLE_ALL, what users
deploy: QLinearConv, QGemm, ... with the CPU's integer kernels) and unfused (ORT_DISABLE_ALL: every
QuantizeLinear/DequantizeLinear runs as written, the QDQ semantics the quantizer chose). The two
can differ: on x86 without VNNI, ORT's uint8 x int8 kernels add product pairs in saturating 16-bit
sums, which the QDQ graph never does. Seeing both tells a user whether a loss comes from the
quantization or from the kernels that run it.

All three sessions (FP32 once, quantized fused and unfused) see the same batches in one streaming
pass, so every metric compares outputs for identical inputs and the evaluation set is never held
in memory. Every output is compared, matched by name. Latency is measured separately on
single-sample runs of FP32 and the fused model, alternating between them so that clock drift or a
noisy neighbour affects both equally.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime
from onnx import helper
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qtool.errors import DataError, ModelError
from qtool.metrics.signal import SignalQuality
from qtool.model import provenance
from qtool.ort.accuracy_level import (
    ACCURACY_LEVEL_KEY,
    ACCURACY_LEVELS,
    ORT_DEFAULT_ACCURACY_LEVEL,
)
from qtool.ort.cpu import CpuFeatures, detect_cpu
from qtool.ort.sessions import create_session
from qtool.runtime.latency import latency_feed, measure_latency
from qtool.runtime.low_bit import (
    LowBitUsage,
    low_bit_usage,
    written_accuracy_levels,
)

if TYPE_CHECKING:
    from qtool.metrics.gates import GateResult

Batch = tuple[Mapping[str, np.ndarray], np.ndarray | None]

VARIANTS = ("fused", "unfused")
# A fused model this many dB below its own QDQ semantics is losing to its kernels, not to the
# quantization: a gap that large is far beyond run-to-run or rounding-order differences.
FUSED_GAP_DB = 3.0


@dataclass
class ModelMetrics:
    """Per-model numbers; accuracy (on the gated output) is None without labels."""

    accuracy: float | None
    latency_ms_median: float
    latency_ms_p90: float
    file_bytes: int


@dataclass
class VariantMetrics:
    """One way of running the quantized model (fused or unfused) vs FP32, on one output.

    agreement is None for outputs without a class axis (rank < 2: no top-1 to agree on);
    accuracy is None except on the gated output of labelled data.
    """

    sqnr_db: float
    cosine: float
    agreement: float | None
    accuracy: float | None = None


@dataclass
class OutputResult:
    """Every metric of one model output, fused and unfused."""

    name: str
    fused: VariantMetrics
    unfused: VariantMetrics
    fp32_accuracy: float | None = None

    def variant(self, name: str) -> VariantMetrics:
        return self.fused if name == "fused" else self.unfused

    def to_dict(self) -> dict:
        def variant(m: VariantMetrics) -> dict:
            return {
                "accuracy": m.accuracy,
                "agreement": m.agreement,
                "sqnr_db": json_float(m.sqnr_db),
                "cosine": m.cosine,
            }

        return {
            "name": self.name,
            "fp32_accuracy": self.fp32_accuracy,
            "fused": variant(self.fused),
            "unfused": variant(self.unfused),
        }


@dataclass
class EvalWarning:
    """What the numbers alone do not say: `code` is stable for scripts, `message` for people."""

    code: str  # "fused_below_unfused" | "foreign_fp32" | "no_provenance"
    message: str


@dataclass
class EvalResult:
    """FP32 vs quantized. `quant` is the fused model (what deploys); every output is in `outputs`.

    `output` is the gated output: labels are compared with its top-1, and the properties
    `agreement`, `sqnr_db`, `cosine` are its fused numbers.
    """

    fp32: ModelMetrics
    quant: ModelMetrics
    samples: int
    outputs: list[OutputResult]
    output: str
    # Batch size of the latency runs: 1 unless the model's batch axis is fixed to another size.
    latency_batch: int = 1
    latency_runs: int = 0
    warnings: list[EvalWarning] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    cpu: CpuFeatures | None = None
    fp32_path: Path | None = None
    quant_path: Path | None = None
    # What runs the 4-bit / blocked weights, and MatMulNBits' accuracy level (None: ORT default).
    low_bit: LowBitUsage | None = None
    accuracy_level: int | None = None
    # accuracy_level -> MatMulNBits nodes written in the model file (the session option does not
    # reach them; it applies to the nodes ORT forms from DequantizeLinear -> MatMul).
    written_levels: dict[int, int] = field(default_factory=dict)

    def accuracy_level_note(self) -> str | None:
        """Which MatMulNBits compute the fused numbers came from, when MatMulNBits ran."""
        if self.low_bit is None or not self.low_bit.kernels.get("MatMulNBits"):
            return None
        notes = [
            f"{count} written with accuracy level {level}: {ACCURACY_LEVELS.get(level, '?')}"
            for level, count in sorted(self.written_levels.items())
        ]
        formed = self.low_bit.kernels["MatMulNBits"] - sum(self.written_levels.values())
        if formed > 0:
            level = self.accuracy_level
            source = "set by the recipe/CLI"
            if level is None:
                level, source = ORT_DEFAULT_ACCURACY_LEVEL, "ORT's session default"
            notes.append(
                f"{formed} formed from QDQ at accuracy level {level}: {ACCURACY_LEVELS[level]} "
                f"({source})"
            )
        elif self.accuracy_level is not None:
            notes.append(
                f"the session's accuracy level {self.accuracy_level} does not apply to nodes "
                "written as MatMulNBits"
            )
        return "MatMulNBits: " + "; ".join(notes)

    @property
    def has_labels(self) -> bool:
        return self.fp32.accuracy is not None and self.quant.accuracy is not None

    def gated(self) -> OutputResult:
        return next(o for o in self.outputs if o.name == self.output)

    @property
    def agreement(self) -> float | None:
        return self.gated().fused.agreement

    @property
    def sqnr_db(self) -> float:
        return self.gated().fused.sqnr_db

    @property
    def cosine(self) -> float:
        return self.gated().fused.cosine

    def drop_points(self, metric: str, variant: str = "fused") -> float:
        """Points lost on the gated output: accuracy (FP32 - quantized) or top-1 disagreement."""
        gated = self.gated()
        measured = gated.variant(variant)
        if metric == "accuracy":
            if gated.fp32_accuracy is None or measured.accuracy is None:
                raise DataError("accuracy needs labels, but the evaluation data has none")
            return (gated.fp32_accuracy - measured.accuracy) * 100.0
        if measured.agreement is None:
            raise DataError(
                f"output {self.output!r} has no class axis (rank < 2), so top-1 agreement is "
                "undefined; gate it with a cosine or SQNR floor"
            )
        return (1.0 - measured.agreement) * 100.0

    def default_metric(self) -> str:
        return "accuracy" if self.has_labels else "agreement"

    def accuracy_drop_points(self) -> float:
        """The default gate number: accuracy lost with labels, else top-1 disagreement (fused)."""
        return self.drop_points(self.default_metric())

    def speedup(self) -> float:
        """FP32 median latency over fused quantized median (> 1 means the quantized is faster)."""
        return self.fp32.latency_ms_median / self.quant.latency_ms_median

    def size_ratio(self) -> float:
        """FP32 file size over quantized file size (> 1 means the quantized is smaller)."""
        return self.fp32.file_bytes / self.quant.file_bytes

    def to_dict(self, gates: Iterable[GateResult] = ()) -> dict:
        """JSON-ready, with the judged `gates` (qtool.metrics.gates): strict JSON has no Infinity,
        so an
        infinite SQNR is written as "inf"."""
        gates = list(gates)
        return {
            "models": {
                "fp32": None if self.fp32_path is None else str(self.fp32_path),
                "quant": None if self.quant_path is None else str(self.quant_path),
            },
            "samples": self.samples,
            "gated_output": self.output,
            "labels": self.has_labels,
            "outputs": [o.to_dict() for o in self.outputs],
            "gates": [g.to_dict() for g in gates],
            "passed": all(g.passed for g in gates),
            "warnings": [{"code": w.code, "message": w.message} for w in self.warnings],
            "latency": {
                "compared": "fp32 vs quantized fused (ORT_ENABLE_ALL)",
                "batch": self.latency_batch,
                "runs": self.latency_runs,
                "fp32_ms": {
                    "median": self.fp32.latency_ms_median,
                    "p90": self.fp32.latency_ms_p90,
                },
                "quant_ms": {
                    "median": self.quant.latency_ms_median,
                    "p90": self.quant.latency_ms_p90,
                },
                "speedup": self.speedup(),
            },
            "size": {
                "fp32_bytes": self.fp32.file_bytes,
                "quant_bytes": self.quant.file_bytes,
                "ratio": self.size_ratio(),
            },
            "cpu": None if self.cpu is None else self.cpu.to_dict(),
            "provenance": self.provenance,
            "low_bit": None if self.low_bit is None else self.low_bit.to_dict(),
            "matmul_nbits_accuracy_level": self.accuracy_level_note(),
        }


def json_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


# ---------------------------------------------------------------------------------------------
# Fused vs unfused


def fused_gap_warning(outputs: Iterable[OutputResult], cpu: CpuFeatures) -> EvalWarning | None:
    """A warning when the fused SQNR of any output is more than FUSED_GAP_DB below the unfused.

    The likely cause depends on the CPU: without VNNI, ORT's uint8 x int8 kernels saturate their
    16-bit pair sums, which a model quantized for this CPU avoids; elsewhere the fused kernels
    simply compute something other than the QDQ graph.
    """
    gaps = []
    for out in outputs:
        fused, unfused = out.fused.sqnr_db, out.unfused.sqnr_db
        if math.isinf(fused) and math.isinf(unfused) and (fused > 0) == (unfused > 0):
            continue  # both exact (or both zero signal): no gap to speak of
        if unfused - fused > FUSED_GAP_DB:
            fused_db, unfused_db = format_db(fused), format_db(unfused)
            gaps.append(f"output {out.name!r} fused {fused_db} dB vs unfused {unfused_db} dB")
    if not gaps:
        return None
    head = (
        f"the fused quantized model (ORT_ENABLE_ALL, what deploys) is more than "
        f"{FUSED_GAP_DB:g} dB below its unfused QDQ semantics in SQNR ({'; '.join(gaps)}); "
        "likely cause: "
    )
    if cpu.u8s8_saturates:
        cause = (
            "this CPU has no VNNI and ONNX Runtime's uint8 x int8 kernels saturate 16-bit pair "
            "sums; quantize the model for this CPU (recipe `quantization.cpu`, weights format "
            "chosen by qtool)"
        )
    else:
        cause = (
            f"ONNX Runtime's fused integer kernels on this CPU ({cpu.describe()}) differ from "
            "the QDQ semantics"
        )
    return EvalWarning("fused_below_unfused", head + cause)


# ---------------------------------------------------------------------------------------------
# Provenance


def check_provenance(
    fp32_path: Path,
    quant_proto: onnx.ModelProto,
    quant_path: Path,
    allow_foreign: bool,
    fp32_proto: onnx.ModelProto | None = None,
) -> tuple[dict, list[EvalWarning]]:
    """Refuse a quantized model that records another float model than `fp32_path`.

    Comparing a quantized model with a float model it was not made from prints a "drop" that is
    really a mix-up, so this is an error unless the user says they mean it (allow_foreign).
    The float model's hash covers its external data files (`fp32_proto`: its proto without
    them, when already read).
    """
    recorded = provenance.read(quant_proto)
    info: dict = {"recorded": recorded}
    expected = recorded.get(provenance.FLOAT_MODEL_SHA256)
    if expected is None:
        info["status"] = "unknown"
        what = "no qtool provenance" if not recorded else f"no {provenance.FLOAT_MODEL_SHA256}"
        message = (
            f"{quant_path} has {what} in its metadata, so evaluate cannot check that it was "
            f"quantized from {fp32_path}"
        )
        return info, [EvalWarning("no_provenance", message)]
    actual = provenance.sha256_model(fp32_path, fp32_proto)
    info["fp32_sha256"] = actual
    if actual == expected:
        info["status"] = "match"
        return info, []
    info["status"] = "mismatch"
    message = (
        f"{quant_path} was not derived from {fp32_path}: it records float model sha256 "
        f"{expected[:16]}..., {fp32_path.name} has {actual[:16]}..."
    )
    if not allow_foreign:
        raise ModelError(f"{message} (pass --allow-foreign-fp32 to compare them anyway)")
    return info, [EvalWarning("foreign_fp32", f"{message}; compared anyway (--allow-foreign-fp32)")]


# ---------------------------------------------------------------------------------------------
# Input validation


def _ort_type_to_numpy(ort_type: str, model: Path, name: str) -> np.dtype:
    """Map ORT's 'tensor(float)' strings through ONNX's own dtype table rather than a copy of it."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        raise ModelError(f"{model}: input {name!r} has type {ort_type}; only tensors are supported")
    elem = ort_type[len("tensor(") : -1].upper()
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(onnx.TensorProto.DataType.Value(elem)))
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{model}: input {name!r} has unsupported type {ort_type}") from exc


def _format_expected(shape: list) -> str:
    """Show symbolic dims by name ('N') and unknown ones as '?', as a user would write them."""
    dims = [str(d) if isinstance(d, int) else (d if d else "?") for d in shape]
    return "[" + ", ".join(dims) + "]"


@dataclass
class _InputSpec:
    name: str
    dtype: np.dtype
    shape: list  # ints for fixed dims, str/None for symbolic ones


def _input_specs(session: onnxruntime.InferenceSession, model: Path) -> list[_InputSpec]:
    return [
        _InputSpec(i.name, _ort_type_to_numpy(i.type, model, i.name), list(i.shape))
        for i in session.get_inputs()
    ]


def _validate_inputs(
    inputs: Mapping[str, np.ndarray], specs: list[_InputSpec], model: Path, batch_index: int
) -> None:
    """Reject data that does not fit the model before ORT does, with a message naming the input."""
    expected = {s.name for s in specs}
    extra = sorted(set(inputs) - expected)
    if extra:
        raise DataError(
            f"evaluation batch {batch_index} has input {extra[0]!r} but {model.name} has inputs "
            f"{sorted(expected)}"
        )
    for spec in specs:
        if spec.name not in inputs:
            raise DataError(
                f"evaluation batch {batch_index} is missing input {spec.name!r} "
                f"required by {model.name}"
            )
        array = inputs[spec.name]
        if not isinstance(array, np.ndarray):
            raise DataError(
                f"evaluation input {spec.name!r} is a {type(array).__name__}, not a numpy array"
            )
        if array.dtype != spec.dtype:
            raise DataError(
                f"evaluation input {spec.name!r} has dtype {array.dtype} but {model.name} "
                f"expects {spec.dtype}"
            )
        fits = array.ndim == len(spec.shape) and all(
            not isinstance(d, int) or d == n for d, n in zip(spec.shape, array.shape, strict=True)
        )
        if not fits:
            raise DataError(
                f"evaluation input {spec.name!r} has shape {tuple(array.shape)} but the model "
                f"expects {_format_expected(spec.shape)} ({model.name})"
            )
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise DataError(
                f"evaluation input {spec.name!r} contains NaN or Inf in batch {batch_index}"
            )


def _check_labels(
    labels: np.ndarray, predictions: np.ndarray, output: str, batch_index: int
) -> np.ndarray:
    """Labels must give one class index per top-1 prediction (shape = output shape minus last)."""
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"evaluation labels in batch {batch_index} have dtype {labels.dtype}; "
            "expected integer class indices"
        )
    if labels.shape != predictions.shape:
        raise DataError(
            f"evaluation labels in batch {batch_index} have shape {labels.shape} but the top-1 "
            f"predictions of output {output!r} have shape {predictions.shape}"
        )
    return labels


def _output_names(
    ref: onnxruntime.InferenceSession,
    quant: onnxruntime.InferenceSession,
    fp32_path: Path,
    quant_path: Path,
) -> list[str]:
    """The FP32 model's outputs, in its order; the quantized model must have the same names."""
    names = [o.name for o in ref.get_outputs()]
    for o in ref.get_outputs():
        if not o.type.startswith("tensor("):
            raise ModelError(f"{fp32_path}: output {o.name!r} has type {o.type}; only tensors")
    quant_names = [o.name for o in quant.get_outputs()]
    if set(names) != set(quant_names):
        missing = [n for n in names if n not in quant_names]
        extra = [n for n in quant_names if n not in names]
        detail = (
            f"{quant_path.name} has no output {missing[0]!r}, which {fp32_path.name} has"
            if missing
            else f"{quant_path.name} has output {extra[0]!r}, which {fp32_path.name} lacks"
        )
        raise ModelError(
            f"{detail} (outputs are matched by name: {fp32_path.name} has {names}, "
            f"{quant_path.name} has {quant_names})"
        )
    return names


# ---------------------------------------------------------------------------------------------
# Metrics


class Fidelity(SignalQuality):
    """qtool.metrics.signal's accumulator for one output of one variant, plus label accuracy."""

    def __init__(self) -> None:
        super().__init__(cosine="rows", top1=True)
        self.correct = 0

    @property
    def samples(self) -> int:
        return self.rows

    def update(self, ref: np.ndarray, quant: np.ndarray, labels: np.ndarray | None) -> None:
        super().update(ref, quant)
        if labels is not None and ref.ndim >= 2:
            self.correct += int(np.count_nonzero(np.argmax(quant, axis=-1) == labels))

    def metrics(self, labelled: bool) -> VariantMetrics:
        accuracy = self.correct / self.predictions if labelled and self.predictions else None
        return VariantMetrics(self.sqnr_db(), self.cosine(), self.agreement(), accuracy)


def _read_proto(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt file
        raise ModelError(f"cannot read {path}: {exc}") from exc


def _model_bytes(path: Path, proto: onnx.ModelProto) -> int:
    """Size on disk including external-data files, so >2 GB models are not reported as tiny."""
    total = path.stat().st_size
    files = set()
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    files.add(path.parent / entry.value)
    for file in files:
        if not file.is_file():
            raise ModelError(f"{path}: external data file {file} does not exist")
        total += file.stat().st_size
    return total


# ---------------------------------------------------------------------------------------------
# Evaluation


def _progress(enabled: bool, total: int | None) -> Progress:
    console = Console(stderr=True)
    return Progress(
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn() if total is not None else TextColumn("{task.completed} batches"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,
    )


def evaluate_models(
    fp32_path: Path,
    quant_path: Path,
    batches: Iterable[Batch],
    *,
    output: str | None = None,
    output_where: str = "output",
    labels_required_by: str | None = None,
    allow_foreign_fp32: bool = False,
    threads: int | None = None,
    latency_runs: int = 50,
    progress: bool = True,
    cpu: CpuFeatures | None = None,
    accuracy_level: int | None = None,
) -> EvalResult:
    """Run FP32 once and the quantized model fused and unfused over `batches`; compare outputs.

    `batches` yields (inputs by name, labels or None); either every batch has labels or none
    does. Labels are class indices for the top-1 (argmax over the last axis) of `output` (the
    gated output; default the first). `output_where` and `labels_required_by` name the option or
    recipe key behind them in error messages (`labels_required_by` set: data without labels is an
    error). `cpu` (default: this machine) decides the cause named when fused trails unfused.
    `accuracy_level` sets MatMulNBits' compute type for the fused session (None: ORT's default).
    """
    if latency_runs < 1:
        raise ValueError(f"latency_runs must be >= 1, got {latency_runs}")
    fp32_path, quant_path = Path(fp32_path), Path(quant_path)
    fp32_proto, quant_proto = _read_proto(fp32_path), _read_proto(quant_path)
    prov, warnings = check_provenance(
        fp32_path, quant_proto, quant_path, allow_foreign_fp32, fp32_proto
    )
    written_levels = dict(written_accuracy_levels(quant_proto))
    sizes = (_model_bytes(fp32_path, fp32_proto), _model_bytes(quant_path, quant_proto))
    del fp32_proto, quant_proto
    ref_session = create_session(fp32_path, threads=threads)
    config = {} if accuracy_level is None else {ACCURACY_LEVEL_KEY: str(accuracy_level)}
    low_bit = low_bit_usage(quant_path, config)
    sessions = {
        "fused": create_session(quant_path, threads=threads, optimize=True, config=config),
        "unfused": create_session(quant_path, threads=threads, optimize=False),
    }
    ref_specs = _input_specs(ref_session, fp32_path)
    q_specs = _input_specs(sessions["fused"], quant_path)
    names = _output_names(ref_session, sessions["fused"], fp32_path, quant_path)
    if output is None:
        output = names[0]
    elif output not in names:
        raise ModelError(
            f"{output_where} {output!r}: {fp32_path.name} has no such output "
            f"(outputs: {', '.join(names)})"
        )

    fidelity = {(v, n): Fidelity() for v in VARIANTS for n in names}
    fp32_correct = 0
    has_labels: bool | None = None
    first_inputs: Mapping[str, np.ndarray] | None = None
    total = len(batches) if hasattr(batches, "__len__") else None
    with _progress(progress, total) as bar:
        task = bar.add_task("batches", total=total)
        for index, (inputs, labels) in enumerate(batches, start=1):
            _validate_inputs(inputs, ref_specs, fp32_path, index)
            _validate_inputs(inputs, q_specs, quant_path, index)
            if has_labels is None:
                has_labels = labels is not None
                if not has_labels and labels_required_by is not None:
                    raise DataError(
                        f"{labels_required_by} needs labels, but the evaluation data has none"
                    )
            elif has_labels != (labels is not None):
                raise DataError(
                    f"evaluation batch {index} {'has no' if has_labels else 'has'} labels but "
                    f"batch 1 {'has' if has_labels else 'has none'}; label all batches or none"
                )
            feed = dict(inputs)
            ref = dict(zip(names, ref_session.run(names, feed), strict=True))
            runs = {
                v: dict(zip(names, s.run(names, feed), strict=True)) for v, s in sessions.items()
            }
            if labels is not None:
                if ref[output].ndim < 2:
                    raise DataError(
                        f"the evaluation data has labels but output {output!r} has shape "
                        f"{ref[output].shape}: no class axis to take a top-1 from"
                    )
                top = np.argmax(ref[output], axis=-1)
                labels = _check_labels(labels, top, output, index)
                fp32_correct += int(np.count_nonzero(top == labels))
            for variant, values in runs.items():
                for name in names:
                    if values[name].shape != ref[name].shape:
                        raise ModelError(
                            f"output {name!r} has shape {values[name].shape} in {quant_path.name} "
                            f"({variant}) but {ref[name].shape} in {fp32_path.name}"
                        )
                    fidelity[variant, name].update(
                        ref[name], values[name], labels if name == output else None
                    )
            if first_inputs is None:
                first_inputs = inputs
            bar.advance(task)

    if first_inputs is None:
        raise DataError("the evaluation data yielded no batches")

    outputs = []
    for name in names:
        labelled = bool(has_labels) and name == output
        gated_predictions = fidelity["fused", name].predictions
        outputs.append(
            OutputResult(
                name,
                fused=fidelity["fused", name].metrics(labelled),
                unfused=fidelity["unfused", name].metrics(labelled),
                fp32_accuracy=fp32_correct / gated_predictions if labelled else None,
            )
        )
    cpu = cpu if cpu is not None else detect_cpu()
    gap = fused_gap_warning(outputs, cpu)
    if gap is not None:
        warnings.append(gap)

    feed, latency_batch = latency_feed(first_inputs, [spec.shape for spec in ref_specs])
    (ref_med, ref_p90), (q_med, q_p90) = measure_latency(
        [ref_session, sessions["fused"]], feed, latency_runs
    )
    gated = next(o for o in outputs if o.name == output)
    return EvalResult(
        fp32=ModelMetrics(gated.fp32_accuracy, ref_med, ref_p90, sizes[0]),
        quant=ModelMetrics(gated.fused.accuracy, q_med, q_p90, sizes[1]),
        samples=fidelity["fused", names[0]].samples,
        outputs=outputs,
        output=output,
        latency_batch=latency_batch,
        latency_runs=latency_runs,
        warnings=warnings,
        provenance=prov,
        cpu=cpu,
        fp32_path=fp32_path,
        quant_path=quant_path,
        low_bit=low_bit,
        accuracy_level=accuracy_level,
        written_levels=written_levels,
    )


# ---------------------------------------------------------------------------------------------
# Table


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def format_db(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"


def _ms(value: float) -> str:
    # Three significant digits keep sub-millisecond models readable (0.00426 ms, not 0.004 ms).
    return f"{value:.3f} ms" if value >= 1 else f"{value:.3g} ms"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator > 0 else "n/a"


def _points(value: float) -> str:
    return f"{value + 0.0:+.2f} pts"  # + 0.0 turns -0.0 into 0.0 so no change reads "+0.00"


def render_table(result: EvalResult) -> Table:
    """The human summary: a row per output and metric, fused and unfused side by side.

    Fidelity metrics compare quantized to FP32, so their FP32 cell is '-'. The gated output's
    rows are bold and its name is starred; "change" is the fused model's (what deploys).
    """
    table = Table(
        title=f"FP32 vs quantized ({result.samples} samples; fused = as ONNX Runtime runs it, "
        "unfused = QDQ semantics)"
    )
    table.add_column("output")
    table.add_column("metric")
    table.add_column("FP32", justify="right")
    table.add_column("fused", justify="right")
    table.add_column("unfused", justify="right")
    table.add_column("change (fused)", justify="right")

    for out in result.outputs:
        gated = out.name == result.output and len(result.outputs) > 1
        label = f"{out.name} *" if gated else out.name
        style = "bold" if gated else None
        if out.name == result.output and result.has_labels:
            change = (out.fused.accuracy - out.fp32_accuracy) * 100.0
            table.add_row(
                label,
                "accuracy",
                _pct(out.fp32_accuracy),
                _pct(out.fused.accuracy),
                _pct(out.unfused.accuracy),
                _points(change),
                style=style,
            )
        agreement_change = ""
        if out.fused.agreement is not None and not (
            out.name == result.output and result.has_labels
        ):
            agreement_change = _points(-(1.0 - out.fused.agreement) * 100.0)
        table.add_row(
            label,
            "top-1 agreement",
            "-",
            _pct(out.fused.agreement),
            _pct(out.unfused.agreement),
            agreement_change,
            style=style,
        )
        table.add_row(
            label,
            "SQNR dB",
            "-",
            format_db(out.fused.sqnr_db),
            format_db(out.unfused.sqnr_db),
            "",
            style=style,
        )
        table.add_row(
            label,
            "cosine",
            "-",
            f"{out.fused.cosine:.5f}",
            f"{out.unfused.cosine:.5f}",
            "",
            style=style,
        )
    batch = "" if result.latency_batch == 1 else f" (batch {result.latency_batch})"
    for label, ref, q in (
        ("latency median", result.fp32.latency_ms_median, result.quant.latency_ms_median),
        ("latency p90", result.fp32.latency_ms_p90, result.quant.latency_ms_p90),
    ):
        table.add_row("", f"{label}{batch}", _ms(ref), _ms(q), "-", f"{_ratio(ref, q)} speed-up")
    table.add_row(
        "",
        "file size",
        _size(result.fp32.file_bytes),
        _size(result.quant.file_bytes),
        _size(result.quant.file_bytes),
        f"{_ratio(result.fp32.file_bytes, result.quant.file_bytes)} smaller",
    )
    if result.low_bit is not None and result.low_bit.total:
        table.add_row("", "low-bit weights", "-", result.low_bit.brief(), "-", "")
    return table


def low_bit_notes(result: EvalResult) -> list[str]:
    """The lines under the table that say what the 4-bit weights run on, and at which accuracy
    level, so a smaller file is never read as a faster model."""
    if result.low_bit is None or not result.low_bit.total:
        return []
    notes = [f"low-bit weights: {result.low_bit.describe()}"]
    level = result.accuracy_level_note()
    if level is not None:
        notes.append(level)
    return notes
