"""What the user asks of the quantized model, per graph and per node: the plan stage's input.

The recipe's `quantization:` section is read into these types (qtool/config); the plan stage
(node_settings.py, layout.py) turns them into one decision per node. Unset fields stay None so
that defaults, presets and overrides layer cleanly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

TARGETS = ("ort-cpu", "tensorrt")

# How 4-bit MatMul/Gemm weights are written, and MatMulNBits' compute type (matmul_nbits.py).
INT4_FORMATS = ("matmulnbits", "qdq")

ACCURACY_LEVEL_CHOICES = ("auto", "0", "1", "2", "3", "4")

DEFAULT_OP_TYPES = ("Conv", "Gemm", "MatMul")

# The op types a recipe may list are the quantizable rules of the op registry
# (qtool.plan.ops.quantizable_op_types()).

# Per-node precisions (qtool/plan/plan.py): int4 / int8 / fp8 (Q/DQ), or fp16 / bf16 (no Q/DQ,
# the node computes in that type) or float (no Q/DQ, FP32).
PRECISIONS = ("int4", "int8", "fp8", "fp16", "bf16", "float")

# quantization.precision: what the nodes op_types selects become (None: by weights.bits).
QUANTIZED_PRECISIONS = ("int4", "int8", "fp8")

# quantization.activations: int8 Q/DQ pairs (static, calibrated ranges), dynamic (int8 weights,
# the input quantized at run time, ort-cpu MatMul/Gemm), or weight-only (fp8 nodes have fp8
# activations).
ACTIVATION_PRECISIONS = ("int8", "dynamic", "float")

# The targets that run dynamic int8 (DynamicQuantizeLinear + MatMulInteger): ONNX Runtime's.
DYNAMIC_TARGETS = ("ort-cpu",)

# quantization.dynamic_ranges: the range a dynamic node's input is quantized with at run time,
# one per tensor (DynamicQuantizeLinear, ORT's fused form) or one per token (per row of the last
# axis: an LLM's outlier tokens then cost only their own row; unfused MatMulInteger).
DYNAMIC_RANGES = ("per-tensor", "per-token")

# quantization.float_type: the type every node that is not quantized computes in, and the
# node precision that stands for it.
FLOAT_TYPES = {"fp32": "float", "fp16": "fp16", "bf16": "bf16"}

# quantization.float_io: graph inputs and outputs keep their type (Casts at the boundary), or
# take the float type (a caller feeds and reads that type).
FLOAT_IO = ("keep", "float_type")

# What each target's runtime can run, beyond int8/int4: FP8 E4M3 Q/DQ and BF16 are TensorRT's
# (ORT's CPU provider has neither kernels nor a fused form for them); FP16 runs on both (ORT's
# CPU provider runs FP16 where it has a kernel and casts around the rest).
TARGET_PRECISIONS = {
    "ort-cpu": ("int4", "int8", "fp16", "float"),
    "tensorrt": ("int4", "int8", "fp8", "fp16", "bf16", "float"),
}

WEIGHT_GRANULARITIES = ("per-channel", "per-tensor", "block")

WEIGHT_METHODS = ("minmax", "mse", "gptq")

BLOCK_SIZES = (16, 32, 64, 128)

# quantization.saturation: what to do where ORT's uint8 x int8 kernels saturate (weight_format.py).
SATURATION_POLICIES = ("auto", "pair-safe", "reduce-range", "uint8-weights", "ignore")


@dataclass(frozen=True)
class WeightSettings:
    """How weights are stored; None means "not set here" so that overrides layer cleanly.

    Unset fields resolve by bits (`resolved`): 4-bit weights default to blocks of 32 along the
    reduction axis (the layout ORT fuses into MatMulNBits), 8-bit ones to one scale per output
    channel; both default to symmetric round-to-nearest (`minmax`).
    """

    bits: int | None = None
    granularity: str | None = None
    block_size: int | None = None
    method: str | None = None
    symmetric: bool | None = None

    def layered(self, top: WeightSettings) -> WeightSettings:
        """These settings with every field `top` sets replaced by `top`'s."""
        merged = {
            key: getattr(top, key) if getattr(top, key) is not None else getattr(self, key)
            for key in ("bits", "granularity", "block_size", "method", "symmetric")
        }
        return WeightSettings(**merged)

    def resolved(self) -> WeightSettings:
        bits = 8 if self.bits is None else self.bits
        granularity = self.granularity or (
            "block" if bits == 4 or self.block_size is not None else "per-channel"
        )
        return WeightSettings(
            bits=bits,
            granularity=granularity,
            block_size=(self.block_size or 32) if granularity == "block" else None,
            method=self.method or "minmax",
            symmetric=True if self.symmetric is None else self.symmetric,
        )


@dataclass(frozen=True)
class Override:
    """One `quantization.overrides` entry: which nodes (name globs, op types and/or attention
    roles read from the graph, qtool/plan/attention.py), and what.

    Entries apply in order after the defaults, each setting only the fields it names; `where`
    is the entry's key path, for errors (a pattern that matches no node names it).
    """

    where: str
    nodes: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    precision: str | None = None
    weights: WeightSettings = field(default_factory=WeightSettings)
    activations: str | None = None
    # True: only nodes with a constant float weight (an initializer, or a Transpose of one);
    # False: only nodes without (attention's activation x activation MatMuls); None: either.
    constant_weight: bool | None = None


@dataclass(frozen=True)
class QuantizationSpec:
    target: str = "ort-cpu"
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    exclude: tuple[str, ...] = ()
    # The CPU the model will run on ("auto": this machine) and what to do where ORT's uint8 x int8
    # kernels would saturate there (see qtool/quantize/weight_format.py).
    cpu: str = "auto"
    saturation: str = "auto"
    # Defaults for every node, then the overrides in order (qtool/quantize/node_settings.py).
    weights: WeightSettings = field(default_factory=WeightSettings)
    # None: int8 for int8 nodes, float (weight-only) for int4 nodes.
    activations: str | None = None
    overrides: tuple[Override, ...] = ()
    # How 4-bit MatMul/Gemm weights are written (qtool/quantize/matmul_nbits.py): None means the
    # target's default (ort-cpu: matmulnbits, tensorrt: qdq); the MatMulNBits accuracy level
    # "auto" is picked for `cpu`.
    int4_format: str | None = None
    accuracy_level: str = "auto"
    # What the nodes op_types selects become: None: int8 or int4 by weights.bits; "fp8": FP8 E4M3
    # Q/DQ (tensorrt). The float type of everything not quantized (FLOAT_TYPES), and whether the
    # graph's inputs and outputs take it (FLOAT_IO).
    precision: str | None = None
    float_type: str = "fp32"
    float_io: str = "keep"
    # DYNAMIC_RANGES: how every dynamic node's input is ranged at run time.
    dynamic_ranges: str = "per-tensor"

    @property
    def float_precision(self) -> str:
        """The node precision of a node that is not quantized: float (FP32), fp16 or bf16."""
        return FLOAT_TYPES[self.float_type]

    def precisions_asked(self) -> set[str]:
        """Every node precision the settings name (quantization.precision, the overrides')."""
        asked = {o.precision for o in self.overrides if o.precision is not None}
        if self.precision is not None:
            asked.add(self.precision)
        return asked

    @property
    def uses_fp8(self) -> bool:
        return "fp8" in self.precisions_asked()

    @property
    def resolved_int4_format(self) -> str:
        if self.int4_format is not None:
            return self.int4_format
        return "qdq" if self.target == "tensorrt" else "matmulnbits"

    @property
    def per_channel(self) -> bool:
        return self.weights.resolved().granularity != "per-tensor"

    @property
    def may_need_opset21(self) -> bool:
        """Blocked or 4-bit weights anywhere: DequantizeLinear with block_size / int4 types.
        Embedding tables on ort-cpu are always blocked (GatherBlockQuantized, layout.py)."""
        settings = [self.weights] + [o.weights for o in self.overrides]
        blocked_tables = "Gather" in self.op_types and self.target == "ort-cpu"
        return (
            blocked_tables
            or any(s.bits == 4 or s.granularity == "block" for s in settings)
            or "int4" in self.precisions_asked()
            or self.uses_fp8  # float8 Q/DQ: opset 19, and qtool upgrades to 21
            or self.typed_qdq  # Q/DQ in FP16/BF16: opset 19 (before it, DQ outputs FP32 only)
        )

    @property
    def typed_qdq(self) -> bool:
        """Q/DQ pairs in a model whose float type is low: DequantizeLinear writes FP16/BF16 (and
        QuantizeLinear reads it) from opset 19 on; before, they are FP32 only."""
        quantizes = bool(self.op_types) or bool(self.precisions_asked() & {"int4", "int8", "fp8"})
        return self.float_type != "fp32" and quantizes

    @property
    def uses_int4(self) -> bool:
        settings = [self.weights] + [o.weights for o in self.overrides]
        return any(s.bits == 4 for s in settings)

    @property
    def model_tag(self) -> str:
        """The quantized model's file tag: int4 where 4-bit weights are asked anywhere, else
        fp8, else int8; a model that quantizes nothing (op_types empty) is named by its float
        type."""
        if self.uses_int4:
            return "int4"
        if self.uses_fp8:
            return "fp8"
        asked = self.precisions_asked()
        if not self.op_types and not asked & {"int8", "int4", "fp8"}:
            low = [p for p in ("fp16", "bf16") if p in asked | {self.float_type}]
            return low[0] if low else "typed"
        return "int8"

    @property
    def symmetric_activations(self) -> bool:
        """TensorRT wants symmetric int8; ORT's CPU provider fuses asymmetric uint8 only."""
        return self.target == "tensorrt"


_GLOB_CHARS = "*?["


def exact_pattern(name: str) -> str:
    """A `nodes:` pattern that matches the node called `name` and no other.

    Node names are matched as globs; a name holding glob characters gets each one bracketed
    (`a[*]b` matches only 'a*b'), any other name is its own pattern (read as an exact name).
    """
    if not any(c in name for c in _GLOB_CHARS):
        return name
    return "".join(f"[{c}]" if c in _GLOB_CHARS else c for c in name)


def with_overrides(spec: QuantizationSpec, extra: Iterable[Override]) -> QuantizationSpec:
    """`spec` with `extra` applied after its own overrides (so they win): how the search pins
    a plan and an algorithm (the INT8 fallback) re-plans chosen nodes."""
    return dataclasses.replace(spec, overrides=tuple(spec.overrides) + tuple(extra))
