"""Next-token quality of a language model's logits, accumulated batch by batch.

Perplexity is exp of the mean negative log-likelihood of the labels over every predicted token;
against FP32's logits at the same positions, top-1 agreement is how often the argmax is FP32's,
and KL is the mean over predicted tokens of KL(FP32 || model) of the softmaxed logits. Labels
have the logits' shape less the vocabulary axis; a negative label (IGNORE_LABEL of the text
source) is a position with nothing to predict and is not counted.

Memory: a decoder's logits are window x vocabulary floats per sample (512 tokens of a 49k
vocabulary: 100 MB), so nothing here keeps them: each batch is reduced to a few numbers, and the
float64 log-softmax is taken CHUNK_ELEMENTS values at a time.

Sums are exact: every per-token value is added as the integer multiple of 2^-1074 that it is,
so the result does not depend on batch sizes, chunking, or the order accumulators are merged in.
It is the companion of metrics/signal.py (SQNR, cosine): that one compares two tensors, this one
scores a distribution against labels and against a reference distribution.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from qtool.errors import DataError

# float64 values of one log-softmax chunk (32 MB): 85 rows of a 49k vocabulary, 16 of 262k.
CHUNK_ELEMENTS = 1 << 22
_SCALE_BITS = 1074  # every finite float64 is an integer multiple of 2^-1074


class ExactSum:
    """A sum of float64 values without rounding: kept as an integer count of 2^-1074. Values
    that are not finite (a model that outputs NaN) are summed apart and make the sum NaN or
    infinite, as a float sum would."""

    def __init__(self) -> None:
        self.units = 0
        self.special = 0.0  # the sum of the values that are not finite

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64).ravel()
        finite = np.isfinite(values)
        if not finite.all():
            self.special += float(np.sum(values[~finite]))
            values = values[finite]
        for value in values.tolist():
            numerator, denominator = value.as_integer_ratio()  # denominator: a power of two
            self.units += numerator << (_SCALE_BITS - denominator.bit_length() + 1)

    def merge(self, other: ExactSum) -> None:
        self.units += other.units
        self.special += other.special

    def value(self) -> float:
        """The sum, rounded once (Python's int division is correctly rounded)."""
        return self.units / (1 << _SCALE_BITS) + self.special


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis, in float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def labelled_rows(labels: np.ndarray, vocab: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(flat row indices, their labels) of the positions that have a label, a chunk at a time
    (CHUNK_ELEMENTS values of `vocab` columns). DataError for a label outside the vocabulary."""
    flat = np.asarray(labels).reshape(-1)
    rows = np.flatnonzero(flat >= 0)
    targets = flat[rows]
    if targets.size and int(targets.max()) >= vocab:
        bad = int(rows[np.argmax(targets >= vocab)])
        raise DataError(
            f"label {int(flat[bad])} (position {bad} of the batch) is outside the {vocab} "
            "logits of the output: the tokenizer does not match the model"
        )
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, len(rows), step):
        yield rows[start : start + step], targets[start : start + step]


class TokenQuality:
    """One model's next-token numbers: NLL of the labels, and, when it is compared with a
    reference (FP32), top-1 agreement and KL(reference || model)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.nll = ExactSum()
        self.compared = 0
        self.agree = 0
        self.kl = ExactSum()

    def add(
        self, logp: np.ndarray, labels: np.ndarray, reference: np.ndarray | None = None
    ) -> None:
        """`logp` [n, vocab]: log-probabilities of n predicted positions whose targets are
        `labels` [n]; `reference`: the reference's log-probabilities at those positions."""
        self.tokens += len(labels)
        self.nll.add(-logp[np.arange(len(labels)), labels])
        if reference is None:
            return
        self.compared += len(labels)
        self.agree += int(np.count_nonzero(logp.argmax(-1) == reference.argmax(-1)))
        self.kl.add(np.sum(np.exp(reference) * (reference - logp), axis=-1))

    def update(
        self, logits: np.ndarray, labels: np.ndarray, reference: np.ndarray | None = None
    ) -> None:
        """Add one batch: `logits` [..., vocab], `labels` of its shape less the last axis,
        `reference` FP32's logits of the same shape (for agreement and KL) or None."""
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        ref = None if reference is None else reference.reshape(-1, vocab)
        for rows, targets in labelled_rows(labels, vocab):
            self.add(
                log_softmax(flat[rows]), targets, None if ref is None else log_softmax(ref[rows])
            )

    def merge(self, other: TokenQuality) -> TokenQuality:
        self.tokens += other.tokens
        self.nll.merge(other.nll)
        self.compared += other.compared
        self.agree += other.agree
        self.kl.merge(other.kl)
        return self

    def mean_nll(self) -> float | None:
        return self.nll.value() / self.tokens if self.tokens else None

    def perplexity(self) -> float | None:
        """exp(mean NLL) over every predicted token; None before any."""
        mean = self.mean_nll()
        return None if mean is None else math.exp(mean)

    def agreement(self) -> float | None:
        """Fraction of predicted positions whose argmax is the reference's."""
        return self.agree / self.compared if self.compared else None

    def mean_kl(self) -> float | None:
        """Mean over predicted positions of KL(reference || model), in nats."""
        return self.kl.value() / self.compared if self.compared else None


class NextTokenComparison:
    """FP32 and each variant of the quantized model scored on the same batches: FP32's
    log-softmax is taken once per chunk and compared with every variant's."""

    def __init__(self, variants: tuple[str, ...]) -> None:
        self.fp32 = TokenQuality()
        self.variants = {v: TokenQuality() for v in variants}

    def update(
        self, reference: np.ndarray, runs: Mapping[str, np.ndarray], labels: np.ndarray
    ) -> None:
        vocab = reference.shape[-1]
        ref = reference.reshape(-1, vocab)
        flat = {v: runs[v].reshape(-1, vocab) for v in self.variants}
        for rows, targets in labelled_rows(labels, vocab):
            ref_logp = log_softmax(ref[rows])
            self.fp32.add(ref_logp, targets)
            for variant, quality in self.variants.items():
                quality.add(log_softmax(flat[variant][rows]), targets, ref_logp)
