"""sensitivity.json and the rich tables of `qtool analyze`.

The JSON lists nodes most sensitive first, each with every measurement (metric value, penalty,
change vs float and vs the recipe's full plan, seconds), so a script reads the ranking without
re-sorting; `ranking` repeats just the names. Non-finite numbers are written as strings ("inf").
"""

from __future__ import annotations

import json
import math

from rich import box
from rich.table import Table
from rich.text import Text

from qtool import __version__
from qtool.search.result import (
    SENSITIVITY_PARTS,
    Measurement,
    NodeSensitivity,
    SensitivityResult,
    json_number,
)

BAR_WIDTH = 10


def _measurement(result: SensitivityResult, measured: Measurement) -> dict:
    entry = measured.to_dict()
    if measured.skipped is None:
        entry["delta_vs_float"] = json_number(measured.value - result.float_value)
        entry["delta_vs_full"] = json_number(measured.value - result.full.value)
    return entry


def _layer(node: NodeSensitivity) -> dict | None:
    if node.layer is None:
        return None
    layer = node.layer
    lost = layer.lost_db
    return {
        "output": layer.output,
        "sqnr_out_db": json_number(layer.sqnr_out_db),
        "input": layer.input,
        "sqnr_in_db": None if layer.sqnr_in_db is None else json_number(layer.sqnr_in_db),
        "lost_db": None if lost is None else json_number(lost),
    }


def to_dict(result: SensitivityResult) -> dict:
    ranking = result.ranking()
    nodes = []
    for rank, node in enumerate(ranking, start=1):
        entry = {
            "rank": rank,
            "name": node.name,
            "op_type": node.op_type,
            "graph_index": node.index,
            "planned": node.planned,
            "weight": node.weight,
            "weight_elements": node.weight_elements,
            "sensitivity": {
                part: json_number(value)
                for part, value in zip(SENSITIVITY_PARTS, result.sensitivity(node), strict=True)
                if not math.isinf(value) or value > 0
            },
            "seconds": round(node.seconds, 4),
        }
        if node.one_at_a_time:
            entry["one_at_a_time"] = {
                c: _measurement(result, m) for c, m in node.one_at_a_time.items()
            }
        if node.all_but_one is not None:
            entry["all_but_one"] = _measurement(result, node.all_but_one)
        layer = _layer(node)
        if layer is not None:
            entry["layer"] = layer
        nodes.append(entry)
    metric = result.metric
    return {
        "qtool": __version__,
        "recipe": result.recipe,
        "metric": {
            "name": metric.name,
            "output": metric.output,
            "chosen_by": metric.source,
            "value_unit": metric.value_unit,
            "penalty": metric.penalty_unit,
            "model": "fused (ORT_ENABLE_ALL, as deployed); layer SQNRs unfused (QDQ semantics)",
        },
        "samples": result.samples,
        "modes": list(result.modes),
        "candidates": list(result.candidates),
        "float": {"metric": json_number(result.float_value)},
        "full_plan": _measurement(result, result.full),
        "ranking": [node.name for node in ranking],
        "nodes": nodes,
        "cost": {
            "variants": result.variants,
            "seconds": round(result.seconds, 4),
            "seconds_per_node": round(result.seconds / max(len(result.nodes), 1), 4),
            "layer_seconds": round(result.layer_seconds, 4),
        },
        "cache_key": result.key,
        "notes": list(result.notes),
    }


def sensitivity_json(result: SensitivityResult) -> bytes:
    text = json.dumps(to_dict(result), indent=2, allow_nan=False)
    return (text + "\n").encode()


# ---------------------------------------------------------------------------------------------
# Tables


def format_value(result: SensitivityResult, value: float) -> str:
    name = result.metric.name
    if math.isnan(value):
        return "n/a"
    if name in ("accuracy", "agreement"):
        return f"{value:.2f}%"
    if name == "perplexity":
        return f"{value:.3f}"
    if name == "cosine":
        return f"{value:.5f}"
    return "inf dB" if math.isinf(value) else f"{value:.2f} dB"


def format_penalty(result: SensitivityResult, penalty: float) -> str:
    if math.isnan(penalty):
        return "n/a"
    if result.metric.name in ("accuracy", "agreement", "perplexity"):
        return f"{penalty + 0.0:+.2f}"
    mantissa, exponent = f"{penalty:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _db(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"


def name_prefix(names: list[str]) -> str:
    """The folder-like prefix every node name shares ('/encoder/encoder/'), cut from the table
    so long exported names leave room for the numbers; '' when they share none."""
    if len(names) < 2:
        return ""
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    return prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""


def _prefix_note(prefix: str) -> str:
    return f"Node names under {prefix}. " if prefix else ""


def _number_column(table: Table, header: str) -> None:
    table.add_column(header, justify="right", no_wrap=True, min_width=max(len(header), 5))


def _bar(value: float, top: float) -> Text:
    if top <= 0 or not math.isfinite(value) or value <= 0:
        return Text("")
    cells = value / top * BAR_WIDTH
    full = int(cells)
    text = "█" * full + ("▌" if cells - full >= 0.5 else "")
    return Text(text or "▏", style="red" if value >= 0.5 * top else "yellow")


def bar_basis(result: SensitivityResult) -> int | None:
    """Which sensitivity part the bars show: the first that is positive for some node."""
    values = [result.sensitivity(node) for node in result.nodes]
    for part in range(len(SENSITIVITY_PARTS)):
        if any(math.isfinite(v[part]) and v[part] > 0 for v in values):
            return part
    return None


def sensitivity_table(result: SensitivityResult) -> Table:
    """Most sensitive first, a bar per node on the first sensitivity part that separates them.

    Cells hold penalties (0 = as good as float, larger = worse) in the metric's unit, named in
    the caption with the bars' basis; the metric values themselves are in sensitivity.json.
    """
    basis = bar_basis(result)
    top = 0.0
    if basis is not None:
        finite = [result.sensitivity(n)[basis] for n in result.nodes]
        top = max((v for v in finite if math.isfinite(v)), default=0.0)
    columns = []
    if "one-at-a-time" in result.modes:
        columns.append(f"{'/'.join(result.candidates)}: the node alone at that precision")
    if "all-but-one" in result.modes:
        columns.append("float: what the full plan recovers with the node alone float (+ = better)")
    if "layer" in result.modes:
        columns.append("dB: its output SQNR in the full plan")
    prefix = name_prefix([n.name for n in result.nodes])
    plans = {n.planned for n in result.nodes}
    caption = _prefix_note(prefix)
    if len(plans) == 1:
        caption += f"Every node is {plans.pop()} in the recipe's plan. "
    caption += f"Penalty ({result.metric.penalty_unit}) of {'; '.join(columns)}"
    if basis is not None:
        caption += f". Bars: {SENSITIVITY_PARTS[basis]}"
    table = Table(
        title=f"Sensitivity of {len(result.nodes)} nodes, most sensitive first",
        caption=caption,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("node", overflow="fold", min_width=12)
    mixed = len({n.planned for n in result.nodes}) > 1
    if mixed:
        table.add_column("plan", no_wrap=True)
    one = "one-at-a-time" in result.modes
    if one:
        for candidate in result.candidates:
            _number_column(table, candidate)
    if "all-but-one" in result.modes:
        _number_column(table, "float")
    if "layer" in result.modes:
        _number_column(table, "dB")
    table.add_column("", no_wrap=True, min_width=BAR_WIDTH)
    _number_column(table, "s")
    for rank, node in enumerate(result.ranking(), start=1):
        cells = [str(rank), node.name[len(prefix) :]] + ([node.planned] if mixed else [])
        if one:
            for candidate in result.candidates:
                cells.append(_cell(result, node.one_at_a_time.get(candidate)))
        if "all-but-one" in result.modes:
            recovery = result.recovery(node.name)
            cells.append("skipped" if recovery is None else format_penalty(result, recovery))
        if "layer" in result.modes:
            cells.append(_db(node.layer.sqnr_out_db if node.layer is not None else None))
        value = result.sensitivity(node)[basis] if basis is not None else 0.0
        table.add_row(*cells, _bar(value, top), f"{node.seconds:.2f}")
    return table


def _cell(result: SensitivityResult, measured: Measurement | None) -> str:
    if measured is None:
        return "-"
    if measured.skipped is not None:
        return "skipped"
    return format_penalty(result, measured.penalty)


def layer_table(result: SensitivityResult) -> Table:
    """Graph order: how the error enters (input SQNR, after its Q/DQ) and grows at each node."""
    prefix = name_prefix([n.name for n in result.nodes])
    table = Table(
        title="Layer by layer: fully quantized vs float (unfused, graph order)",
        caption=_prefix_note(prefix)
        + "SQNR dB of the node's data input as it reads it (after its Q/DQ) and of its "
        "output; lost: in - out",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("node", overflow="fold", min_width=12)
    mixed = len({n.layer.precision for n in result.nodes if n.layer is not None}) > 1
    if mixed:
        table.add_column("plan", no_wrap=True)
    _number_column(table, "in dB")
    _number_column(table, "out dB")
    _number_column(table, "lost")
    table.add_column("", no_wrap=True, min_width=BAR_WIDTH)
    lost = [
        n.layer.lost_db
        for n in result.nodes
        if n.layer is not None and n.layer.lost_db is not None and math.isfinite(n.layer.lost_db)
    ]
    top = max(lost, default=0.0)
    for node in result.nodes:
        if node.layer is None:
            continue
        layer = node.layer
        value = layer.lost_db if layer.lost_db is not None else math.nan
        table.add_row(
            node.name[len(prefix) :],
            *([layer.precision] if mixed else []),
            _db(layer.sqnr_in_db),
            _db(layer.sqnr_out_db),
            _db(layer.lost_db),
            _bar(value, top),
        )
    return table


def summary_lines(result: SensitivityResult) -> list[str]:
    metric = result.metric
    lines = [
        f"metric: {metric.describe()}",
        f"float {format_value(result, result.float_value)}, recipe's plan "
        f"{format_value(result, result.full.value)} (penalty "
        f"{format_penalty(result, result.full.penalty)}) on {result.samples} samples "
        "(fused, as ONNX Runtime deploys it)",
    ]
    per_node = result.seconds / max(len(result.nodes), 1)
    cost = (
        f"cost: {result.variants} variants, {result.seconds:.2f} s "
        f"({per_node:.2f} s per node"
        + (f"; layer run {result.layer_seconds:.2f} s" if "layer" in result.modes else "")
        + ")"
    )
    if result.cached:
        cost += " when measured; this run read every number from the cache"
    lines.append(cost)
    return lines
