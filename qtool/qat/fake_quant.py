"""Fake quantizers: what the QDQ pairs and stored weights compute, in differentiable torch.

Activations: y = (clamp(round(x / s) + z, qmin, qmax) - z) * s, QuantizeLinear then
DequantizeLinear (round half to even, as ONNX and torch both round). The rounding passes the
gradient straight through (STE); clamping stops it outside the range. With `learn` the scale is
a parameter trained as LSQ does (Esser et al. 2020): the same expression differentiated in s,
the gradient scaled by 1/sqrt(numel per sample * qmax) so the scale moves at the pace of the
weights.

Weights: the dequantized weight comes from the very function the writer stores it with
(choose_weight for int8 kernel weights, so the CPU's pair-safe format is what trains;
quantize_low_bit for 4-bit and blocked weights), with a straight-through gradient. Training
therefore sees exactly the weight values ONNX Runtime will multiply with.

MatMulNBits at accuracy level 4 (int8 compute, what qtool writes for CPUs with int8 dot products)
also quantizes its float input A inside the kernel: per row and per block of K, symmetric int8
with scale max|a| / 127 (MLAS's QuantizeARow_CompInt8). `BlockInt8Input` computes the same in
front of the module, so the fused model a VNNI CPU runs is the model that trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from qtool.write.int4 import BlockwiseWeight, dequantize
from qtool.write.params import ActivationParams, WeightParams

_MIN_SCALE = 1e-8


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round() forward, identity backward."""
    return x + (torch.round(x) - x).detach()


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward, gradient times `factor` backward (LSQ's step-size gradient scale)."""
    return (x - x * factor).detach() + x * factor


def activation_range(params: ActivationParams) -> tuple[int, int]:
    return (-128, 127) if params.dtype is np.int8 else (0, 255)


class ActivationQuantizer(nn.Module):
    """One QDQ pair: per-tensor scale (a parameter with LSQ) and a fixed zero point."""

    def __init__(self, params: ActivationParams, learn: bool = False) -> None:
        super().__init__()
        scale = torch.tensor(float(params.scale), dtype=torch.float32)
        if learn:
            self.scale = nn.Parameter(scale)
        else:
            self.register_buffer("scale", scale)
        self.learn = learn
        self.register_buffer("zero_point", torch.tensor(float(params.zero_point)))
        self.qmin, self.qmax = activation_range(params)
        self.dtype = params.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.clamp(min=_MIN_SCALE)
        if self.learn:
            # per sample (dim 0 is the batch): a DDP rank's half batch and one process's whole
            # batch then give the scale the same gradient, as they give every weight
            per_sample = x[0].numel() if x.dim() > 1 else x.numel()
            scale = scale_gradient(scale, 1.0 / math.sqrt(per_sample * self.qmax))
        q = torch.clamp(round_ste(x / scale) + self.zero_point, self.qmin, self.qmax)
        return (q - self.zero_point) * scale

    def params(self) -> ActivationParams:
        """The pair as the writer stores it (the scale as float32, exactly what trained)."""
        scale = np.float32(max(float(self.scale.detach()), _MIN_SCALE))
        zero = int(self.zero_point)
        low = float((self.qmin - zero) * scale)
        high = float((self.qmax - zero) * scale)
        return ActivationParams(scale, self.dtype(zero), low, high)


def dequantized_weight(params: WeightParams | BlockwiseWeight, transposed: bool) -> np.ndarray:
    """The float32 weight DequantizeLinear reconstructs, in the torch parameter's layout."""
    if isinstance(params, BlockwiseWeight):
        weight = dequantize(params)
    else:
        values = params.values.astype(np.float32)
        zero = params.zero_point_array().astype(np.float32)
        scale = np.asarray(params.scale, np.float32)
        if params.axis is not None:
            shape = [1] * values.ndim
            shape[params.axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        weight = ((values - zero) * scale).astype(np.float32)
    return np.ascontiguousarray(weight.T) if transposed else weight


class StoredWeightQuantizer(nn.Module):
    """A parametrization: the weight as the writer would store it, straight-through gradient.

    `store` maps the float weight (numpy, torch layout) to the writer's parameters.
    """

    def __init__(
        self, store: Callable[[np.ndarray], WeightParams | BlockwiseWeight], transposed: bool
    ) -> None:
        super().__init__()
        self.store = store
        self.transposed = transposed

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        params = self.store(weight.detach().cpu().numpy())
        stored = torch.from_numpy(dequantized_weight(params, self.transposed)).to(weight.device)
        return weight + (stored - weight).detach()


def _expand(values: torch.Tensor, axis: int, block_size: int | None, shape) -> torch.Tensor:
    """Per-channel or per-block parameters broadcast to the stored weight's shape."""
    if values.ndim == 0:
        return values
    if block_size is None:
        view = [1] * len(shape)
        view[axis] = -1
        return values.reshape(view)
    return values.repeat_interleave(block_size, dim=axis).narrow(axis, 0, shape[axis])


class LearnedWeightQuantizer(nn.Module):
    """A parametrization with LSQ-learned scales for a weight no integer kernel multiplies
    (4-bit, blocked, weight-only): initialised from the writer's scales, exported as the
    BlockwiseWeight it computes (`stored_form`), so the file holds what trained."""

    def __init__(self, initial: BlockwiseWeight, transposed: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.from_numpy(np.array(initial.scale, np.float32)))
        zero = np.zeros_like(initial.scale) if initial.zero_point is None else initial.zero_point
        self.register_buffer("zero_point", torch.from_numpy(np.array(zero, np.float32)))
        self.symmetric = initial.zero_point is None
        self.bits, self.axis, self.block_size = initial.bits, initial.axis, initial.block_size
        if self.symmetric:
            self.qmin, self.qmax = -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        else:
            self.qmin, self.qmax = 0, (1 << self.bits) - 1
        per_scale = initial.values.size / max(initial.scale.size, 1)
        self.gradient_scale = 1.0 / math.sqrt(per_scale * self.qmax)
        self.transposed = transposed

    def _codes(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stored = weight.t() if self.transposed else weight
        scale = scale_gradient(self.scale, self.gradient_scale)
        tiny = scale.abs() < _MIN_SCALE
        scale = torch.where(tiny, torch.full_like(scale, _MIN_SCALE), scale)
        scale = _expand(scale, self.axis, self.block_size, stored.shape)
        zero = _expand(self.zero_point, self.axis, self.block_size, stored.shape)
        codes = torch.clamp(round_ste(stored / scale) + zero, self.qmin, self.qmax)
        return codes, scale, zero

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._codes(weight)
        dequantized = (codes - zero) * scale
        return dequantized.t() if self.transposed else dequantized

    def stored_form(self, weight: torch.Tensor) -> BlockwiseWeight:
        """The BlockwiseWeight this quantizer computes (copied to the host: the module may have
        trained on a GPU)."""
        with torch.no_grad():
            codes = self._codes(weight)[0].cpu().numpy()
        scale = self.scale.detach().cpu().numpy().astype(np.float32)
        scale = np.where(np.abs(scale) < _MIN_SCALE, np.float32(_MIN_SCALE), scale)
        zero = None if self.symmetric else self.zero_point.cpu().numpy().astype(np.uint8)
        dtype = np.int8 if self.symmetric else np.uint8
        return BlockwiseWeight(
            codes.astype(dtype), scale, zero, self.bits, self.axis, self.block_size
        )


class BlockInt8Input(nn.Module):
    """MatMulNBits' int8 compute on its input: per row, blocks of `block_size` along the last
    axis, q = round_half_even(a * (127 / amax)), a' = q * (amax / 127); a partial last block takes
    its amax over the values it holds (the kernel pads it with zeros). Straight-through gradient:
    the dynamic scale follows the data and has nothing to learn."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        pad = (-k) % self.block_size
        blocks = nn.functional.pad(x.detach(), (0, pad)).reshape(*x.shape[:-1], -1, self.block_size)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = torch.round(blocks * inverse)
        dequantized = (codes * (amax / 127.0)).reshape(*x.shape[:-1], -1)[..., :k]
        return x + (dequantized - x).detach()
