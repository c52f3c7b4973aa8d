"""The flip model: how many predictions a noise on the class scores is expected to change, and
whether a max_drop gate then passes, from the float model's own top-1 margins on the evaluation
set.

Why: a max_drop budget counts changed predictions, a step. One node quantized alone on the
analysis subset (128 samples) usually changes none of them, so its measured drop is exactly 0
while it does move the scores; the knapsack then takes it as free, and several such "free" nodes
together, or the samples the subset did not hold, change predictions. What a node does to the
scores is continuous: the mean squared change of the top-1 margin it causes
(`SignalQuality(margin=True).margin_noise()`, the *margin noise*, N). This module turns a
margin noise into the step metric, so the budget is checked in its own unit:

- a prediction whose float margin (top score minus runner-up) is m changes when the noise on
  that margin is below -m; with the noise Gaussian of variance N, that has probability
  p = Phi(-m / sqrt(N));
- the expected number of changes, lambda, is the sum of those probabilities over the
  predictions the metric counts: for agreement every prediction, for accuracy the ones float
  gets right (a changed wrong prediction seldom becomes right; counting none of those gains
  keeps the estimate on the safe side); the expected drop is 100 lambda / n points, n being all
  predictions;
- the gate counts whole predictions: a budget of B points admits k = floor(B n / 100) of them.
  The number changed is a sum of independent trials with small p, close to Poisson(lambda), so
  the gate passes with probability P(Poisson(lambda) <= k). The knapsack's capacity is the
  largest noise at which that is at least one half: the plan it proposes is more likely to pass
  than not (lambda at most ln 2 for k = 0, 1.68 for k = 1, about k + 0.67 beyond), which the
  verification then settles. Both are monotone in the noise, so a capacity in noise is the
  gate's own check;
- margin noises of separately quantized nodes add (independent rounding errors: their powers
  add, as the SQNR budget's noise ratios do), so the knapsack adds them.

Only the runner-up class is modelled (a third class close to the top one can change the
prediction too), and the errors are neither exactly Gaussian nor independent: the search
verifies each plan on the evaluation set and promotes nodes where the prediction was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qtool.errors import DataError
from qtool.metrics.signal import top1_margins

_BISECTIONS = 200
# Noise bracket, relative to the margins: Phi(-40) ~ 4e-350 (no prediction changes) and
# Phi(-1e-6) ~ 0.5 (every counted prediction is a coin toss).
_LOW, _HIGH = 1.0 / 40.0, 1e6


def _half_erfc(x: np.ndarray) -> np.ndarray:
    """0.5 erfc(x) for x >= 0, i.e. Phi(-x sqrt(2)): the Chebyshev fit of Numerical Recipes
    (erfcc, fractional error below 1.2e-7 everywhere), vectorised, so a bisection over many
    predictions stays fast without scipy."""
    t = 1.0 / (1.0 + 0.5 * x)
    poly = -1.26551223 + t * (
        1.00002368
        + t
        * (
            0.37409196
            + t
            * (
                0.09678418
                + t
                * (
                    -0.18628806
                    + t
                    * (
                        0.27886807
                        + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
                    )
                )
            )
        )
    )
    return 0.5 * t * np.exp(-x * x + poly)


def poisson_cdf(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean), summed in log space (any k, any mean)."""
    if mean <= 0.0:
        return 1.0
    if math.isinf(mean):
        return 0.0
    j = np.arange(k + 1, dtype=np.float64)
    log_factorials = np.concatenate([[0.0], np.cumsum(np.log(j[1:]))])
    log_terms = -mean + j * math.log(mean) - log_factorials
    top = float(np.max(log_terms))
    return min(1.0, math.exp(top) * float(np.sum(np.exp(log_terms - top))))


def poisson_median_mean(k: int) -> float:
    """The mean at which P(Poisson(mean) <= k) is one half (ln 2 for k = 0; between k and k + 1
    otherwise): the most changes on average a gate admitting k is still likely to pass with."""
    low, high = max(0.0, k - 1.0), k + 1.0
    for _ in range(_BISECTIONS):
        middle = 0.5 * (low + high)
        if poisson_cdf(k, middle) >= 0.5:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * high:
            break
    return low


@dataclass(frozen=True)
class FlipModel:
    """The evaluation set's float margins of the predictions the metric counts, and how many
    predictions there are in all (the denominator of accuracy and agreement)."""

    margins: np.ndarray  # float64, >= 0
    predictions: int

    @classmethod
    def from_outputs(
        cls, reference: Sequence[np.ndarray], labels: Sequence[np.ndarray] | None
    ) -> FlipModel:
        """From the float model's gated output per batch; `labels` (accuracy) keeps only the
        predictions float gets right, None (agreement) keeps all."""
        margins, total = [], 0
        for index, output in enumerate(reference):
            shape = np.shape(output)
            if len(shape) < 2 or shape[-1] < 2:
                raise DataError(
                    f"the gated output has shape {shape}: a top-1 prediction needs a class axis "
                    "of 2 or more (use a min_cosine or min_sqnr budget)"
                )
            margin = top1_margins(output)
            total += margin.size
            if labels is not None:
                truth = np.asarray(labels[index]).reshape(-1)
                classes = np.asarray(output).shape[-1]
                predicted = np.argmax(np.asarray(output).reshape(-1, classes), axis=-1)
                if truth.size != predicted.size:
                    raise DataError(
                        f"batch {index}: {truth.size} labels for {predicted.size} predictions"
                    )
                margin = margin[predicted == truth]
            margins.append(margin)
        if total == 0:
            raise DataError("the evaluation set holds no prediction to count")
        return cls(np.sort(np.concatenate(margins)), total)

    @property
    def counted(self) -> int:
        return int(self.margins.size)

    def expected_drop(self, noise: float) -> float:
        """Points of the metric a margin noise `noise` is expected to cost (0 for no noise)."""
        if noise <= 0.0 or self.counted == 0:
            return 0.0
        if math.isinf(noise):
            return 50.0 * self.counted / self.predictions
        changed = _half_erfc(self.margins / math.sqrt(2.0 * noise))
        return 100.0 * float(np.sum(changed)) / self.predictions

    def noise_for(self, drop: float) -> float:
        """The largest margin noise whose expected drop is at most `drop` points: 0 when no
        noise is (drop <= 0, or tied float predictions already cost more), inf when every
        noise is (the drop is at least what coin tosses on every counted prediction cost)."""
        if drop <= 0.0:
            return 0.0
        if self.counted == 0 or drop >= self.expected_drop(math.inf):
            return math.inf
        positive = self.margins[self.margins > 0.0]
        if positive.size == 0:  # every counted prediction is a tie: any noise costs half of them
            return 0.0
        low = (float(positive[0]) * _LOW) ** 2
        high = (float(positive[-1]) * _HIGH) ** 2
        if self.expected_drop(low) > drop:
            return 0.0
        if self.expected_drop(high) <= drop:
            return math.inf
        log_low, log_high = math.log(low), math.log(high)
        for _ in range(_BISECTIONS):
            middle = 0.5 * (log_low + log_high)
            if self.expected_drop(math.exp(middle)) <= drop:
                log_low = middle
            else:
                log_high = middle
            if log_high - log_low < 1e-12:
                break
        return math.exp(log_low)  # the side known to stay within the drop

    def admitted(self, limit: float) -> int:
        """Changed predictions a max_drop of `limit` points admits on these predictions."""
        return max(0, math.floor(limit * self.predictions / 100.0 + 1e-9))

    def pass_probability(self, noise: float, limit: float) -> float:
        """P(the gate passes) at margin noise `noise`: P(Poisson(lambda) <= admitted)."""
        changes = self.expected_drop(noise) * self.predictions / 100.0
        return poisson_cdf(self.admitted(limit), changes)

    def capacity(self, limit: float) -> float:
        """The largest margin noise at which a max_drop gate of `limit` points passes with
        probability at least one half (inf when every noise does)."""
        changes = poisson_median_mean(self.admitted(limit))
        return self.noise_for(100.0 * changes / self.predictions)

    def describe(self) -> dict:
        return {
            "predictions": self.predictions,
            "counted": self.counted,
            "median_margin": float(np.median(self.margins)) if self.counted else None,
        }
