"""The op registry: one `OpRule` per op type, everything qtool knows about quantizing that op.

A rule says what is quantized (which inputs are weights and how their slots are built, whether
the activations and the output get Q/DQ pairs), what is written for each (target, precision)
and what ONNX Runtime's CPU provider fuses that into (`Entry`), how ORT's QDQ fusion treats the
op and so why a node may stay float (`OrtFusion`), and the report's words for the op's float
nodes. The layout (plan/layout.py), the recipe's op_types check (config/recipe.py), the
verifier (runtime/fusion.py, runtime/verify.py) and docs/op-registry.md all read these rules, so
adding an op is adding a rule, and adding a precision or a target is adding entries.

The rules live in one module per op family (conv.py, matmul.py, ...); qtool/plan/ops/__init__.py
registers them. Lookups never guess: an op type without a rule, or a (target, precision) without
an entry, raises `RegistryError` naming what exists. Only the graph walks, which meet every op
type a model can hold, use `find_rule` and treat "no rule" as "qtool knows nothing of this op".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import onnx

from qtool.plan.graph import GraphIndex
from qtool.plan.node_settings import NodeSettings
from qtool.plan.ops.targets import TARGETS, Target
from qtool.plan.plan import WeightPlan
from qtool.plan.settings import QuantizationSpec
from qtool.plan.slots import BiasSlot, WeightSlot

# Precision keys: a planned node's NodePlan.precision and NodePlan.activations, "weights/acts".
# An op without weights is planned "int8" (or "fp8": its activations are). A node typed fp16 or
# bf16 has no Q/DQ: its entry says what it is written as and what the runtime makes of it.
# "int8/dynamic": int8 weights, activations quantized at run time (DynamicQuantizeLinear: the
# range of each tensor as it comes, no calibration), ONNX Runtime's quantize_dynamic form;
# "int8/dynamic-per-token": the same plan (NodePlan.activations "dynamic") written with one range
# per row of the input (quantization.dynamic_ranges: per-token), which `precision_key` picks.
INT8 = "int8/int8"
INT8_DYNAMIC = "int8/dynamic"
INT8_DYNAMIC_TOKEN = "int8/dynamic-per-token"
INT8_WEIGHT_ONLY = "int8/float"
INT4_WEIGHT_ONLY = "int4/float"
INT4_INT8 = "int4/int8"
FP8 = "fp8/fp8"
FP16 = "fp16/fp16"
BF16 = "bf16/bf16"
PRECISIONS: dict[str, str] = {
    INT8: "int8 weights and int8 activations (static ranges)",
    INT8_DYNAMIC: "int8 weights, uint8 activations quantized at run time (dynamic ranges)",
    INT8_DYNAMIC_TOKEN: "int8 weights, uint8 activations quantized at run time, one range per "
    "token (row)",
    INT8_WEIGHT_ONLY: "int8 weights, float activations (weight-only)",
    INT4_WEIGHT_ONLY: "4-bit weights, float activations (weight-only)",
    INT4_INT8: "4-bit weights, int8 activations",
    FP8: "FP8 E4M3 weights (per output channel) and FP8 E4M3 activations (per tensor)",
    FP16: "no Q/DQ: the node computes in FP16, its constant inputs stored FP16",
    BF16: "no Q/DQ: the node computes in BF16, its constant inputs stored BF16",
}


_UNKNOWN = [(t.name, p) for t in TARGETS.values() for p in t.precisions if p not in PRECISIONS]
if _UNKNOWN:  # a target offering a key no rule could have an entry for is a typo
    raise ImportError(f"targets offer unknown precision keys: {_UNKNOWN}")


class RegistryError(LookupError):
    """A lookup with no rule or entry behind it: a gap in qtool/plan/ops/ to fill, not to guess."""


def precision_key(precision: str, activations: str, dynamic_ranges: str = "per-tensor") -> str:
    """The registry key of a node planned at `precision` with `activations` (NodePlan fields);
    `dynamic_ranges` (quantization.dynamic_ranges) tells the two forms of a dynamic node apart."""
    if activations == "dynamic" and dynamic_ranges == "per-token":
        activations = "dynamic-per-token"
    key = f"{precision}/{activations}"
    if key not in PRECISIONS:
        raise RegistryError(f"no precision {key!r} in the op registry (it has {list(PRECISIONS)})")
    return key


class NodeSlots(NamedTuple):
    """The weight (and int32 bias) slots a weighted node's family builds for it."""

    weight: WeightSlot | None
    bias: BiasSlot | None = None


# (node, graph, spec, the node's recipe settings, the entry it is written by) -> its slots, or
# why it cannot be quantized (the report's reason).
SlotBuilder = Callable[
    [onnx.NodeProto, GraphIndex, QuantizationSpec, NodeSettings, "Entry"], "NodeSlots | str"
]


@dataclass(frozen=True)
class Weights:
    """An op with a constant weight input: how its slots are built and what its weights allow.

    `no_blocks`: the report's note when the recipe asks for blocks and the family stores none.
    `gptq`: GPTQ applies (it needs the layer input's XᵀX, which only MatMul/Gemm give).
    """

    slots: SlotBuilder
    no_blocks: str
    gptq: bool = False


@dataclass(frozen=True)
class SharesRange:
    """A shape or max op: no Q/DQ pair of its own; the tensor after it reuses the range before it,
    so ORT can drop DQ -> op -> Q and run it on the quantized data. The report's reasons for its
    float node: between quantized neighbours, and without any."""

    between_pairs: str
    alone: str


@dataclass(frozen=True)
class Folds:
    """A clamp (Relu, Clip(0, max)) folded into the QuantizeLinear of the quantized output before
    it, on asymmetric uint8 targets: `applies` says whether this node clamps at 0 from below."""

    applies: Callable[[onnx.NodeProto, GraphIndex], bool]
    reason: str


@dataclass(frozen=True)
class OrtFusion:
    """How ORT's graph optimizer treats DequantizeLinear -> op -> QuantizeLinear for this op: its
    QDQ node-group selector (qdq_selectors.cc), replayed by runtime/fusion.py to say why a node
    stayed float.

    `kernels`: the integer ops the group becomes (empty: none); `on_integers`: ORT drops the DQ
    and Q and runs the op itself on the integer data (data movement). `dq_inputs`: the input
    slots the selector wants fed by a DequantizeLinear (None: every input); `activation_input`:
    the slot whose type is the activation type. `weight_input` / `bias_input`: the constant
    weight and int32 bias slots; `quantizes_float_weights`: ORT quantizes a float constant weight
    and bias itself. `same_input_types`: all quantized inputs must share one type.
    `int8_activations_arm_only`: int8 (not uint8) activations fuse only on ARM. `check`: any
    other condition of the selector on the node (None: holds).
    """

    kernels: tuple[str, ...] = ()
    on_integers: bool = False
    dq_inputs: tuple[int, ...] | None = None
    activation_input: int = 0
    weight_input: int | None = None
    bias_input: int | None = None
    quantizes_float_weights: bool = False
    same_input_types: bool = False
    int8_activations_arm_only: bool = False
    check: Callable[[onnx.NodeProto], str | None] | None = None

    @property
    def form(self) -> str:
        """The fused form in the report's words: "QLinearMatMul or MatMulIntegerToFloat"."""
        return " or ".join(self.kernels)


NO_FUSION = OrtFusion()

# Why ORT's CPU provider runs a weight-only node's written form in float: fixed words, or words
# that depend on the planned weight (a MatMul's blocks).
NotFused = str | Callable[[WeightPlan | None], str]


@dataclass(frozen=True)
class Entry:
    """One op at one (target, precision): what qtool writes, and what ORT makes of it.

    `written` is the form in words; `op_types` the op types the written node can have (it keeps
    the planned node's name; the first is the usual one). `fuses_into`: the ORT CPU kernels that
    run it (empty: ORT runs the float op on dequantized data), `when` the condition in words.
    ORT's CPU provider is qtool's verifier for every target, so a tensorrt entry too says what it
    does with the model written for TensorRT. `not_fused`: why a weight-only node runs in float.

    What the written form needs of the weight: `always_blocked` (the form exists only blocked,
    e.g. GatherBlockQuantized), `block_sizes` (sizes it takes after the recipe's, largest first;
    the first that divides the blocked axis is used; None: the recipe's size as asked),
    `unsigned_blocks` (why blocked symmetric weights are stored asymmetric: the form has no
    signed type), `signed_scales` (symmetric 4-bit blocks may take negative scales).
    `runs_as`: what ORT's CPU provider runs, in words, for a form no ORT kernel fuses (typed
    FP16, FP8 Q/DQ); empty: "float". `int32_bias`: the form stores the bias as int32 behind a
    DequantizeLinear (ORT's QLinearConv/QGemm add it in the accumulator; TensorRT's
    DequantizeLinear takes no int32, so its forms leave the bias in the float type).
    `declines`: (node, graph) -> why the target's runtime has no kernel worth this form for
    the node's shapes, so it stays in the float type (TensorRT's FP8 kernels on small Convs
    and GEMMs, tensorrt_fp8.py), or None; no function: every node takes the form.
    `output_quantized`: None: the rule's `output_quantized` (ORT's fused form); False: this
    form quantizes the inputs only (TensorRT's FP8 placement: Q/DQ on the inputs of weighted
    ops, the output left in the float type for whatever reads it).
    """

    written: str
    op_types: tuple[str, ...]
    fuses_into: tuple[str, ...] = ()
    when: str = ""
    not_fused: NotFused | None = None
    runs_as: str = ""
    int32_bias: bool = False
    always_blocked: bool = False
    block_sizes: tuple[int, ...] | None = None
    unsigned_blocks: str | None = None
    signed_scales: bool = False
    declines: Callable[[onnx.NodeProto, GraphIndex], str | None] | None = None
    output_quantized: bool | None = None

    def quantizes_output(self, rule: OpRule) -> bool:
        """Whether the layout quantizes the node's output in this form: the entry's word where
        it has one, else the rule's (ORT's fused form)."""
        return rule.output_quantized if self.output_quantized is None else self.output_quantized

    def not_fused_reason(self, weight: WeightPlan | None) -> str:
        if self.not_fused is None:
            raise RegistryError(f"entry {self.written!r} has no reason for running in float")
        return self.not_fused if isinstance(self.not_fused, str) else self.not_fused(weight)


@dataclass(frozen=True, eq=False)
class OpRule:
    """Everything qtool knows about one op type (see the module docstring).

    `quantizable`: a recipe may list it in quantization.op_types; then it has an entry for every
    target. `weights`: it has a constant weight input (None: its inputs are all activations).
    `activation_inputs`: its float inputs get Q/DQ pairs (an embedding Gather's are integer
    indices). `output_quantized`: ORT's fused form needs DQ -> op -> Q, so the layout quantizes
    the output and the verifier counts a missing QuantizeLinear as the reason it did not fuse.
    `shares_range` / `folds`: the pass-through and clamp behaviours (see their types).
    `runtime_forms`: target -> what its runtime can run the op as on quantized data, for the
    float reason of an op qtool does not place pairs around ("QLinearSigmoid").
    Rules compare by identity: the layout and the verifier read the same objects.
    """

    op_type: str
    family: str
    quantizable: bool = False
    weights: Weights | None = None
    activation_inputs: bool = True
    output_quantized: bool = False
    shares_range: SharesRange | None = None
    folds: Folds | None = None
    runtime_forms: Mapping[str, str] = field(default_factory=dict)
    ort: OrtFusion = NO_FUSION
    entries: Mapping[tuple[str, str], Entry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only views: a registered rule changes only by registering another.
        object.__setattr__(self, "runtime_forms", MappingProxyType(dict(self.runtime_forms)))
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))

    def entry(self, target: str, precision: str) -> Entry:
        """The entry for (target, precision); RegistryError when there is none."""
        found = self.entries.get((target, precision))
        if found is not None:
            return found
        if target not in TARGETS:
            raise RegistryError(f"unknown target {target!r} (the registry has {list(TARGETS)})")
        have = self.precisions(target)
        if not have:
            raise RegistryError(
                f"{self.op_type} ({self.family}) is not quantized by qtool: it has no entries"
            )
        raise RegistryError(
            f"{self.op_type} ({self.family}) has no entry for target {target!r} at precision "
            f"{precision!r} (it has {', '.join(have)})"
        )

    def precisions(self, target: str) -> tuple[str, ...]:
        return tuple(p for t, p in self.entries if t == target)

    @property
    def written_op_types(self) -> frozenset[str]:
        """Every op type a planned node of this op can be written as, on any entry."""
        return frozenset({self.op_type}).union(*(entry.op_types for entry in self.entries.values()))


_RULES: dict[str, OpRule] = {}


def _check(rule: OpRule) -> None:
    """Refuse a rule the lookups could not answer for: an entry missing on a target that offers
    its precision (or present on one that does not), a key that is no precision, a weight-only
    entry that cannot say why ORT runs it in float."""
    behaviours = [rule.weights, rule.shares_range, rule.folds]
    if sum(b is not None for b in behaviours) > 1:
        raise RegistryError(f"{rule.op_type}: weights, shares_range and folds exclude each other")
    if not rule.quantizable:
        if rule.entries or rule.weights is not None:
            raise RegistryError(f"{rule.op_type}: entries and weights are for quantizable rules")
        return
    if rule.shares_range is not None or rule.folds is not None:
        raise RegistryError(f"{rule.op_type}: a pass-through or clamp op is not quantizable")
    unknown = {t for t, _ in rule.entries} - set(TARGETS)
    if unknown:
        raise RegistryError(f"{rule.op_type}: entries for unknown targets {sorted(unknown)}")
    for target_name, precision in rule.entries:
        where = f"{rule.op_type} ({target_name}, {precision})"
        if precision not in PRECISIONS:
            raise RegistryError(f"{where}: {precision!r} is not one of {list(PRECISIONS)}")
        if precision not in TARGETS[target_name].precisions:
            raise RegistryError(f"{where}: target {target_name} does not offer {precision}")
    # Every target that offers a precision the rule has must have its entry: the same
    # precisions on every target, as far as each target offers them.
    keys = {precision for _, precision in rule.entries}
    wanted = {name: {p for p in keys if p in target.precisions} for name, target in TARGETS.items()}
    have = {name: set(rule.precisions(name)) for name in TARGETS}
    if not keys or wanted != have:
        raise RegistryError(
            f"{rule.op_type}: needs entries for the same precisions on every target (where "
            "the target offers them), has "
            + "; ".join(f"{t}: {sorted(p)}" for t, p in have.items())
        )
    for (target_name, precision), entry in rule.entries.items():
        where = f"{rule.op_type} ({target_name}, {precision})"
        if not entry.op_types:
            raise RegistryError(f"{where}: names no written op type")
        weight_only = precision.endswith("/float")
        if weight_only and rule.weights is None:
            raise RegistryError(f"{where}: weight-only, but the rule has no weights")
        if weight_only and entry.not_fused is None:
            raise RegistryError(f"{where}: weight-only entries say why ORT runs them in float")


def register(rule: OpRule, *, replace: bool = False) -> OpRule:
    """Add `rule` to the registry (after the ones there: the recipe lists op types in this
    order). `replace`: swap out the rule of the same op type instead of refusing it."""
    _check(rule)
    if rule.op_type in _RULES and not replace:
        raise RegistryError(f"{rule.op_type} already has a rule ({_RULES[rule.op_type].family})")
    _RULES[rule.op_type] = rule
    return rule


def unregister(op_type: str) -> OpRule:
    """Remove and return the rule of `op_type` (tests that add a rule take it out again)."""
    if op_type not in _RULES:
        raise RegistryError(f"{op_type} has no rule to remove")
    return _RULES.pop(op_type)


def rule(op_type: str) -> OpRule:
    """The rule of `op_type`; RegistryError when there is none."""
    found = _RULES.get(op_type)
    if found is None:
        raise RegistryError(
            f"no op rule for {op_type!r} (rules exist for {', '.join(sorted(_RULES))})"
        )
    return found


def find_rule(op_type: str) -> OpRule | None:
    """The rule of `op_type`, or None: for walks over a graph, which may hold any op type."""
    return _RULES.get(op_type)


def rules() -> tuple[OpRule, ...]:
    """Every rule, in registration order."""
    return tuple(_RULES.values())


def quantizable_op_types() -> tuple[str, ...]:
    """The op types a recipe may list in quantization.op_types, in registration order."""
    return tuple(op for op, r in _RULES.items() if r.quantizable)


def target(name: str) -> Target:
    found = TARGETS.get(name)
    if found is None:
        raise RegistryError(f"unknown target {name!r} (the registry has {list(TARGETS)})")
    return found


def written_op_types(op_type: str, target_name: str, precision: str) -> tuple[str, ...]:
    """The op types qtool writes a planned `op_type` node as, for (target, precision)."""
    return rule(op_type).entry(target_name, precision).op_types


def fused_into(op_type: str, target_name: str, precision: str) -> tuple[str, ...]:
    """The ORT CPU kernels that run `op_type` written for (target, precision) (empty: float)."""
    return rule(op_type).entry(target_name, precision).fuses_into


def unplaced_reason(op_type: str, target_name: str) -> str:
    """The report's reason for a node of an op type qtool places no QDQ pair around."""
    found = find_rule(op_type)
    form = found.runtime_forms.get(target_name) if found is not None else None
    return target(target_name).unplaced_reason(op_type, form)


def float_weight_op_types() -> tuple[str, ...]:
    """Op types whose float constant weights ORT's fusion quantizes itself (for its reasons)."""
    return tuple(op for op, r in _RULES.items() if r.ort.quantizes_float_weights)
