"""Small in-place edits of a GraphProto shared by the preparation passes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import onnx

__all__ = [
    "STANDARD_DOMAINS",
    "consumer_counts",
    "delete_indexes",
    "drop_where",
    "subgraph_names",
]

STANDARD_DOMAINS = ("", "ai.onnx")

_T = TypeVar("_T")


def subgraph_names(graph: onnx.GraphProto) -> set[str]:
    """Names read inside If/Loop/Scan bodies: outer-scope ones among them must not vanish.

    Over-approximates (names local to a body are included too), which only makes passes more
    careful, never wrong.
    """
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            bodies = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
            for body in bodies:
                names.update(n for inner in body.node for n in inner.input)
                names.update(o.name for o in body.output)
                names.update(subgraph_names(body))
    return names


def consumer_counts(graph: onnx.GraphProto) -> Counter[str]:
    """How many node inputs read each name; names read inside subgraphs count once more."""
    counts: Counter[str] = Counter(n for node in graph.node for n in node.input if n)
    counts.update(subgraph_names(graph))
    return counts


def drop_where(container, predicate: Callable[[_T], bool]) -> int:
    """Delete the matching entries of a repeated proto field in place; return how many.

    Rebuilding the field (`del f[:]; f.extend(kept)`) copies every kept message: for the
    initializer list of a large model that is a copy of all its weights.
    """
    doomed = [i for i, item in enumerate(container) if predicate(item)]
    delete_indexes(container, doomed)
    return len(doomed)


def delete_indexes(container, indexes: list[int]) -> None:
    """Delete entries of a repeated proto field by position, in place."""
    for index in sorted(indexes, reverse=True):
        del container[index]
