"""The rules that keep a node in FP32 when the model's float part is written in FP16 or BF16.

FP16 has FP32's 11-bit precision halved and a 5-bit exponent: values past 65504 overflow to inf,
values under 6.1e-5 lose bits as subnormals, and long sums lose the small terms. BF16 keeps FP32's
exponent (no overflow, no underflow) but only 8 bits of precision. The typing pass
(write/float_type.py) asks each rule below, in order, about every node that would compute in the
low type; the first that answers keeps the node in FP32, and its reason goes into report.json.
The rules are data: the table is what docs/recipe.md lists, and a new rule is a row.

Ranges are the calibration pass's (min/max of every float tensor the node reads or writes, on the
calibration data), so a tensor that overflows only on other data is not caught; constants are
checked on their values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

FP16_MAX = 65504.0  # largest finite float16
FP16_MIN_NORMAL = 2.0**-14  # 6.1e-5: below it float16 is subnormal, with fewer than 11 bits

# Reductions that add up (or multiply) many values in the tensor's own type: ONNX gives them no
# wider accumulator, so in FP16 a long sum overflows or drops its small terms, and in BF16 the
# 8-bit mantissa drops them sooner. Means (ReduceMean, GlobalAveragePool) divide as they go and
# stay in the low type; their inputs and outputs still face the range rules.
SUMMING_OPS = frozenset(
    {
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
        "CumSum",
    }
)


# Normalizations reduce a row to its mean and variance (a sum of squares) before they scale it:
# in FP16 the squares overflow past |x| ~ 256 and the sums lose bits. ONNX's LayerNormalization
# keeps its statistics in `stash_type` (FP32 by default) but ORT's CPU kernel for FP16 input does
# not (measured on MiniLM, ORT 1.31: 59.2 dB with them FP16, 64.7 dB FP32), and TensorRT advises
# normalization in FP32 for the same overflow; ATen and TensorRT-LLM accumulate them in FP32.
NORMALIZATION_OPS = frozenset(
    {"LayerNormalization", "GroupNormalization", "InstanceNormalization", "RMSNormalization"}
)


@dataclass(frozen=True)
class NodeFacts:
    """What the rules may look at for one node that would compute in `low` ("fp16", "bf16").

    `largest`: the largest calibrated magnitude of each float activation the node reads or
    writes (by its name in the float model); `outputs`: which of those the node writes.
    `constants`: its float constant inputs (initializers, Constant values). `schema_gap`: why
    the ONNX schema of the op at the model's opset has no `low` form for it (None: it has).
    """

    op_type: str
    low: str
    largest: Mapping[str, float] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    schema_gap: str | None = None


@dataclass(frozen=True)
class KeepRule:
    """One reason to keep a node in FP32: `name` (report.json's `kept_by`), the low types it
    applies to, `why` in general words, and `check` giving the detail when it applies."""

    name: str
    applies_to: tuple[str, ...]
    why: str
    check: Callable[[NodeFacts], str | None]

    def reason(self, facts: NodeFacts) -> str | None:
        if facts.low not in self.applies_to:
            return None
        detail = self.check(facts)
        return None if detail is None else f"{self.why}: {detail}"


def _schema(facts: NodeFacts) -> str | None:
    return facts.schema_gap


def _summing(facts: NodeFacts) -> str | None:
    return f"{facts.op_type} accumulates" if facts.op_type in SUMMING_OPS else None


def _normalization(facts: NodeFacts) -> str | None:
    return (
        f"{facts.op_type} computes a mean and variance"
        if facts.op_type in NORMALIZATION_OPS
        else None
    )


def _overflow(facts: NodeFacts) -> str | None:
    over = {name: value for name, value in facts.largest.items() if value > FP16_MAX}
    if not over:
        return None
    name, value = max(over.items(), key=lambda item: item[1])
    return f"'{name}' reaches {value:.6g} on the calibration data"


def _constant_overflow(facts: NodeFacts) -> str | None:
    for name, values in facts.constants.items():
        if values.size and np.issubdtype(values.dtype, np.floating):
            largest = float(np.max(np.abs(values)))
            if largest > FP16_MAX:
                return f"constant '{name}' holds {largest:.6g}"
    return None


def _underflow(facts: NodeFacts) -> str | None:
    for name in facts.outputs:
        value = facts.largest.get(name)
        if value is not None and 0.0 < value < FP16_MIN_NORMAL:
            return f"'{name}' never exceeds {value:.3g} on the calibration data"
    return None


KEEP_RULES: tuple[KeepRule, ...] = (
    KeepRule(
        "no-low-type",
        ("fp16", "bf16"),
        "the ONNX operator has no form in that type at the model's opset",
        _schema,
    ),
    KeepRule(
        "reduction",
        ("fp16", "bf16"),
        "a summing reduction keeps FP32: ONNX gives it no wider accumulator, and a long sum in "
        "FP16 or BF16 overflows or drops its small terms",
        _summing,
    ),
    KeepRule(
        "normalization",
        ("fp16", "bf16"),
        "a normalization keeps FP32: its mean and variance (a sum of squares) overflow or lose "
        "bits in FP16 or BF16",
        _normalization,
    ),
    KeepRule(
        "overflow",
        ("fp16",),
        f"a calibrated value beyond FP16's largest finite value {FP16_MAX:g} (it would be inf)",
        _overflow,
    ),
    KeepRule(
        "constant-overflow",
        ("fp16",),
        f"a constant beyond FP16's largest finite value {FP16_MAX:g}",
        _constant_overflow,
    ),
    KeepRule(
        "underflow",
        ("fp16",),
        f"every calibrated value below FP16's smallest normal number {FP16_MIN_NORMAL:.2g} (FP16 "
        "would keep fewer than its 11 bits)",
        _underflow,
    ),
)


def keep_reason(facts: NodeFacts) -> tuple[str, str] | None:
    """(rule name, reason) of the first rule that keeps the node in FP32, or None."""
    for rule in KEEP_RULES:
        reason = rule.reason(facts)
        if reason is not None:
            return rule.name, reason
    return None


def scale_keep_reason(scale: np.ndarray, low: str) -> str | None:
    """Why a Q/DQ pair's scale stays FP32 in an FP16 model: DequantizeLinear's output has its
    scale's type, and a scale under FP16's smallest normal number would lose bits (a tiny
    weight channel's amax / 127 or / 448). The pair then computes in FP32 with a Cast after it."""
    if low != "fp16" or scale.size == 0:
        return None
    smallest = float(np.min(np.abs(scale)))
    if smallest < FP16_MIN_NORMAL:
        return (
            f"scale {smallest:.3g} is below FP16's smallest normal number {FP16_MIN_NORMAL:.2g}: "
            "the pair keeps an FP32 scale and a Cast follows it"
        )
    return None
