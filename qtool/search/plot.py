"""sensitivity.png: the ranking as bars, and the layer-by-layer SQNR in graph order.

matplotlib is an optional extra (`pip install 'qtool[plot]'`): without it `plot_png` raises
PlotUnavailable, which the CLI reports as a one-line note, never an error.
"""

from __future__ import annotations

import io
import math

from qtool.search.result import SENSITIVITY_PARTS, SensitivityResult
from qtool.search.sensitivity_report import bar_basis, format_penalty

INSTALL_HINT = "pip install 'qtool[plot]'"


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def plot_png(result: SensitivityResult) -> bytes:
    """The PNG bytes (no timestamp in the metadata: same result, same bytes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise PlotUnavailable(f"matplotlib is not installed ({INSTALL_HINT})") from None

    ranking = result.ranking()
    layered = [n for n in result.nodes if n.layer is not None]
    rows = 2 if layered else 1
    height = max(3.0, 0.28 * len(ranking) + 1.5)
    figure, axes = plt.subplots(rows, 1, figsize=(9, height * rows), squeeze=False)
    axis = axes[0][0]
    names = [n.name for n in ranking][::-1]
    if "one-at-a-time" in result.modes:
        width = 0.8 / max(len(result.candidates), 1)
        for k, candidate in enumerate(result.candidates):
            values = []
            for node in ranking[::-1]:
                measured = node.one_at_a_time.get(candidate)
                ok = measured is not None and measured.skipped is None
                values.append(measured.penalty if ok else 0.0)
            positions = [
                i + (k - (len(result.candidates) - 1) / 2) * width for i in range(len(names))
            ]
            axis.barh(positions, values, height=width, label=f"{candidate} alone")
        axis.set_xlabel(f"penalty: {result.metric.penalty_unit}")
        axis.legend(loc="lower right")
    else:
        basis = bar_basis(result) or 0
        values = [result.sensitivity(n)[basis] for n in ranking[::-1]]
        axis.barh(range(len(names)), [v if math.isfinite(v) else 0.0 for v in values])
        axis.set_xlabel(SENSITIVITY_PARTS[basis])
    axis.set_yticks(range(len(names)), names, fontsize=7)
    axis.set_title(
        f"{result.metric.name} of {result.metric.output!r}, {result.samples} samples; "
        f"full plan {format_penalty(result, result.full.penalty)}",
        fontsize=9,
    )
    if layered:
        axis = axes[1][0]
        sqnr_out = [n.layer.sqnr_out_db for n in layered]
        sqnr_in = [n.layer.sqnr_in_db for n in layered]
        xs = range(len(layered))
        axis.plot(xs, [_finite(v) for v in sqnr_out], marker="o", label="output")
        axis.plot(xs, [_finite(v) for v in sqnr_in], marker=".", linestyle=":", label="input")
        axis.set_xticks(list(xs), [n.name for n in layered], rotation=90, fontsize=6)
        axis.set_ylabel("SQNR vs float (dB)")
        axis.set_title("layer by layer, fully quantized (unfused), graph order", fontsize=9)
        axis.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def _finite(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return math.nan
    return value
