"""Signal quality of a test tensor against its reference, accumulated batch by batch.

One definition of SQNR, cosine, top-1 agreement and peak error for every comparison qtool makes:
evaluate (quantized vs FP32, fused vs unfused), verify's fused-vs-unfused check, analyze's layer
SQNRs and scores, SmoothQuant's and AdaRound's output errors, QAT's export check and the
benchmarks. Two numbers that carry the same name then mean the same thing wherever they are
printed. It imports only numpy, so every layer of the package may use it
(tests/test_architecture.py puts it with the utilities).

Sums are kept in float64 and folded into Python floats per batch, so a data set of any size
needs the memory of one batch, and `merge` of two accumulators is exact: it adds the same
numbers in the same order as one accumulator that saw both streams.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

CosineMode = Literal["rows", "global"]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) of summed squares; inf when identical, -inf for a zero signal."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def db_from_noise_ratio(ratio: float) -> float:
    """SQNR in dB of a noise-to-signal power ratio (the search's penalty unit): -10 log10(ratio)."""
    return math.inf if ratio <= 0 else -10.0 * math.log10(ratio)


def noise_ratio_from_db(db: float) -> float:
    """The noise-to-signal power ratio an SQNR in dB stands for: 10^(-dB / 10); 0 for +inf."""
    return 10.0 ** (-db / 10.0)


def top_two(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the largest and the second largest value along the last axis of a 2-D
    [predictions, classes] array (ties: the first index is the top one, the next the runner-up)."""
    top = np.argmax(values, axis=-1)
    rows = np.arange(values.shape[0])
    others = np.array(values, dtype=np.float64, copy=True)
    others[rows, top] = -np.inf
    return top, np.argmax(others, axis=-1)


def top1_margins(values: np.ndarray) -> np.ndarray:
    """Per prediction (the last axis holds the class scores), the top score minus the runner-up's
    in float64: how far the top-1 prediction is from changing. Needs two classes or more."""
    scores = np.asarray(values, np.float64)
    if scores.ndim < 2 or scores.shape[-1] < 2:
        raise ValueError(f"top-1 margins need a class axis of 2 or more, got shape {scores.shape}")
    flat = scores.reshape(-1, scores.shape[-1])
    top, runner = top_two(flat)
    rows = np.arange(flat.shape[0])
    return flat[rows, top] - flat[rows, runner]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine; two all-zero rows are identical (1), one all-zero row is orthogonal (0)."""
    dot = np.sum(a * b, axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 0.0)
    return np.where(both_zero, 1.0, cos)


# Elements of one batch read at once in float64 (8 MB per temporary); larger batches go by slices.
CHUNK_ELEMENTS = 1 << 20


def _cosine_of_sums(dot: float, ref_energy: float, test_energy: float) -> float:
    """`cosine_rows`' rule from a row's sums: both all-zero 1, one all-zero 0."""
    if ref_energy == 0.0 and test_energy == 0.0:
        return 1.0
    norms = math.sqrt(ref_energy) * math.sqrt(test_energy)
    return dot / norms if norms > 0 else 0.0


class SignalQuality:
    """Streaming comparison of `test` tensors with their `reference`.

    Always kept: the reference's energy and the error's (SQNR, noise ratio, MSE), the element and
    row counts. The rest costs passes over every batch, so a caller asks for what it prints:

    - `cosine="rows"`: the mean over rows (the first axis: samples) of each row's cosine, what
      evaluate reports, so one bad sample is not averaged away by the size of the others;
      `cosine="global"`: one cosine of all values (a benchmark's flattened outputs).
    - `top1=True`: agreement of the argmax over the last axis, for tensors of rank >= 2 (a rank-1
      tensor has no class axis: agreement stays None).
    - `peak=True`: the largest absolute difference.
    - `margin=True`: the mean squared change of the top-1 margin (the reference's top class score
      minus its runner-up's, both read in the test tensor too), for tensors whose last axis holds
      two classes or more. Continuous where agreement is a step: a test tensor that changes no
      prediction still moves the margins, and the mixed-precision search predicts the
      predictions a noise of that size changes from it (qtool/search/flips.py).
    """

    def __init__(
        self,
        *,
        cosine: CosineMode | None = None,
        top1: bool = False,
        peak: bool = False,
        margin: bool = False,
    ) -> None:
        if cosine not in (None, "rows", "global"):
            raise ValueError(f"cosine must be None, 'rows' or 'global', got {cosine!r}")
        self.cosine_mode = cosine
        self.top1 = top1
        self.peak = peak
        self.margin = margin
        self.signal = 0.0  # sum of reference^2
        self.noise = 0.0  # sum of (reference - test)^2
        self.elements = 0
        self.rows = 0  # samples: the first axis (1 for a scalar)
        self.cosine_sum = 0.0  # "rows": sum of per-row cosines
        self.dot = 0.0  # "global": sum of reference * test
        self.test_energy = 0.0  # "global": sum of test^2
        self.agree = 0
        self.predictions = 0
        self.max_abs_diff = 0.0
        self.margin_noise_sum = 0.0  # "margin": sum of squared top-1 margin changes
        self.margin_predictions = 0

    def update(self, reference: np.ndarray, test: np.ndarray) -> None:
        """Add one batch; `test` has the shape of `reference`.

        A batch larger than `CHUNK_ELEMENTS` (an LLM's logits: [1, 512, 262144] is 134M values,
        whose float64 temporaries took 5 GB at once) is read in slices of whole rows of its last
        axis, so the float64 working set stays one slice; the sums are the same up to float64
        rounding (another summation order), the counts and top-1 decisions exactly the same."""
        reference, test = np.asarray(reference), np.asarray(test)
        if reference.ndim >= 2 and reference.size > CHUNK_ELEMENTS:
            self._update_by_slices(reference, test)
            return
        ref64 = np.asarray(reference, np.float64)
        test64 = np.asarray(test, np.float64)
        diff = ref64 - test64
        self.signal += float(np.sum(ref64 * ref64))
        self.noise += float(np.sum(diff * diff))
        self.elements += int(diff.size)
        n = ref64.shape[0] if ref64.ndim else 1
        self.rows += n
        if self.cosine_mode == "rows":
            rows = cosine_rows(ref64.reshape(n, -1), test64.reshape(n, -1))
            self.cosine_sum += float(np.sum(rows))
        elif self.cosine_mode == "global":
            self.dot += float(np.sum(ref64 * test64))
            self.test_energy += float(np.sum(test64 * test64))
        if self.top1 and np.ndim(reference) >= 2:
            top_ref = np.argmax(reference, axis=-1)
            top_test = np.argmax(test, axis=-1)
            self.agree += int(np.count_nonzero(top_ref == top_test))
            self.predictions += int(top_ref.size)
        if self.peak and diff.size:
            self.max_abs_diff = max(self.max_abs_diff, float(np.abs(diff).max()))
        if self.margin and ref64.ndim >= 2 and ref64.shape[-1] >= 2:
            classes = ref64.shape[-1]
            self._add_margins(ref64.reshape(-1, classes), test64.reshape(-1, classes))

    def _add_margins(self, ref2: np.ndarray, test2: np.ndarray) -> None:
        """Margin changes of float64 [predictions, classes] rows into the margin sums."""
        top, runner = top_two(ref2)
        rows = np.arange(ref2.shape[0])
        change = (test2[rows, top] - test2[rows, runner]) - (ref2[rows, top] - ref2[rows, runner])
        self.margin_noise_sum += float(np.sum(change * change))
        self.margin_predictions += int(change.size)

    def _update_by_slices(self, reference: np.ndarray, test: np.ndarray) -> None:
        """`update` of a large batch: each sample's rows of the last axis, a slice at a time."""
        if test.shape != reference.shape:
            raise ValueError(f"test shape {test.shape} differs from reference {reference.shape}")
        samples, classes = reference.shape[0], reference.shape[-1]
        step = max(1, CHUNK_ELEMENTS // max(classes, 1))
        self.rows += samples
        for index in range(samples):
            ref_rows = reference[index].reshape(-1, classes)
            test_rows = test[index].reshape(-1, classes)
            sample_dot = sample_ref = sample_test = 0.0
            for start in range(0, ref_rows.shape[0], step):
                ref, out = ref_rows[start : start + step], test_rows[start : start + step]
                ref64, test64 = ref.astype(np.float64), out.astype(np.float64)
                diff = ref64 - test64
                energy = float(np.sum(ref64 * ref64))
                self.signal += energy
                self.noise += float(np.sum(diff * diff))
                self.elements += int(diff.size)
                if self.cosine_mode is not None:
                    sample_ref += energy
                    sample_dot += float(np.sum(ref64 * test64))
                    sample_test += float(np.sum(test64 * test64))
                if self.top1:
                    same = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
                    self.agree += int(np.count_nonzero(same))
                    self.predictions += int(same.size)
                if self.peak and diff.size:
                    self.max_abs_diff = max(self.max_abs_diff, float(np.abs(diff).max()))
                if self.margin and classes >= 2:
                    self._add_margins(ref64, test64)
            if self.cosine_mode == "rows":
                self.cosine_sum += _cosine_of_sums(sample_dot, sample_ref, sample_test)
            elif self.cosine_mode == "global":
                self.dot += sample_dot
                self.test_energy += sample_test

    def merge(self, other: SignalQuality) -> SignalQuality:
        """Add `other`'s batches to this one (same measures), e.g. per-output into a total."""
        mine = (self.cosine_mode, self.top1, self.peak, self.margin)
        if (other.cosine_mode, other.top1, other.peak, other.margin) != mine:
            raise ValueError("merge needs accumulators that measure the same things")
        self.signal += other.signal
        self.noise += other.noise
        self.elements += other.elements
        self.rows += other.rows
        self.cosine_sum += other.cosine_sum
        self.dot += other.dot
        self.test_energy += other.test_energy
        self.agree += other.agree
        self.predictions += other.predictions
        self.max_abs_diff = max(self.max_abs_diff, other.max_abs_diff)
        self.margin_noise_sum += other.margin_noise_sum
        self.margin_predictions += other.margin_predictions
        return self

    def sqnr_db(self) -> float:
        return sqnr_db(self.signal, self.noise)

    def mse(self) -> float:
        """Mean squared error per element (0 before any batch)."""
        return self.noise / max(self.elements, 1)

    def cosine(self) -> float:
        """The cosine asked for at construction: mean over rows, or of all values at once."""
        if self.cosine_mode == "rows":
            return self.cosine_sum / max(self.rows, 1)
        if self.cosine_mode == "global":
            norms = math.sqrt(self.test_energy) * math.sqrt(self.signal)
            if norms == 0.0:
                return 1.0 if self.test_energy == self.signal else 0.0
            return self.dot / norms
        raise ValueError("this accumulator measures no cosine (construct it with cosine=...)")

    def agreement(self) -> float | None:
        """Fraction of top-1 predictions that match; None without a class axis (or top1=False)."""
        return self.agree / self.predictions if self.predictions else None

    def margin_noise(self) -> float | None:
        """Mean squared change of the top-1 margin per prediction; None without a class axis of
        two or more (or margin=False)."""
        if not self.margin_predictions:
            return None
        return self.margin_noise_sum / self.margin_predictions

    def changed(self) -> int:
        """Top-1 predictions that differ from the reference's."""
        return self.predictions - self.agree


def json_float(value: float) -> float | str:
    """A number for strict JSON, which has no Infinity or NaN: an SQNR of identical tensors is
    "inf", a measure that does not apply (a margin noise without a class axis) "nan"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def format_db(value: float) -> str:
    """An SQNR for people: two decimals, or "inf" / "-inf"."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"
