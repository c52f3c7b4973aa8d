"""Never larger than a passing reference.

The search builds the all-int8 and the all-int4 models (int8 where int4 is no candidate) to
price the nodes, and scores them on the evaluation set for the report. When one of them meets
the budget and is smaller than the plan the knapsack and the promotions arrived at (or no plan
met the budget at all), that reference is the better answer, whatever the per-node predictions
said: it is built as a plan of its own (through the same build stage, with the recipe's
algorithms, so the file written is the one verified), scored, and chosen if it passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from qtool.search.knapsack import Choice
from qtool.search.promote import Iteration, SearchResult


@dataclass(frozen=True)
class Reference:
    """A uniform model as measured for comparison: its plan (node -> precision as the layout
    gave it), its file size as written, the size the size model predicted, and the budget's
    metric on the evaluation set."""

    precision: str
    plan: dict[str, str]
    size: int
    predicted_size: int | None  # None: a precision of its plan the size model did not price
    value: float
    passed: bool

    @property
    def label(self) -> str:
        return f"all-{self.precision}"


def _eligible(reference: Reference, options: Mapping[str, Sequence[Choice]]) -> bool:
    """A reference the search can verify as a plan: each node's precision is one of its
    choices (a node the analysis could not measure at it is not)."""
    return all(any(c.precision == p for c in options[node]) for node, p in reference.plan.items())


def ceiling(
    references: Sequence[Reference], options: Mapping[str, Sequence[Choice]]
) -> Reference | None:
    """The smallest reference that passes and that the search can take, or None."""
    passing = [r for r in references if r.passed and _eligible(r, options)]
    return min(passing, key=lambda r: (r.size, r.precision), default=None)


def prefer_reference(
    result: SearchResult,
    best: Reference | None,
    measure: Callable[[int, str, Mapping[str, str]], Iteration],
    report: Callable[[Iteration], None],
) -> str | None:
    """Take `best` (the smallest passing reference) over the search's answer when that answer
    is larger or missed the budget; returns the note that says what happened, else None.
    `measure(index, action, plan)` builds and scores a plan as verify_and_promote does."""
    if best is None:
        return None
    if result.passed and result.chosen.measured.size <= best.size:
        return None
    if result.passed:
        chosen = result.chosen
        why = f"is smaller than plan {chosen.index} ({chosen.measured.size} bytes)"
    else:
        why = "no plan verified did"
    action = f"{best.label} reference: meets the budget and {why}"
    iteration = measure(len(result.iterations) + 1, action, best.plan)
    result.iterations.append(iteration)
    report(iteration)
    if not iteration.passed:
        kept = f"plan {result.chosen.index} stays chosen" if result.passed else "no plan passed"
        if not result.passed:
            result.reason += f"; the {best.label} reference, built for writing, missed it too"
        return (
            f"the {best.label} reference met the budget as built for comparison (without the "
            f"recipe's algorithms) but missed it as built for writing; {kept}"
        )
    result.choice = len(result.iterations) - 1
    result.reason = None
    result.reference = best.precision
    return (
        f"chose the {best.label} reference ({iteration.measured.size} bytes): it meets the "
        f"budget and {why}"
    )
