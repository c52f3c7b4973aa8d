"""What the mixed-precision search says: one line per verified plan while it runs, report.json's
`mixed_precision` block, and the summary table the CLI prints from that block."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rich.table import Table

from qtool.metrics.signal import json_float
from qtool.search.budget import Budget
from qtool.search.knapsack import Choice
from qtool.search.penalties import PenaltyScale
from qtool.search.promote import Iteration, SearchResult
from qtool.search.reference import Reference
from qtool.search.result import SensitivityResult
from qtool.search.scoring import Scorer
from qtool.search.spec import MixedPrecisionSpec


def _value(metric: str, value: float) -> str:
    if metric in ("accuracy", "agreement"):
        return f"{value:.2f}%"
    if metric == "perplexity":
        return f"{value:.3f}"
    if metric == "cosine":
        return f"{value:.5f}"
    return "inf dB" if math.isinf(value) else f"{value:.2f} dB"


def _size(num_bytes: float) -> str:
    if num_bytes >= 1e6:
        return f"{num_bytes / 1e6:.2f} MB"
    return f"{num_bytes / 1e3:.1f} kB"


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {p}" for p, n in counts.items()) or "no node"


def iteration_line(iteration: Iteration, budget: Budget, float_value: float) -> str:
    verdict = "PASS" if iteration.passed else "miss"
    measured = iteration.measured
    predicted = _value(budget.metric, budget.value_at(iteration.predicted_penalty, float_value))
    if iteration.pass_probability is not None:
        predicted += f", passing with p {iteration.pass_probability:.2f}"
    return (
        f"  plan {iteration.index} ({iteration.action}; {_counts(iteration.counts())}): "
        f"{budget.metric} {_value(budget.metric, measured.value)} (predicted {predicted}), "
        f"{_size(measured.size)} (predicted {_size(iteration.predicted_size)}): {verdict}"
    )


def _iteration_dict(iteration: Iteration, budget: Budget, float_value: float) -> dict:
    measured = iteration.measured
    return {
        "iteration": iteration.index,
        "action": iteration.action,
        "counts": iteration.counts(),
        "predicted": {
            "penalty": iteration.predicted_penalty,
            "metric": json_float(budget.value_at(iteration.predicted_penalty, float_value)),
            "size_bytes": iteration.predicted_size,
            "knapsack_penalty": json_float(iteration.knapsack_penalty),
            "pass_probability": iteration.pass_probability,
        },
        "measured": {
            "metric": json_float(measured.value),
            "penalty": json_float(measured.penalty),
            "sqnr_db": json_float(measured.sqnr_db),
            "cosine": json_float(measured.cosine),
            "size_bytes": measured.size,
        },
        "passed": iteration.passed,
        "seconds": round(iteration.seconds, 3),
    }


def _choices(
    name: str,
    sizes: Sequence[Choice],
    options: Sequence[Choice],
    analysis: SensitivityResult,
    scale: PenaltyScale,
    timed: bool,
) -> dict:
    """One node's choices: bytes, the analysis' penalty (the budget's unit, as measured on its
    subset), with a max_drop budget the margin noise and the knapsack's penalty, with the
    latency objective the profiled time."""
    knapsack = {c.precision: c for c in options}
    priced = {}
    for choice in sizes:
        # None: not measured (a tied reader the recipe decides, in every plan alike)
        measured = analysis.penalty(name, choice.precision)
        entry = {
            "bytes": int(round(choice.cost)),
            "penalty": None if measured is None else json_float(measured),
        }
        if scale.flips is not None:
            noise = analysis.margin_noise(name, choice.precision)
            entry["margin_noise"] = None if noise is None else json_float(noise)
            entry["knapsack_penalty"] = json_float(choice.penalty)
            entry["predicted_drop"] = json_float(scale.predicted(max(choice.penalty, 0.0)))
        if timed:
            entry["latency_us"] = round(knapsack[choice.precision].cost, 2)
        priced[choice.precision] = entry
    return priced


def mixed_block(
    spec: MixedPrecisionSpec,
    budget: Budget,
    scale: PenaltyScale,
    scorer: Scorer,
    analysis: SensitivityResult,
    candidates: Sequence[str],
    sizes: Mapping[str, Sequence[Choice]],
    options: Mapping[str, Sequence[Choice]],
    result: SearchResult,
    references: Mapping[str, Reference],
    float_size: int,
    latency: dict,
    files: Mapping[str, str],
    notes: Sequence[str],
    timed: bool = False,
    predicted_latency: dict | None = None,
) -> dict:
    """report.json's `mixed_precision`: the budget and how penalties count against it, what the
    analysis predicted and what the evaluation set measured for the chosen plan, the uniform
    references (predicted and measured size, metric, pass), every plan tried, and each node's
    choices. `sizes` are priced in bytes, `options` in what the search minimises (the same, or
    with the latency objective (`timed`) profiled us); `predicted_latency` is the profiler's sum
    for the chosen plan."""
    chosen = result.chosen
    history = [_iteration_dict(it, budget, scorer.float_value) for it in result.iterations]
    nodes = [
        {
            "name": name,
            "precision": chosen.precisions[name],
            "choices": _choices(name, choices, options[name], analysis, scale, timed),
        }
        for name, choices in sizes.items()
    ]
    predicted = dict(history[chosen.index - 1]["predicted"])
    if predicted_latency is not None:
        predicted["latency"] = predicted_latency
    uniform = {
        p: {
            "size_bytes": r.size,
            "predicted_size_bytes": r.predicted_size,
            "metric": json_float(r.value),
            "passed": r.passed,
        }
        for p, r in references.items()
    }
    uniform["float"] = {"size_bytes": float_size, "metric": json_float(scorer.float_value)}
    return {
        "passed": result.passed,
        "reason": result.reason,
        "objective": spec.objective,
        "budget": budget.to_dict(),
        "penalties": scale.to_dict(),
        "metric": {
            "name": scorer.metric.name,
            "output": scorer.metric.output,
            "float": json_float(scorer.float_value),
            "evaluation_samples": scorer.samples,
        },
        "analysis": {
            "samples": analysis.samples,
            "candidates": list(candidates),
            "cache_key": analysis.key,
            "cached": analysis.cached,
            "seconds": round(analysis.seconds, 3),
        },
        "chosen_iteration": chosen.index,
        "chosen_reference": result.reference,
        "predicted": predicted,
        "measured": {**history[chosen.index - 1]["measured"], "latency": latency},
        "references": uniform,
        "counts": chosen.counts(),
        "iterations": history,
        "nodes": nodes,
        "files": dict(files),
        "notes": list(notes),
    }


def summary_table(block: dict) -> Table:
    """Float, the uniform plans, and the chosen one: metric and size side by side."""
    metric = block["metric"]["name"]
    verdict = "meets" if block["passed"] else "MISSES"
    table = Table(
        title=f"Mixed precision ({verdict} {block['budget']['source']}: "
        f"{_budget_text(block['budget'])})",
        title_justify="left",
    )
    latency = block["measured"].get("latency", {})
    columns = ["plan", "nodes", metric, "size", "vs float"]
    if "float_ms_median" in latency:
        columns.append("latency ms")
    for column in columns:
        table.add_column(column, justify="left" if column in ("plan", "nodes") else "right")
    timed = {
        "float": latency.get("float_ms_median"),
        "int8": latency.get("int8_ms_median"),
        "chosen": latency.get("model_ms_median"),
    }
    float_size = block["references"]["float"]["size_bytes"]
    for precision in ("float", "fp16", "bf16", "int8", "fp8", "int4"):
        reference = block["references"].get(precision)
        if reference is None:
            continue
        label = "float" if precision == "float" else f"all {precision}"
        label = "int4 (else int8)" if precision == "int4" else label
        row = [
            label,
            "",
            _value(metric, float(reference["metric"])),
            _size(reference["size_bytes"]),
            f"{reference['size_bytes'] / float_size:.2f}x",
        ]
        if len(columns) > 5:
            row.append(_ms(timed.get(precision)))
        table.add_row(*row)
    measured = block["measured"]
    what = f"plan {block['chosen_iteration']}"
    if block.get("chosen_reference"):
        what += f": all {block['chosen_reference']}"
    row = [
        f"chosen ({what})",
        _counts(block["counts"]),
        _value(metric, float(measured["metric"])),
        _size(measured["size_bytes"]),
        f"{measured['size_bytes'] / float_size:.2f}x",
    ]
    if len(columns) > 5:
        row.append(_ms(timed["chosen"]))
    table.add_row(*row)
    return table


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _budget_text(budget: dict) -> str:
    if budget["gate"] == "max_drop":
        return f"{budget['metric']} drop <= {budget['limit']:g} points"
    if budget["gate"] == "min_cosine":
        return f"cosine >= {budget['limit']:g}"
    return f"SQNR >= {budget['limit']:g} dB"
