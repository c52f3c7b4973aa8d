"""The precisions the search may give each node: from the recipe, else from the target.

`ort-cpu`: int4 where ONNX Runtime fuses it (the constant weight of a MatMul or Gemm, which
becomes MatMulNBits; a 4-bit Conv or Gather only shrinks the file and runs dequantized, and is
left out of the default), int8 and float. `tensorrt`: int8 and float. int4 needs the opset-21
model the statistics were collected on, so it is a default only there: the search never
re-prepares the model behind the statistics' back.
"""

from __future__ import annotations

from collections.abc import Sequence

from qtool.errors import RecipeError
from qtool.model.opset21 import TARGET_OPSET
from qtool.search.spec import MixedPrecisionSpec

# Least to most precise: a promotion moves a node one step to the right.
ORDER = ("int4", "int8", "float")
INT4_FUSED_OPS = ("MatMul", "Gemm")


def model_candidates(
    spec: MixedPrecisionSpec | None, target: str, opset: int, where: str, notes: list[str]
) -> tuple[str, ...]:
    """The candidate list for the whole model, least precise first; `where` names the
    settings' file in errors and notes."""
    if spec is not None and spec.candidates is not None:
        if "int4" in spec.candidates and opset < TARGET_OPSET:
            raise RecipeError(
                f"{where}: mixed_precision.candidates: int4 needs opset {TARGET_OPSET}, but "
                f"the recipe prepares opset {opset}; set model.opset: {TARGET_OPSET} (and "
                "calibrate again: the stats belong to the prepared model)"
            )
        return tuple(p for p in ORDER if p in spec.candidates)
    if target == "tensorrt":
        return ("int8", "float")
    if opset < TARGET_OPSET:
        notes.append(
            f"int4 is not a candidate: {where} prepares opset {opset}, 4-bit weights need "
            f"opset {TARGET_OPSET} (set model.opset: {TARGET_OPSET} to let the search use int4)"
        )
        return ("int8", "float")
    return ORDER


def node_candidates(
    candidates: Sequence[str], op_type: str, has_weight: bool, target: str, explicit: bool
) -> tuple[str, ...]:
    """A node's share of the model's candidates: int4 only for a weight ORT runs on a 4-bit
    kernel by default; with an explicit candidate list, for every weighted node (the user asked
    for the smaller file)."""
    chosen = []
    for precision in candidates:
        if precision == "int4":
            if not has_weight or target != "ort-cpu":
                continue
            if not explicit and op_type not in INT4_FUSED_OPS:
                continue
        chosen.append(precision)
    return tuple(chosen)


def step_up(precision: str, allowed: Sequence[str]) -> str | None:
    """The next more precise candidate of a node, or None at its most precise."""
    position = ORDER.index(precision)
    return next((p for p in ORDER[position + 1 :] if p in allowed), None)
