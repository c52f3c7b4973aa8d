"""The precisions the search may give each node: from the recipe, else from the target.

`ort-cpu`: int4 where ONNX Runtime fuses it (the constant weight of a MatMul or Gemm, which
becomes MatMulNBits; a 4-bit Conv or Gather only shrinks the file and runs dequantized, and is
left out of the default), int8 and float. `tensorrt`: fp8, int8, fp16 and float (TensorRT 11's
strongly typed precisions; FP8 for Hopper and later). int4 needs the opset-21 model the
statistics were collected on and fp8 an opset-19 one, so each is a default only there: the
search never re-prepares the model behind the statistics' back. Whether an op takes fp8, fp16 or
bf16 is its registry rule's: an entry for (target, precision) (qtool/plan/ops/).
"""

from __future__ import annotations

from collections.abc import Sequence

from qtool.errors import RecipeError
from qtool.model.opset21 import TARGET_OPSET
from qtool.plan.ops import find_rule, precision_key
from qtool.search.spec import MixedPrecisionSpec

# Least to most precise: a promotion moves a node one step to the right. FP8 E4M3 keeps 3
# mantissa bits where int8 per tensor keeps about 7 over a calibrated range, so fp8 sits below
# int8 (same bytes); BF16 keeps 8 bits, FP16 11, FP32 24.
ORDER = ("int4", "fp8", "int8", "bf16", "fp16", "float")
INT4_FUSED_OPS = ("MatMul", "Gemm")
# float8 Q/DQ exist from opset 19 on.
FP8_OPSET = 19
TENSORRT_DEFAULT = ("fp8", "int8", "fp16", "float")
ORT_CPU_DEFAULT = ("int4", "int8", "float")


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
        if "fp8" in spec.candidates and opset < FP8_OPSET:
            raise RecipeError(
                f"{where}: mixed_precision.candidates: fp8 needs opset {FP8_OPSET}, but the "
                f"recipe prepares opset {opset}; set model.opset: {TARGET_OPSET}"
            )
        return tuple(p for p in ORDER if p in spec.candidates)
    if target == "tensorrt":
        if opset < FP8_OPSET:
            notes.append(
                f"fp8 is not a candidate: {where} prepares opset {opset}, float8 Q/DQ need "
                f"opset {FP8_OPSET} (set model.opset: {TARGET_OPSET} to let the search use fp8)"
            )
            return tuple(p for p in TENSORRT_DEFAULT if p != "fp8")
        return TENSORRT_DEFAULT
    if opset < TARGET_OPSET:
        notes.append(
            f"int4 is not a candidate: {where} prepares opset {opset}, 4-bit weights need "
            f"opset {TARGET_OPSET} (set model.opset: {TARGET_OPSET} to let the search use int4)"
        )
        return ("int8", "float")
    return ORT_CPU_DEFAULT


def node_candidates(
    candidates: Sequence[str], op_type: str, has_weight: bool, target: str, explicit: bool
) -> tuple[str, ...]:
    """A node's share of the model's candidates: int4 only for a weight ORT runs on a 4-bit
    kernel by default; with an explicit candidate list, for every weighted node (the user asked
    for the smaller file). fp8, fp16 and bf16 where the op's rule has an entry for them on the
    target (an Add has no FP8 form: no FP8 kernel to feed)."""
    chosen = []
    for precision in candidates:
        if precision == "int4":
            if not has_weight or target != "ort-cpu":
                continue
            if not explicit and op_type not in INT4_FUSED_OPS:
                continue
        if not offered(precision, op_type, target):
            continue
        chosen.append(precision)
    return tuple(chosen)


def offered(precision: str, op_type: str, target: str) -> bool:
    """Whether the op's registry rule has a form at fp8, fp16 or bf16 on the target (the other
    precisions every quantizable op has, or the layout says why not)."""
    if precision not in ("fp8", "fp16", "bf16"):
        return True
    rule = find_rule(op_type)
    return rule is not None and (target, precision_key(precision, precision)) in rule.entries


def step_up(precision: str, allowed: Sequence[str]) -> str | None:
    """The next more precise candidate of a node, or None at its most precise."""
    position = ORDER.index(precision)
    return next((p for p in ORDER[position + 1 :] if p in allowed), None)
