"""XᵀX of a layer's calibration inputs, the statistic GPTQ rounds weights against.

Collected in the one calibration pass next to the range observers (one K x K float64 matrix per
layer input, whatever the sample count) and merged across shards and processes by addition.
"""

from __future__ import annotations

import numpy as np

from qtool.errors import CalibrationError, DataError


class HessianAccumulator:
    """Running XᵀX (float64) and row count of the inputs [..., K] of one layer.

    Every leading dimension is a row (batch, sequence, ...). Each batch's XᵀX is one float32
    BLAS product (the activations are float32; float64 arithmetic tripled MiniLM's calibration
    time for no GPTQ gain), added into the float64 running sum. Merging adds the sums: shards
    merged in a fixed order always give the same bytes, and equal a single pass over the same
    batches up to float64 rounding (addition is grouped differently).
    """

    def __init__(self, features: int, name: str = "input") -> None:
        if features < 1:
            raise ValueError(f"features must be positive, got {features}")
        self.features = features
        self.name = name
        self.xtx = np.zeros((features, features), dtype=np.float64)
        self.rows = 0

    def update(self, x: np.ndarray) -> None:
        """Add the rows of x: memory is one batch's XᵀX, never the history."""
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[-1] != self.features:
            raise DataError(
                f"tensor {self.name!r}: expected last dimension {self.features}, got shape "
                f"{x.shape}"
            )
        flat = np.ascontiguousarray(x.reshape(-1, self.features), dtype=np.float32)
        product = flat.T @ flat  # BLAS syrk: exactly symmetric
        if not np.all(np.isfinite(product)):
            raise DataError(f"tensor {self.name!r} contains NaN or Inf (or overflows float32)")
        self.xtx += product
        self.rows += flat.shape[0]

    def merge(self, other: HessianAccumulator) -> HessianAccumulator:
        """A new accumulator holding both: sums add exactly what one pass would add."""
        if other.features != self.features:
            raise CalibrationError(
                f"tensor {self.name!r}: cannot merge Hessians of {self.features} and "
                f"{other.features} features"
            )
        merged = HessianAccumulator(self.features, self.name)
        merged.xtx = self.xtx + other.xtx
        merged.rows = self.rows + other.rows
        return merged

    @classmethod
    def from_sum(cls, xtx: np.ndarray, rows: int, name: str = "input") -> HessianAccumulator:
        """Rebuild from a stored sum (a stats file, another process)."""
        xtx = np.asarray(xtx, dtype=np.float64)
        if xtx.ndim != 2 or xtx.shape[0] != xtx.shape[1]:
            raise CalibrationError(f"tensor {name!r}: XᵀX must be square, got {xtx.shape}")
        acc = cls(xtx.shape[0], name)
        acc.xtx = xtx.copy()
        acc.rows = int(rows)
        return acc

    def hessian(self) -> np.ndarray:
        """XᵀX / rows (GPTQ is invariant to the scale; the mean keeps magnitudes readable)."""
        if self.rows == 0:
            raise CalibrationError(f"tensor {self.name!r}: no calibration rows seen")
        return self.xtx / self.rows
