"""Compare an FP32 ONNX model with its quantized version in ONNX Runtime.

Both models see exactly the same batches in one pass, so fidelity metrics (top-1 agreement, SQNR,
cosine) compare outputs for identical inputs and the evaluation set is streamed once, never held
in memory. Latency is measured separately on single-sample runs, alternating between the two
models so that clock-frequency drift or a noisy neighbour affects both equally.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import helper
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qtool.errors import DataError, ModelError
from qtool.ort_session import create_session

Batch = tuple[Mapping[str, np.ndarray], np.ndarray | None]
_WARMUP_RUNS = 5


@dataclass
class ModelMetrics:
    """Per-model numbers; accuracy is None when the evaluation set has no labels."""

    accuracy: float | None
    latency_ms_median: float
    latency_ms_p90: float
    file_bytes: int


@dataclass
class EvalResult:
    """FP32 vs quantized comparison; fidelity metrics are of the quantized output vs FP32."""

    fp32: ModelMetrics
    quant: ModelMetrics
    samples: int
    agreement: float
    sqnr_db: float
    cosine: float
    # Batch size of the latency runs: 1 unless the model's batch axis is fixed to another size.
    latency_batch: int = 1

    @property
    def has_labels(self) -> bool:
        return self.fp32.accuracy is not None and self.quant.accuracy is not None

    def accuracy_drop_points(self) -> float:
        """The CI-gate number: accuracy lost, or top-1 disagreement when there are no labels."""
        if self.has_labels:
            return (self.fp32.accuracy - self.quant.accuracy) * 100.0
        return (1.0 - self.agreement) * 100.0

    def speedup(self) -> float:
        """FP32 median latency over quantized median latency (> 1 means the quantized is faster)."""
        return self.fp32.latency_ms_median / self.quant.latency_ms_median

    def size_ratio(self) -> float:
        """FP32 file size over quantized file size (> 1 means the quantized is smaller)."""
        return self.fp32.file_bytes / self.quant.file_bytes

    def to_dict(self) -> dict:
        """JSON-ready: strict JSON has no Infinity, so an infinite SQNR is written as "inf"."""
        return {
            "fp32": asdict(self.fp32),
            "quant": asdict(self.quant),
            "samples": self.samples,
            "agreement": self.agreement,
            "sqnr_db": _json_float(self.sqnr_db),
            "cosine": self.cosine,
            "accuracy_drop_points": self.accuracy_drop_points(),
            "drop_metric": "accuracy" if self.has_labels else "top1_agreement",
            "speedup": self.speedup(),
            "size_ratio": self.size_ratio(),
            "latency_batch": self.latency_batch,
        }


def _json_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


# ---------------------------------------------------------------------------------------------
# Input validation


def _ort_type_to_numpy(ort_type: str, model: Path, name: str) -> np.dtype:
    """Map ORT's 'tensor(float)' strings through ONNX's own dtype table rather than a copy of it."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        raise ModelError(f"{model}: input {name!r} has type {ort_type}; only tensors are supported")
    elem = ort_type[len("tensor(") : -1].upper()
    elem = {"FLOAT": "FLOAT", "DOUBLE": "DOUBLE"}.get(elem, elem)
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


def _check_labels(labels: np.ndarray, predictions: np.ndarray, batch_index: int) -> np.ndarray:
    """Labels must give one class index per top-1 prediction (shape = output shape minus last)."""
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"evaluation labels in batch {batch_index} have dtype {labels.dtype}; "
            "expected integer class indices"
        )
    if labels.shape != predictions.shape:
        raise DataError(
            f"evaluation labels in batch {batch_index} have shape {labels.shape} but the model's "
            f"top-1 predictions have shape {predictions.shape}"
        )
    return labels


# ---------------------------------------------------------------------------------------------
# Metrics


class _Fidelity:
    """Streaming accumulators so memory stays flat in the number of samples."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.cosine_sum = 0.0
        self.samples = 0
        self.agree = 0
        self.predictions = 0
        self.correct_fp32 = 0
        self.correct_quant = 0

    def update(
        self, ref: np.ndarray, quant: np.ndarray, labels: np.ndarray | None, batch_index: int
    ) -> None:
        ref64 = ref.astype(np.float64)
        q64 = quant.astype(np.float64)
        self.signal += float(np.sum(ref64 * ref64))
        self.noise += float(np.sum((ref64 - q64) ** 2))

        n = ref64.shape[0] if ref64.ndim else 1
        a = ref64.reshape(n, -1)
        b = q64.reshape(n, -1)
        self.cosine_sum += float(np.sum(_cosine_rows(a, b)))
        self.samples += n

        top_ref = np.argmax(ref, axis=-1)
        top_q = np.argmax(quant, axis=-1)
        self.agree += int(np.count_nonzero(top_ref == top_q))
        self.predictions += top_ref.size
        if labels is not None:
            labels = _check_labels(labels, top_ref, batch_index)
            self.correct_fp32 += int(np.count_nonzero(top_ref == labels))
            self.correct_quant += int(np.count_nonzero(top_q == labels))

    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine; two all-zero rows are identical (1), one all-zero row is orthogonal (0)."""
    dot = np.sum(a * b, axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 0.0)
    return np.where(both_zero, 1.0, cos)


def _model_bytes(path: Path) -> int:
    """Size on disk including external-data files, so >2 GB models are not reported as tiny."""
    total = path.stat().st_size
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt file
        raise ModelError(f"cannot read {path}: {exc}") from exc
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
# Latency


def _latency_feed(
    inputs: Mapping[str, np.ndarray], specs: list[_InputSpec]
) -> tuple[dict[str, np.ndarray], int]:
    """The first sample of the first batch, or the whole batch when the batch axis is fixed > 1."""
    fixed = {s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], int)}
    if fixed and fixed != {1}:
        # The model cannot run a single sample; time its fixed batch and say so in the result.
        batch = next(iter(inputs.values())).shape[0]
        return {name: np.ascontiguousarray(a) for name, a in inputs.items()}, batch
    return {name: np.ascontiguousarray(a[:1]) for name, a in inputs.items()}, 1


def _measure_latency(
    sessions: list[onnxruntime.InferenceSession],
    feed: dict[str, np.ndarray],
    runs: int,
) -> list[tuple[float, float]]:
    """Median and p90 in ms per session; runs alternate between sessions to share any drift."""
    outputs = [[s.get_outputs()[0].name] for s in sessions]
    for session, out in zip(sessions, outputs, strict=True):
        for _ in range(_WARMUP_RUNS):
            session.run(out, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for k, (session, out) in enumerate(zip(sessions, outputs, strict=True)):
            start = time.perf_counter_ns()
            session.run(out, feed)
            times[k].append((time.perf_counter_ns() - start) / 1e6)
    return [(float(np.median(t)), float(np.percentile(t, 90))) for t in times]


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
    threads: int | None = None,
    latency_runs: int = 50,
    progress: bool = True,
) -> EvalResult:
    """Run both models over `batches` (inputs by name, labels or None) and compare them.

    Top-1 is the argmax over the last axis of the first output; labels, when given, must have the
    shape of that argmax. Either every batch has labels or none does.
    """
    if latency_runs < 1:
        raise ValueError(f"latency_runs must be >= 1, got {latency_runs}")
    fp32_path, quant_path = Path(fp32_path), Path(quant_path)
    sizes = (_model_bytes(fp32_path), _model_bytes(quant_path))
    ref_session = create_session(fp32_path, threads=threads)
    q_session = create_session(quant_path, threads=threads)
    ref_specs = _input_specs(ref_session, fp32_path)
    q_specs = _input_specs(q_session, quant_path)
    ref_out = ref_session.get_outputs()[0].name
    q_out = q_session.get_outputs()[0].name

    fidelity = _Fidelity()
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
            elif has_labels != (labels is not None):
                raise DataError(
                    f"evaluation batch {index} {'has no' if has_labels else 'has'} labels but "
                    f"batch 1 {'has' if has_labels else 'has none'}; label all batches or none"
                )
            ref = ref_session.run([ref_out], dict(inputs))[0]
            quant = q_session.run([q_out], dict(inputs))[0]
            if ref.shape != quant.shape:
                raise ModelError(
                    f"{quant_path.name} output {q_out!r} has shape {quant.shape} but "
                    f"{fp32_path.name} output {ref_out!r} has shape {ref.shape}"
                )
            fidelity.update(ref, quant, labels, index)
            if first_inputs is None:
                first_inputs = inputs
            bar.advance(task)

    if first_inputs is None:
        raise DataError("the evaluation data yielded no batches")

    feed, latency_batch = _latency_feed(first_inputs, ref_specs)
    (ref_med, ref_p90), (q_med, q_p90) = _measure_latency(
        [ref_session, q_session], feed, latency_runs
    )

    def accuracy(correct: int) -> float | None:
        return correct / fidelity.predictions if has_labels else None

    return EvalResult(
        fp32=ModelMetrics(accuracy(fidelity.correct_fp32), ref_med, ref_p90, sizes[0]),
        quant=ModelMetrics(accuracy(fidelity.correct_quant), q_med, q_p90, sizes[1]),
        samples=fidelity.samples,
        agreement=fidelity.agree / fidelity.predictions,
        sqnr_db=fidelity.sqnr_db(),
        cosine=fidelity.cosine_sum / fidelity.samples,
        latency_batch=latency_batch,
    )


# ---------------------------------------------------------------------------------------------
# Table


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def _db(value: float) -> str:
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


def render_table(result: EvalResult) -> Table:
    """The human summary. Fidelity metrics compare quantized to FP32, so their FP32 cell is '-'.

    The row that carries the pass/fail drop is marked: accuracy with labels, top-1 agreement
    without (where cosine is the better headline for embedding outputs).
    """
    table = Table(title=f"FP32 vs quantized ({result.samples} samples)")
    table.add_column("metric")
    table.add_column("FP32", justify="right")
    table.add_column("quantized", justify="right")
    table.add_column("change", justify="right")

    change = -result.accuracy_drop_points()
    drop = f"{change + 0.0:+.2f} pts"  # + 0.0 turns -0.0 into 0.0 so no change reads "+0.00"
    labelled = result.has_labels
    table.add_row(
        "accuracy",
        _pct(result.fp32.accuracy),
        _pct(result.quant.accuracy),
        drop if labelled else "n/a",
    )
    table.add_row(
        "top-1 agreement",
        "-",
        _pct(result.agreement),
        "" if labelled else drop,
        style=None if labelled else "bold",
    )
    table.add_row("SQNR dB", "-", _db(result.sqnr_db), "")
    table.add_row("cosine", "-", f"{result.cosine:.5f}", "", style=None if labelled else "bold")
    batch = "" if result.latency_batch == 1 else f" (batch {result.latency_batch})"
    for label, ref, q in (
        ("latency median", result.fp32.latency_ms_median, result.quant.latency_ms_median),
        ("latency p90", result.fp32.latency_ms_p90, result.quant.latency_ms_p90),
    ):
        table.add_row(f"{label}{batch}", _ms(ref), _ms(q), f"{_ratio(ref, q)} speed-up")
    table.add_row(
        "file size",
        _size(result.fp32.file_bytes),
        _size(result.quant.file_bytes),
        f"{_ratio(result.fp32.file_bytes, result.quant.file_bytes)} smaller",
    )
    return table
