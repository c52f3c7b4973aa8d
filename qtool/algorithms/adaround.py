"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"):
per layer, learn whether each weight rounds up or down so that the layer's output on calibration
data changes least, instead of rounding every weight to its nearest grid point.

Backend-free (torch and numpy, no ONNX): a layer is a grouped matrix product. Its input becomes
rows X [G, R, Kg] (a MatMul/Gemm input's rows; a Conv input's im2col patches, per group) and its
weight W [G, Mg, Kg], so that the output is X Wᵀ per group. The quantized layer reads X̃, the
input quantized as the writer quantizes it (per-tensor uint8 or int8), and Ŵ = s q on the
weight format's grid. With D = X - X̃ and Δ = Ŵ - W its output error is

    ||X Wᵀ - X̃ Ŵᵀ||² = tr(W DᵀD Wᵀ) - 2 <Δ, W (X̃ᵀD)ᵀ> + <Δ X̃ᵀX̃, Δ>,

so three K x K sums per group (`Grams`) summarise every calibration row exactly: memory is
bounded by K² however many rows the calibration set has (no row subsampling), each optimisation
step costs M K² whatever the row count, and the gradient is the full-batch one (no minibatch
noise: the same inputs give the same bytes). The objective is the layer's own output before any
activation function: the paper's layer-wise objective without f_a, which is what makes the sums
exact. Including the input quantization (X̃ against X) lets the rounding also absorb part of the
input's rounding error, which the paper's asymmetric variant does with the quantized model's
inputs; here both come from the float model's input to the layer, so layers are independent.

The optimisation is the paper's: q = floor(W / s) + h(V) with the rectified sigmoid
h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1), zeta 1.1, gamma -0.1; V starts where
h(V) equals the fractional part (nearest rounding's soft form); loss = reconstruction (summed
over output channels, mean over rows) + lambda sum(1 - |2h - 1|^beta) with lambda 0.01 and beta
annealed linearly from 20 to 2 after a 20% warm-up without the regulariser; Adam. The result
rounds up where h >= 0.5. Only weights whose nearest value is floor or floor + 1 inside the
format's range are learned; the rest (clipped values, values the pair-safe format lowered) keep
the format's value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

ZETA, GAMMA = 1.1, -0.1  # rectified sigmoid stretch (paper section 4.1)
BETA_START, BETA_END = 20.0, 2.0  # regulariser annealing
REG_WEIGHT = 0.01  # lambda
WARMUP = 0.2  # fraction of iterations before the regulariser starts
LEARNING_RATE = 1e-2  # Adam; the paper's 1e-3 over 10k steps, scaled to fewer steps
_PROGRESS_EVERY = 50


@dataclass(frozen=True)
class Geometry:
    """How a layer turns its input into rows against its grouped weight [G, Mg, Kg].

    `weight_layout`: "kn" (a MatMul/Gemm weight [K, N]), "nk" (Gemm transB [N, K]) or "conv"
    ([M, C/G, *kernel]). Conv fields follow ONNX: `pads` begin values then end values per spatial
    axis. `alpha` is Gemm's output multiplier, folded into the rows.
    """

    weight_layout: str
    groups: int = 1
    kernel: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    alpha: float = 1.0


def weight_groups(weight: np.ndarray, geometry: Geometry) -> np.ndarray:
    """The weight as [G, Mg, Kg]: output channel rows, reduction columns in the rows' order."""
    if geometry.weight_layout == "kn":
        return np.ascontiguousarray(weight.T)[None]
    if geometry.weight_layout == "nk":
        return np.ascontiguousarray(weight)[None]
    m = weight.shape[0]
    return weight.reshape(geometry.groups, m // geometry.groups, -1)


def from_groups(groups: np.ndarray, shape: tuple[int, ...], geometry: Geometry) -> np.ndarray:
    """Inverse of `weight_groups`."""
    if geometry.weight_layout == "kn":
        return np.ascontiguousarray(groups[0].T)
    if geometry.weight_layout == "nk":
        return np.ascontiguousarray(groups[0])
    return groups.reshape(shape)


def input_rows(
    x: torch.Tensor,
    geometry: Geometry,
    per_sample: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The layer input as rows [G, R, Kg]: every leading index of a MatMul/Gemm input, every
    output position of a Conv (its im2col patch, channels outer, kernel offsets inner, which
    matches the weight's [C/G, *kernel] flattening).

    `per_sample`: at most this many positions (sequence positions, output pixels) per sample,
    drawn from `generator`, the same positions for every sample of the batch: the sums need far
    fewer rows than a feature map has, and extracting every patch dominated the run time.
    """
    if geometry.weight_layout != "conv":
        if x.ndim > 2:
            seq = x.reshape(x.shape[0], -1, x.shape[-1])
            chosen = _positions(seq.shape[1], per_sample, generator)
            x = seq if chosen is None else seq[:, chosen]
        rows = x.reshape(-1, x.shape[-1])
        if geometry.alpha != 1.0:
            rows = rows * geometry.alpha
        return rows.unsqueeze(0)
    spatial = len(geometry.kernel)
    kernel, strides, dilations = geometry.kernel, geometry.strides, geometry.dilations
    begin, end = geometry.pads[:spatial], geometry.pads[spatial:]
    if spatial == 1:  # as a 2-D convolution of height 1
        x = x.unsqueeze(2)
        kernel, strides, dilations = (1, *kernel), (1, *strides), (1, *dilations)
        begin, end = (0, *begin), (0, *end)
    # F.pad takes the last axis first: (w_begin, w_end, h_begin, h_end); zeros, as ORT pads
    # the quantized input with its zero point, which dequantizes to exactly 0.
    if any(begin) or any(end):
        x = F.pad(x, (begin[1], end[1], begin[0], end[0]))
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    chosen = _positions(out_h * out_w, per_sample, generator)
    if chosen is None:
        chosen = torch.arange(out_h * out_w)
    top, left = (chosen // out_w) * sh, (chosen % out_w) * sw
    # im2col at the chosen positions only: one gather per kernel offset -> [N, C, k, P]
    patches = torch.stack(
        [x[:, :, top + i * dh, left + j * dw] for i in range(kh) for j in range(kw)], dim=2
    )
    n, g = patches.shape[0], geometry.groups
    cols = patches.reshape(n, g, -1, patches.shape[3])  # [N, G, Kg, P]
    return cols.permute(1, 0, 3, 2).reshape(g, -1, cols.shape[2])


def _positions(
    count: int, per_sample: int | None, generator: torch.Generator | None
) -> torch.Tensor | None:
    """Sorted random positions (at most `per_sample` of `count`), or None for all of them."""
    if per_sample is None or count <= per_sample:
        return None
    return torch.sort(torch.randperm(count, generator=generator)[:per_sample]).values


def layer_rows(
    x: torch.Tensor,
    geometry: Geometry,
    quantize: Callable[[torch.Tensor], torch.Tensor],
    per_sample: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of x, the same rows of quantize(x)) [G, R, Kg]. Quantizing the rows instead of x
    is the same (element-wise, and padding zeros quantize to exactly 0) and extracts once."""
    rows = input_rows(x, replace(geometry, alpha=1.0), per_sample, generator)
    quantized = quantize(rows)
    if geometry.alpha != 1.0:
        rows, quantized = rows * geometry.alpha, quantized * geometry.alpha
    return rows, quantized


def fake_quantize(x: torch.Tensor, scale: float, zero_point: int, low: int, high: int):
    """QuantizeLinear then DequantizeLinear as ONNX defines them (round half to even)."""
    q = torch.clamp(torch.round(x / scale) + zero_point, low, high)
    return (q - zero_point) * scale


class Grams:
    """Running sums over a layer's calibration rows, per group: C = X̃ᵀX̃, P = X̃ᵀD, Q = DᵀD
    (D = X - X̃), float64. Each batch's products are float32 (the activations are), as GPTQ's
    Hessians are."""

    def __init__(self) -> None:
        self.c: np.ndarray | None = None
        self.p: np.ndarray | None = None
        self.q: np.ndarray | None = None
        self.rows = 0

    def update(self, rows: torch.Tensor, quantized_rows: torch.Tensor) -> None:
        xq = quantized_rows  # [G, R, Kg]
        d = rows - quantized_rows
        xq_t = xq.transpose(1, 2)
        sums = [torch.bmm(xq_t, xq), torch.bmm(xq_t, d), torch.bmm(d.transpose(1, 2), d)]
        arrays = [s.numpy().astype(np.float64) for s in sums]
        if self.c is None:
            self.c, self.p, self.q = arrays
        else:
            self.c += arrays[0]
            self.p += arrays[1]
            self.q += arrays[2]
        self.rows += rows.shape[1]


def merged(first: Grams, second: Grams) -> Grams:
    """Sums over both sets of rows (either may be empty)."""
    if first.c is None:
        return second
    if second.c is None:
        return first
    out = Grams()
    out.c, out.p, out.q = first.c + second.c, first.p + second.p, first.q + second.q
    out.rows = first.rows + second.rows
    return out


def squared_error(grams: Grams, weight: np.ndarray, quantized: np.ndarray) -> float:
    """Sum over calibration rows and output channels of the squared output error of the layer
    with weight `quantized` reading X̃, against `weight` reading X (both [G, Mg, Kg])."""
    w = np.asarray(weight, np.float64)
    delta = np.asarray(quantized, np.float64) - w
    const = float(np.sum((w @ grams.q) * w))
    linear = float(np.sum((delta @ grams.p) * w))  # <Δ, W Pᵀ>
    quadratic = float(np.sum((delta @ grams.c) * delta))
    return max(const - 2.0 * linear + quadratic, 0.0)


@dataclass(frozen=True)
class Rounding:
    """The rounding problem of one weight, grouped [G, Mg, Kg]: float weight, per-element scale,
    the signed integer values the weight format chose (nearest, possibly lowered or clipped) and
    the format's range [-limit, limit]."""

    weight: np.ndarray
    scale: np.ndarray
    nearest: np.ndarray
    limit: int

    def floor_and_free(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """floor(W / s), its fractional remainder, and which weights may choose floor or floor+1
        (the format's own value is one of the two, and both lie in the range)."""
        ratio = (self.weight.astype(np.float32) / self.scale.astype(np.float32)).astype(np.float32)
        floor = np.floor(ratio)
        nearest = self.nearest.astype(np.float32)
        free = (
            ((nearest == floor) | (nearest == floor + 1))
            & (floor >= -self.limit)
            & (floor + 1 <= self.limit)
        )
        return floor, (ratio - floor).astype(np.float32), free


@contextlib.contextmanager
def single_thread(seed: int) -> Iterator[None]:
    """One torch thread and a fixed seed: a CPU reduction split across threads may add in a
    different order, and the same recipe must give the same bytes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def _beta(step: int, iterations: int) -> float:
    warm = int(WARMUP * iterations)
    progress = (step - warm) / max(iterations - warm, 1)
    return BETA_END + (BETA_START - BETA_END) * max(0.0, 1.0 - progress)


def learn_rounding(
    problem: Rounding,
    grams: Grams,
    iterations: int,
    on_step: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The learned integer values (signed, [G, Mg, Kg]) and h(V) (the soft up-rounding, 0..1;
        the format's value for weights not learned). Call inside `single_thread`; `on_step(n)` is
    told every few steps that n more are done (a progress bar)."""
    floor, rest, free = problem.floor_and_free()
    if grams.rows == 0 or grams.c is None:
        raise ValueError("AdaRound needs at least one calibration row")
    rows = float(grams.rows)
    w64 = np.asarray(problem.weight, np.float64)
    # Normalised per row: the reconstruction term is the mean over rows of the squared error
    # summed over output channels (the reference implementation's), without its constant.
    c = torch.from_numpy((grams.c / rows).astype(np.float32))
    linear = torch.from_numpy((w64 @ np.swapaxes(grams.p, 1, 2) / rows).astype(np.float32))
    w = torch.tensor(np.asarray(problem.weight, np.float32))
    s = torch.tensor(np.asarray(problem.scale, np.float32))
    base = torch.from_numpy(floor)
    mask = torch.from_numpy(free)
    fixed = s * torch.from_numpy(problem.nearest.astype(np.float32)) - w
    start = np.clip(rest, 1e-4, 1.0 - 1e-4)  # h(V0) = fractional part: nearest rounding
    v = torch.from_numpy(-np.log((ZETA - GAMMA) / (start - GAMMA) - 1.0).astype(np.float32))
    warm = int(WARMUP * iterations)
    free_count = int(free.sum())
    s_free = s * mask  # the gradient reaches learned weights only
    reg_mask = mask.to(torch.float32) * REG_WEIGHT
    # Adam (torch.optim.Adam's update, defaults betas (0.9, 0.999), eps 1e-8), with the
    # gradient written out: autograd's bookkeeping cost more than the maths on small layers.
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    moment = torch.zeros_like(v)
    second = torch.zeros_like(v)
    for step in range(iterations):
        sig = torch.sigmoid(v)
        raw = sig * (ZETA - GAMMA) + GAMMA
        h = raw.clamp(0.0, 1.0)
        delta = torch.where(mask, s * (base + h) - w, fixed)
        # d/d delta of <delta C, delta> - 2 <delta, L> (C symmetric), then through h = s-scaled
        grad_h = 2.0 * (torch.bmm(delta, c) - linear) * s_free
        if step >= warm and free_count:
            beta = _beta(step, iterations)
            centred = 2.0 * h - 1.0
            # d/dh of lambda (1 - |2h - 1|^beta)
            grad_h -= reg_mask * (2.0 * beta) * centred.abs().pow(beta - 1.0) * centred.sign()
        inside = ((raw > 0.0) & (raw < 1.0)).to(torch.float32)
        grad = grad_h * sig * (1.0 - sig) * (ZETA - GAMMA) * inside
        t = step + 1
        moment.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        second.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (second.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
        v.addcdiv_(moment, denom, value=-LEARNING_RATE / (1.0 - beta1**t))
        if on_step is not None and (t % _PROGRESS_EVERY == 0 or t == iterations):
            on_step(t - (t - 1) // _PROGRESS_EVERY * _PROGRESS_EVERY)
    h = torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0).numpy()
    values = np.where(free, floor + (h >= 0.5), problem.nearest).astype(np.int32)
    soft = np.where(free, h, np.nan).astype(np.float32)
    if not np.all(np.isfinite(h)):
        raise ValueError("AdaRound diverged (non-finite rounding variables)")
    return values, soft


def toward_zero(problem: Rounding) -> np.ndarray:
    """Per weight, the learnable choice of smaller magnitude (the format's value where nothing
    is learned): lowering a learned value to it never makes any sum of one sign larger."""
    floor, _, free = problem.floor_and_free()
    smaller = np.where(np.abs(floor) <= np.abs(floor + 1), floor, floor + 1)
    return np.where(free, smaller, problem.nearest).astype(np.int32)


def confidence(soft: np.ndarray) -> np.ndarray:
    """How far each learned h is from undecided (0.5); infinite where nothing was learned."""
    return np.where(np.isnan(soft), np.inf, np.abs(soft - 0.5)).astype(np.float32)


def output_mse(grams: Grams, weight: np.ndarray, quantized: np.ndarray) -> float:
    """Mean over calibration rows and output channels of the squared output error."""
    channels = weight.shape[0] * weight.shape[1]
    return squared_error(grams, weight, quantized) / max(grams.rows * channels, 1)


__all__ = [
    "Geometry",
    "Grams",
    "Rounding",
    "confidence",
    "fake_quantize",
    "from_groups",
    "input_rows",
    "layer_rows",
    "learn_rounding",
    "merged",
    "output_mse",
    "single_thread",
    "squared_error",
    "toward_zero",
    "weight_groups",
]
