"""What an analysis measured, per node and per candidate precision, and how it ranks the nodes.

`SensitivityResult` is the object the mixed-precision search consumes: `penalty(node, precision)`
is the metric penalty (scoring.Metric.penalty: 0 for float, larger is worse) of quantizing that
node alone at that precision, measured one at a time against the float model. It round-trips
through JSON (the cache and sensitivity.json), so a rerun reads exactly what the first run wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qtool.metrics.signal import noise_ratio_from_db
from qtool.search.layers import LayerScore
from qtool.search.scoring import Metric

MODES = ("one-at-a-time", "all-but-one", "layer")
MODE_CHOICES = (*MODES, "all")
CANDIDATES = ("int8", "int4", "fp8", "fp16", "bf16")
# What each part of SensitivityResult.sensitivity is, for tables and plots.
SENSITIVITY_PARTS = (
    "one-at-a-time penalty",
    "all-but-one recovery",
    "output noise-to-signal, node alone",
    "dB lost in the node (layer run)",
)


@dataclass(frozen=True)
class Measurement:
    """One variant scored: the metric's value and penalty, SQNR and cosine of the gated output,
    and the seconds it cost (plan, write, ONNX Runtime session, run). `skipped` says why a
    variant could not be built; its numbers are then NaN. `margin_noise`: for accuracy and
    agreement, the mean squared change of the top-1 margin (scoring.Score), NaN otherwise."""

    value: float
    penalty: float
    sqnr_db: float
    cosine: float
    seconds: float
    skipped: str | None = None
    margin_noise: float = math.nan

    @classmethod
    def skip(cls, reason: str) -> Measurement:
        nan = math.nan
        return cls(nan, nan, nan, nan, 0.0, reason)

    def to_dict(self) -> dict:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        entry = {
            "metric": json_number(self.value),
            "penalty": json_number(self.penalty),
            "sqnr_db": json_number(self.sqnr_db),
            "cosine": self.cosine,
            "seconds": round(self.seconds, 4),
        }
        if not math.isnan(self.margin_noise):
            entry["margin_noise"] = json_number(self.margin_noise)
        return entry

    @classmethod
    def from_dict(cls, data: dict) -> Measurement:
        if "skipped" in data:
            return cls.skip(data["skipped"])
        return cls(
            _float(data["metric"]),
            _float(data["penalty"]),
            _float(data["sqnr_db"]),
            float(data["cosine"]),
            float(data["seconds"]),
            margin_noise=_float(data.get("margin_noise", "nan")),
        )


@dataclass
class NodeSensitivity:
    """One node the recipe's plan quantizes, and what each analysis measured for it."""

    name: str
    op_type: str
    index: int  # position among the analysed nodes, in graph order
    planned: str  # its precision in the recipe's plan
    weight: str | None  # its weight tensor, None for nodes without one
    weight_elements: int | None
    one_at_a_time: dict[str, Measurement] = field(default_factory=dict)  # by candidate
    all_but_one: Measurement | None = None
    layer: LayerScore | None = None

    @property
    def seconds(self) -> float:
        total = sum(m.seconds for m in self.one_at_a_time.values())
        return total + (self.all_but_one.seconds if self.all_but_one is not None else 0.0)


@dataclass
class SensitivityResult:
    recipe: str
    metric: Metric
    samples: int
    modes: tuple[str, ...]
    candidates: tuple[str, ...]
    float_value: float
    full: Measurement  # the recipe's own plan, fully quantized
    nodes: list[NodeSensitivity]  # graph order
    key: str  # the cache key: model fingerprint, statistics, data and settings
    layer_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    cached: bool = False  # every number came from the cache (nothing ran)

    def node(self, name: str) -> NodeSensitivity:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def penalty(self, name: str, precision: str) -> float | None:
        """Penalty of quantizing node `name` alone at `precision` (0 for "float"); None when
        that candidate was not measured or could not be built."""
        if precision == "float":
            return 0.0
        measured = self.node(name).one_at_a_time.get(precision)
        if measured is None or measured.skipped is not None:
            return None
        return measured.penalty

    def margin_noise(self, name: str, precision: str) -> float | None:
        """Margin noise of node `name` alone at `precision` (0 for "float"); None when that
        candidate was not measured, NaN when the metric has no class axis (cosine, SQNR)."""
        if precision == "float":
            return 0.0
        measured = self.node(name).one_at_a_time.get(precision)
        if measured is None or measured.skipped is not None:
            return None
        return measured.margin_noise

    def penalties(self) -> dict[str, dict[str, float]]:
        """Node -> {precision: penalty} over float and every measured candidate."""
        table = {}
        for node in self.nodes:
            row = {"float": 0.0}
            for precision, measured in node.one_at_a_time.items():
                if measured.skipped is None:
                    row[precision] = measured.penalty
            table[node.name] = row
        return table

    def recovery(self, name: str) -> float | None:
        """Penalty the full plan loses when node `name` alone is kept float (all-but-one)."""
        measured = self.node(name).all_but_one
        if measured is None or measured.skipped is not None:
            return None
        return self.full.penalty - measured.penalty

    def sensitivity(self, node: NodeSensitivity) -> tuple[float, float, float, float]:
        """Sort key parts, larger = more sensitive (absent parts: -inf): the worst
        one-at-a-time penalty; the all-but-one recovery; the output noise-to-signal ratio with
        the node alone quantized (which still separates nodes whose accuracy never moved on the
        subset); the dB the node loses in the layer run."""
        measured = [m for m in node.one_at_a_time.values() if m.skipped is None]
        recovery = self.recovery(node.name)
        lost = node.layer.lost_db if node.layer is not None else None
        if node.layer is not None and lost is None:
            lost = -node.layer.sqnr_out_db
        noise = [noise_ratio_from_db(m.sqnr_db) for m in measured if not math.isnan(m.sqnr_db)]
        return (
            max(m.penalty for m in measured) if measured else -math.inf,
            recovery if recovery is not None else -math.inf,
            max(noise) if noise else -math.inf,
            lost if lost is not None and not math.isnan(lost) else -math.inf,
        )

    def ranking(self) -> list[NodeSensitivity]:
        """Most sensitive first; ties keep graph order, so the ranking is deterministic."""

        def key(node: NodeSensitivity):
            parts = self.sensitivity(node)
            return tuple(-p for p in parts) + (node.index,)

        return sorted(self.nodes, key=key)

    @property
    def seconds(self) -> float:
        return self.full.seconds + sum(n.seconds for n in self.nodes) + self.layer_seconds

    @property
    def variants(self) -> int:
        counted = sum(
            sum(m.skipped is None for m in n.one_at_a_time.values())
            + (n.all_but_one is not None and n.all_but_one.skipped is None)
            for n in self.nodes
        )
        return counted + 1


def json_number(value: float) -> float | str:
    """Strict JSON has no NaN or Infinity: they are written as strings."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _float(value: float | str) -> float:
    return float(value)
