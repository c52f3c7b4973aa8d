"""The accuracy algorithms a recipe can turn on, their parameters and defaults, and the order
they are applied in (documented in docs/architecture.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# cross_layer_equalization.bias_absorption when the recipe does not say (chosen by measurement:
# examples/effnet_lite/README.md, "Bias absorption").
BIAS_ABSORPTION_DEFAULT = False

# quantization.algorithms, in the fixed order they run (qtool/pipeline: prepare.py, build.py);
# the parameters each takes, with defaults.
# - cross_layer_equalization first, before calibration: it rescales the float model whose
#   ranges calibration measures;
# - smoothquant after calibration: it needs that pass's per-channel statistics, then re-plans
#   the smoothed graph and derives the smoothed inputs' ranges exactly;
# - awq after smoothquant: both rescale input channels of the float model, awq those of the
#   weight-only layers (smoothquant only touches layers with int8 activations), each re-planning
#   the changed graph; both read the one calibration pass.
# - int8_fallback after awq: it ranks the 4-bit layers by the output error of their rounding,
#   which is the error of the weights AWQ has scaled, and re-plans the layers it keeps at 8 bits
#   before scale estimation and GPTQ choose the 4-bit grids and roundings of the rest.
# - scale_estimation and gptq when the weights are quantized: they choose each weight's blocks
#   (scale estimation the grid of every block, GPTQ the rounding, on scale estimation's grids
#   when both are on) against the layer's calibration Hessian, after AWQ has fixed the weights.
# - adaround before bias_correction: bias correction measures the mean output shift of the layer
#   as it will be stored, so it must see the final rounded weights (rounding after it would
#   leave a correction for weights that no longer exist).
ALGORITHM_ORDER = (
    "cross_layer_equalization",
    "smoothquant",
    "awq",
    "int8_fallback",
    "scale_estimation",
    "gptq",
    "adaround",
    "bias_correction",
)


@dataclass(frozen=True)
class CleParams:
    """Exact rescaling of Conv -> (Relu | Clip(0, hi)) -> Conv pairs (qtool/algorithms/cle.py).

    `samples`: calibration samples whose per-channel maxima bound the scales through a Clip (and
    whose minima bound the shifts). `bias_absorption`: move what the activation allows of A's
    bias into B's afterwards (bias_absorption.py). `through_clip`: also equalize pairs through
    Clip(0, hi), exact only on data whose channel maxima stay within the calibration samples'
    (off: on EfficientNet-Lite0 the equalized float model agreed with the original on 95% of new
    images; examples/effnet_lite/README.md)."""

    samples: int = 512
    bias_absorption: bool = BIAS_ABSORPTION_DEFAULT
    through_clip: bool = False


@dataclass(frozen=True)
class SmoothQuantParams:
    """`alpha`: migration strength, "auto" (searched per layer input over SMOOTHQUANT_ALPHAS) or
    one number in [0, 1] (kept only where it beats no smoothing); `objective`: where a
    candidate's error is measured on the tuning rows, "block" (the output of the transformer
    block after its residual Add) or "layer" (the smoothed MatMuls' own outputs)
    (qtool/algorithms/smoothquant.py)."""

    alpha: str | float = "auto"
    objective: str = "block"


SMOOTHQUANT_OBJECTIVES = ("block", "layer")


@dataclass(frozen=True)
class AwqParams:
    """Activation-aware weight scaling of weight-only layers (qtool/algorithms/awq.py).

    Per layer input X, one scale per input channel s = rms(X)^alpha, alpha searched on `grid`
    points in [0, 1] by the quantized layers' output error computed exactly from XᵀX (the
    calibration Hessian); the weights take s, the op producing X takes 1/s."""

    grid: int = 20


@dataclass(frozen=True)
class Int8FallbackParams:
    """8-bit weights for the 4-bit layers whose rounding costs the most output error per
    parameter (qtool/algorithms/int8_fallback.py): `ratio` is the share of the 4-bit weights,
    by parameter count, that stay 4-bit (NNCF's `ratio`). The default is `int4-mixed-llm`'s,
    so `int8_fallback: {}` gives what the preset measured."""

    ratio: float = 0.5


@dataclass(frozen=True)
class ScaleEstimationParams:
    """Each 4-bit block's scale chosen against the layer's output error (the block's part of the
    calibration Hessian) rather than its own weights (qtool/write/scale_estimation.py): `steps`
    shrink factors of the min-max range from 1 down to `min_factor`, each followed by `refine`
    least-squares refits of the scale to the rounded block."""

    steps: int = 10
    min_factor: float = 0.55
    refine: int = 2


@dataclass(frozen=True)
class GptqParams:
    """The parameters of `quantization.weights.method: gptq` (qtool/write/gptq.py): `act_order`
    rounds the rows in decreasing Hessian diagonal order, `damp` adds damp x mean(diag H) to the
    Hessian's diagonal."""

    act_order: bool = True
    damp: float = 0.01


@dataclass(frozen=True)
class AdaRoundParams:
    """`samples`: calibration samples whose layer inputs the rounding is learned on (the first
    N); `iterations`: Adam steps per layer (qtool/algorithms/adaround.py)."""

    samples: int = 256
    iterations: int = 1000


@dataclass(frozen=True)
class BiasCorrectionParams:
    """`samples`: calibration samples the shift is measured on (the first N)."""

    samples: int = 256


AlgorithmParams = (
    CleParams
    | SmoothQuantParams
    | AwqParams
    | Int8FallbackParams
    | ScaleEstimationParams
    | GptqParams
    | AdaRoundParams
    | BiasCorrectionParams
)

# Each algorithm's parameter type; its fields and defaults are the recipe's keys and defaults.
ALGORITHM_PARAMS: dict[str, type] = {
    "cross_layer_equalization": CleParams,
    "smoothquant": SmoothQuantParams,
    "awq": AwqParams,
    "int8_fallback": Int8FallbackParams,
    "scale_estimation": ScaleEstimationParams,
    "gptq": GptqParams,
    "adaround": AdaRoundParams,
    "bias_correction": BiasCorrectionParams,
}


@dataclass(frozen=True)
class Algorithms:
    """The algorithms a recipe turns on (`quantization.algorithms`), each with its parameters,
    None where off. The build stages read the field of the one they run."""

    cross_layer_equalization: CleParams | None = None
    smoothquant: SmoothQuantParams | None = None
    awq: AwqParams | None = None
    int8_fallback: Int8FallbackParams | None = None
    scale_estimation: ScaleEstimationParams | None = None
    gptq: GptqParams | None = None
    adaround: AdaRoundParams | None = None
    bias_correction: BiasCorrectionParams | None = None

    def names(self) -> tuple[str, ...]:
        """The algorithms turned on, in the order they run."""
        return tuple(name for name in ALGORITHM_ORDER if getattr(self, name) is not None)

    def __bool__(self) -> bool:
        return bool(self.names())


def defaults(name: str) -> dict[str, Any]:
    """Algorithm `name`'s parameters at their defaults, as a recipe would spell them."""
    return dataclasses.asdict(ALGORITHM_PARAMS[name]())


SMOOTHQUANT_ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))  # 0.0 = no smoothing

MAX_ADAROUND_ITERATIONS = 100000

MAX_AWQ_GRID = 1000
MAX_SCALE_STEPS = 1000
