"""What the user asks of the quantized model, per graph and per node: the plan stage's input.

The recipe's `quantization:` section is read into these types (qtool/config); the plan stage
(node_settings.py, layout.py) turns them into one decision per node. Unset fields stay None so
that defaults, presets and overrides layer cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TARGETS = ("ort-cpu", "tensorrt")

# How 4-bit MatMul/Gemm weights are written, and MatMulNBits' compute type (matmul_nbits.py).
INT4_FORMATS = ("matmulnbits", "qdq")

ACCURACY_LEVEL_CHOICES = ("auto", "0", "1", "2", "3", "4")

DEFAULT_OP_TYPES = ("Conv", "Gemm", "MatMul")

# The op types a recipe may list are the quantizable rules of the op registry
# (qtool.plan.ops.quantizable_op_types()).

# Per-node precisions (qtool/plan.py): int4 / int8 weights, or float (no QDQ at all).
PRECISIONS = ("int4", "int8", "float")

ACTIVATION_PRECISIONS = ("int8", "float")

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
    """One `quantization.overrides` entry: which nodes (name globs and/or op types), and what.

    Entries apply in order after the defaults, each setting only the fields it names; `where`
    is the entry's key path, for errors (a pattern that matches no node names it).
    """

    where: str
    nodes: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()
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
            or any(o.precision == "int4" for o in self.overrides)
        )

    @property
    def uses_int4(self) -> bool:
        settings = [self.weights] + [o.weights for o in self.overrides]
        return any(s.bits == 4 for s in settings)

    @property
    def symmetric_activations(self) -> bool:
        """TensorRT wants symmetric int8; ORT's CPU provider fuses asymmetric uint8 only."""
        return self.target == "tensorrt"
