"""The Plan: every per-node decision in one object, with the reason for each.

Layout, weight format, runtime verification (and later sensitivity and mixed precision) all read
and write the same Plan, so the report can say, for every node, what was planned, why, and what
ONNX Runtime actually did with it. Nothing outside a Plan decides a node's precision: a stage that
changes a decision records its own reason, and the report never shows an intention as a fact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

# A node's precision. Quantized (Q/DQ pairs): int4 and int8 (integer), fp8 (float8 E4M3FN).
# Not quantized: fp16 and bf16 (the node computes in that float type, written strongly typed by
# the write stage's typing pass) and float (FP32, the model's own type).
QUANTIZED = ("int4", "int8", "fp8")
FLOAT_TYPES = ("fp16", "bf16", "float")
PRECISIONS = QUANTIZED + FLOAT_TYPES
# What a node's activations are: int8 or fp8 Q/DQ pairs, dynamic (quantized at run time by a
# DynamicQuantizeLinear, no calibrated range), or none (float: weight-only nodes and float
# nodes; fp16/bf16 for nodes typed so).
ACTIVATIONS = ("int8", "dynamic", "fp8", "fp16", "bf16", "float")

# Why a node has its precision; the report groups by these.
SOURCES = (
    "default",  # the recipe's op_types select it and nothing stops it
    "excluded",  # quantization.exclude names it
    "override",  # a quantization.overrides entry set it
    "unsupported",  # qtool cannot quantize it (op type, constant inputs, attributes), or the
    # target's runtime has no kernel worth the form for its shapes (TensorRT's FP8 rules)
    "not-listed",  # a quantizable op type the recipe did not list
    "folded",  # a Relu/Clip folded into the preceding QuantizeLinear
    "passthrough",  # shape/max op that runs on the quantized data of its neighbours
    "tied",  # reads a weight another node reads too, stored once as that node plans it
    "kept-fp32",  # planned fp16/bf16, kept FP32 by a rule of the typing pass (write/keep_fp32.py)
)


@dataclass
class WeightPlan:
    """How one weight is stored: bits, granularity and the integer format ORT will multiply with.

    `format` is "s8" (int8, full range), "s8-pairsafe" (int8 with per-channel scales just large
    enough that no pair of products overflows a 16-bit sum), "s7" (7-bit values in int8) or "u8"
    (uint8 with zero point 128, which ORT runs with its U8U8 kernels); weight-only and 4-bit
    weights are "s4"/"u4"/"s8"/"u8" by bits and symmetry (nothing multiplies them as integers
    against uint8 activations, so no pair can saturate).

    `axis` is DequantizeLinear's: the output-channel axis for per-channel weights, the blocked
    (reduction) axis for blocks. `transposed` marks a Gemm transB weight stored as [K, N] (and
    the Gemm rewritten to transB=0) because only that layout fuses into MatMulNBits.
    """

    tensor: str
    bits: int = 8
    granularity: str = "per-channel"  # or "per-tensor", "block"
    axis: int | None = 0
    format: str = "s8"
    reason: str = "default: int8 symmetric, full range"
    block_size: int | None = None
    method: str = "minmax"  # scale search: minmax (round to nearest), mse, gptq
    symmetric: bool = True
    transposed: bool = False
    # Symmetric 4-bit blocks may take a negative scale (the largest magnitude on -8, as ORT's
    # RTN does) where it reconstructs better; TensorRT wants positive scales, so ort-cpu only.
    signed_scales: bool = False
    # Filled when the weight format stage runs: channels whose scale it had to widen, and by how
    # much resolution (log2 of the largest scale ratio) that cost.
    channels_changed: int = 0
    bits_lost_max: float = 0.0


@dataclass
class NodePlan:
    name: str
    op_type: str
    precision: str  # one of PRECISIONS
    source: str  # one of SOURCES
    reason: str
    activation_method: str | None = None
    weight: WeightPlan | None = None
    # "int8": the node's float inputs get Q/DQ pairs; "dynamic": its input is quantized at run
    # time (DynamicQuantizeLinear -> MatMulInteger); "float": weight-only (the weight is stored
    # quantized, the activations stay float).
    activations: str = "int8"
    # What ONNX Runtime does with the node, recorded by the verify stage (fusion.NodeRuntime).
    runtime: dict | None = None
    # The float type the node computes in, recorded by the write stage's typing pass when the
    # model is written with a low float type anywhere (write/float_type.py): computes_in, and
    # for a node kept in FP32 the rule and its reason.
    float_type: dict | None = None

    @property
    def quantized(self) -> bool:
        """Q/DQ pairs or a quantized weight: int4, int8 or fp8 (fp16/bf16 nodes are typed)."""
        return self.precision in QUANTIZED

    def to_dict(self) -> dict:
        entry = {
            "name": self.name,
            "op_type": self.op_type,
            "precision": self.precision,
            "source": self.source,
            "reason": self.reason,
        }
        if self.quantized:
            entry["activations"] = self.activations
        if self.activation_method is not None:
            entry["activation_method"] = self.activation_method
        if self.weight is not None:
            entry["weight"] = asdict(self.weight)
        if self.runtime is not None:
            entry["runtime"] = self.runtime
        if self.float_type is not None:
            entry["float_type"] = self.float_type
        return entry


@dataclass
class Plan:
    """Ordered NodePlans (graph order), looked up by node name."""

    nodes: dict[str, NodePlan] = field(default_factory=dict)

    def add(self, node: NodePlan) -> None:
        if node.precision not in PRECISIONS:
            raise ValueError(
                f"node {node.name!r}: precision {node.precision!r} is not one of {PRECISIONS}"
            )
        if node.activations not in ACTIVATIONS:
            raise ValueError(f"node {node.name!r}: activations {node.activations!r}")
        if node.source not in SOURCES:
            raise ValueError(f"node {node.name!r}: source {node.source!r} not in {SOURCES}")
        self.nodes[node.name] = node

    def __iter__(self) -> Iterator[NodePlan]:
        return iter(self.nodes.values())

    def __getitem__(self, name: str) -> NodePlan:
        return self.nodes[name]

    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def quantized(self) -> list[NodePlan]:
        return [node for node in self if node.quantized]

    def weight_plans(self) -> dict[str, WeightPlan]:
        """Weight tensor -> its plan (a weight shared by two nodes has one plan)."""
        return {node.weight.tensor: node.weight for node in self if node.weight is not None}

    def counts(self) -> dict[str, int]:
        return dict(Counter(node.precision for node in self))

    def to_list(self) -> list[dict]:
        return [node.to_dict() for node in self]
