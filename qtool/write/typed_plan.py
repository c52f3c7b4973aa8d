"""Between the Plan and the typing pass: what each node is asked to compute in, and the pass's
outcome written back into the Plan (the build stage's record, like the weight format's).

A node planned fp16 or bf16 is asked for that type, a node planned float (FP32) for FP32, and a
quantized node for the model's float type (`quantization.float_type`: its Q/DQ feed a float op
whose other inputs and output are in that type). A node the keep rules keep in FP32 that was
planned fp16/bf16 becomes precision float with source `kept-fp32` and the rule's reason, so
report.json and plan.yaml state what the file computes.
"""

from __future__ import annotations

from collections.abc import Mapping

from qtool.calibration.observers import TensorStats
from qtool.plan.plan import Plan
from qtool.write.float_type import Typing

_NAMES = {"float": "fp32", "fp16": "fp16", "bf16": "bf16"}


def requested_types(plan: Plan, float_precision: str) -> tuple[dict[str, str], str]:
    """Node name -> the type asked of it (fp16, bf16, fp32), and the type of the nodes the
    writer adds that the plan does not name (the model's float type)."""
    default = _NAMES[float_precision]
    asked = {}
    for node in plan:
        asked[node.name] = _NAMES.get(node.precision, default)
    return asked, default


def needs_typing(asked: Mapping[str, str], default: str) -> bool:
    return default != "fp32" or any(kind != "fp32" for kind in asked.values())


def largest_magnitudes(stats: Mapping[str, TensorStats], tensors: list[str]) -> dict[str, float]:
    """The calibrated largest |value| of each tensor the keep rules check."""
    found = {}
    for name in tensors:
        entry = stats.get(name)
        if entry is not None:
            found[name] = max(abs(entry.minimum), abs(entry.maximum))
    return found


def record_typing(plan: Plan, typing: Typing) -> None:
    """Each planned node's float type, and the keep rule's decision where it overrode the plan."""
    for node in plan:
        record = typing.nodes.get(node.name)
        if record is None:
            continue
        node.float_type = record.to_dict()
        if record.kept_by is not None and node.precision in ("fp16", "bf16"):
            node.precision = "float"
            node.activations = "int8"
            node.source = "kept-fp32"
            node.reason = f"kept FP32 ({record.kept_by}): {record.reason}"
