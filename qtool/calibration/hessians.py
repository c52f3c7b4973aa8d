"""XᵀX of a layer's calibration inputs, the statistic GPTQ rounds weights against.

Collected in the one calibration pass next to the range observers (one K x K float64 matrix per
layer input, whatever the sample count) and merged across shards and processes by addition.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qtool.errors import CalibrationError, DataError, OutputError

# Flat positions of a K x K matrix's upper triangle, row by row, per K (a 1536-wide input:
# 9.4 MB, once): what a batch's product adds to a packed sum.
_UPPER: dict[int, np.ndarray] = {}


def _upper(features: int) -> np.ndarray:
    if features not in _UPPER:
        rows, cols = np.triu_indices(features)
        _UPPER[features] = rows * features + cols
    return _UPPER[features]


def pack_triangle(xtx: np.ndarray) -> np.ndarray:
    """Row i from column i on, for every row: K(K+1)/2 values."""
    return np.take(xtx, _upper(xtx.shape[0]))


def unpack_triangle(packed: np.ndarray, features: int) -> np.ndarray:
    """The symmetric K x K matrix whose upper triangle `pack_triangle` gave."""
    xtx = np.empty((features, features), dtype=np.float64)
    start = 0
    for i in range(features):
        row = packed[start : start + features - i]
        xtx[i, i:] = row
        xtx[i:, i] = row
        start += features - i
    return xtx


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
        # The sum is kept as its upper triangle (XᵀX is exactly symmetric: syrk products
        # added), half the bytes through calibration and the build, which hold every layer's
        # (SmolLM2-135M's 211 MatMul inputs: 805 MB in full, 403 MB packed); `_full` only for a
        # sum rebuilt whole (from_sum, merge) until `pack`.
        self._full: np.ndarray | None = None
        self._packed: np.ndarray | None = np.zeros(features * (features + 1) // 2, np.float64)
        # A finished sum the build reads back on each access instead of holding it: its triangle
        # in the staged Hessian file (`store`), or derived from another's (`scaled`).
        self._stored: Callable[[], np.ndarray] | None = None
        self.rows = 0

    @property
    def xtx(self) -> np.ndarray:
        """The K x K sum (after `pack`, rebuilt on each access: a new array, same bytes)."""
        if self._full is not None:
            return self._full
        if self._packed is not None:
            return unpack_triangle(self._packed, self.features)
        assert self._stored is not None
        return unpack_triangle(self._stored(), self.features)

    @xtx.setter
    def xtx(self, value: np.ndarray) -> None:
        self._full, self._packed, self._stored = value, None, None

    def store(self, read_triangle: Callable[[], np.ndarray]) -> None:
        """Let go of the sum: from now on `read_triangle` gives its packed upper triangle (the
        staged Hessian file's copy). The build reads each Hessian once or twice, layer by layer,
        and held all of them meanwhile (SmolLM2-135M: 403 MB, a Gemma 3 270M: more than its
        4-bit model)."""
        self.pack()
        self._full, self._packed, self._stored = None, None, read_triangle

    def scaled(self, inverse: np.ndarray, name: str) -> HessianAccumulator:
        """XᵀX of X diag(inverse), diag(inverse) XᵀX diag(inverse), computed from this one on
        each access rather than held beside it (AWQ's scaled layer inputs: a second copy of
        every Hessian it scales). Each entry of the product rounds on its own, in an order that
        can leave the two triangles a bit apart: the upper one is kept, mirrored."""
        inverse = np.asarray(inverse, np.float64)
        if inverse.shape != (self.features,):
            raise ValueError(f"{self.features} features, got {inverse.shape[0]} inverse scales")
        source = self

        def triangle() -> np.ndarray:
            return pack_triangle(source.xtx * inverse[:, None] * inverse[None, :])

        derived = HessianAccumulator(1, name)
        derived.features, derived.rows = self.features, self.rows
        derived._packed, derived._stored = None, triangle
        return derived

    def pack(self) -> None:
        """Hold a sum rebuilt whole (from_sum, merge) as its upper triangle again. A sum built
        by `update` or merged is exactly symmetric, so nothing changes; one built from a product
        that rounds each entry on its own (AWQ's diag(1/s) XᵀX diag(1/s): the two triangles
        differ in the last bit) keeps its upper triangle, mirrored."""
        if self._full is not None:
            self._packed, self._full = pack_triangle(self._full), None

    def update(self, x: np.ndarray) -> None:
        """Add the rows of x: memory is one batch's XᵀX, never the history."""
        if self._stored is not None:
            raise CalibrationError(f"tensor {self.name!r}: a stored or derived XᵀX takes no rows")
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
        if self._full is not None:
            self._full += product
        else:  # the same float64 additions, on the triangle only
            self._packed += np.take(product, _upper(self.features))
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


class HessianSpill:
    """A scratch folder of finished Hessians: each stored accumulator's triangle is written to
    its own .npy file and read back on access. The folder lives as long as an accumulator reads
    from it (each reader holds this object), so a calibration part by part
    (calibration/parts.py) holds one part's Hessians at a time, not the whole model's."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="qtool-hessians-")
        self._count = 0

    def store(self, accumulator: HessianAccumulator) -> None:
        """Write `accumulator`'s sum to the folder and let it go (`HessianAccumulator.store`)."""
        path = Path(self._folder.name) / f"{self._count}.npy"
        self._count += 1
        accumulator.pack()
        triangle = accumulator._packed
        if triangle is None:  # already stored or derived: nothing held to let go
            return
        try:
            np.save(path, triangle, allow_pickle=False)
        except OSError as exc:
            raise OutputError(
                f"{path.parent}: cannot hold the calibration Hessians ({exc.strerror}); free "
                "space in the temporary folder or point TMPDIR at a larger one"
            ) from None

        def read(spill: HessianSpill = self) -> np.ndarray:
            return np.load(path, allow_pickle=False)

        accumulator.store(read)
