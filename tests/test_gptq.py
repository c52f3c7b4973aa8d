"""GPTQ: the streaming Hessian accumulator and the error-feedback rounding against
round-to-nearest, a plain (non-lazy) re-implementation of the paper's loop, and its edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.calibration.hessians import HessianAccumulator
from qtool.errors import CalibrationError, DataError
from qtool.write.gptq import gptq_quantize, hessian_error
from qtool.write.int4 import (
    block_scales,
    dequantize,
    dequantize_values,
    quantize_blockwise,
    quantize_values,
)


def _correlated_inputs(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Inputs dominated by 12 shared factors: strong correlation between the K features."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((12, k))
    return (rng.standard_normal((rows, 12)) @ mixing + 0.1 * rng.standard_normal((rows, k))).astype(
        np.float32
    )


def _layer(k: int = 128, n: int = 48, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)


def test_accumulator_streams_and_merges_exactly():
    x = _correlated_inputs(600, 32)
    one = HessianAccumulator(32)
    for start in range(0, 600, 200):
        one.update(x[start : start + 200])
    shards = [HessianAccumulator(32) for _ in range(3)]
    for i, shard in enumerate(shards):
        shard.update(x[200 * i : 200 * (i + 1)])
    merged = shards[0].merge(shards[1]).merge(shards[2])
    assert merged.rows == one.rows == 600
    assert merged.xtx.tobytes() == one.xtx.tobytes()  # same additions, same order: same bytes
    x64 = x.astype(np.float64)
    # float32 per-batch products (update's docstring): float32 rounding, not float64's
    scale = float(np.max(np.diag(x64.T @ x64)))
    np.testing.assert_allclose(one.xtx, x64.T @ x64, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(one.hessian(), x64.T @ x64 / 600, rtol=1e-5, atol=1e-6 * scale)
    assert one.xtx.shape == (32, 32)  # memory: one K x K matrix whatever the sample count


def test_accumulator_counts_every_leading_dimension_as_rows():
    acc = HessianAccumulator(8, name="layer.input")
    acc.update(np.ones((2, 5, 8), np.float32))
    assert acc.rows == 10 and acc.xtx[0, 0] == 10.0
    with pytest.raises(DataError, match="'layer.input'.*last dimension 8"):
        acc.update(np.ones((4, 7), np.float32))
    with pytest.raises(DataError, match="NaN"):
        acc.update(np.full((1, 8), np.nan, np.float32))
    with pytest.raises(CalibrationError, match="no calibration rows"):
        HessianAccumulator(8).hessian()
    restored = HessianAccumulator.from_sum(acc.xtx, acc.rows, name="layer.input")
    assert restored.merge(acc).rows == 20


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(symmetric, act_order):
    k, n = 128, 48
    weight = _layer(k, n)
    inputs = _correlated_inputs(1536, k, seed=2)
    calibration, held_out = inputs[:1024], inputs[1024:]
    acc = HessianAccumulator(k)
    acc.update(calibration)
    gptq = gptq_quantize(
        weight, acc.hessian(), block_size=32, symmetric=symmetric, act_order=act_order
    )
    rtn = quantize_blockwise(weight, block_size=32, symmetric=symmetric)
    assert gptq.scale.shape == rtn.scale.shape == (4, n)
    assert (gptq.zero_point is None) == symmetric

    def output_error(bw, x):
        return np.linalg.norm(x @ weight - x @ dequantize(bw))

    # measured: about 0.2 of RTN's error (0.12 with act_order), on held-out data too
    assert output_error(gptq, calibration) < 0.5 * output_error(rtn, calibration)
    assert output_error(gptq, held_out) < 0.5 * output_error(rtn, held_out)
    assert hessian_error(weight, gptq, acc.hessian()) < hessian_error(weight, rtn, acc.hessian())


def _plain_gptq(weight, hessian, block_size, symmetric, damp=0.01):
    """The paper's loop without lazy batches: every row's error reaches all later rows at once."""
    w = weight.astype(np.float64).copy()
    k = w.shape[0]
    h = hessian + np.eye(k) * damp * np.mean(np.diag(hessian))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    values, scales = [], []
    for i in range(k):
        if i % block_size == 0:
            scale, zero = block_scales(w[i : i + block_size], symmetric=symmetric)
            scales.append(scale)
        q = quantize_values(w[i], scale, zero, 4)
        err = (w[i] - dequantize_values(q, scale, zero)) / u[i, i]
        w[i + 1 :] -= np.outer(u[i, i + 1 :], err)
        values.append(q)
    return np.stack(values), np.stack(scales)


@pytest.mark.parametrize("lazy_batch", [128, 7])
@pytest.mark.parametrize("symmetric", [True, False])
def test_lazy_batches_match_the_plain_algorithm(lazy_batch, symmetric):
    """A lazy batch of 7 starts blocks mid-batch: their rows beyond it must get the pending
    error feedback before the block's grid is fixed."""
    k = 96
    weight = _layer(k, 24, seed=4)
    acc = HessianAccumulator(k)
    acc.update(_correlated_inputs(512, k, seed=5))
    values, scales = _plain_gptq(weight, acc.hessian(), 32, symmetric)
    got = gptq_quantize(
        weight, acc.hessian(), block_size=32, symmetric=symmetric, lazy_batch=lazy_batch
    )
    np.testing.assert_allclose(got.scale, scales, rtol=1e-5)
    assert np.mean(got.values != values) < 0.002  # float-order ties only


def test_uncorrelated_inputs_reduce_gptq_to_round_to_nearest():
    """Diagonal H: no row's error can be compensated by another, so GPTQ is exactly RTN."""
    weight = _layer(64, 16, seed=6)
    hessian = np.diag(np.linspace(0.5, 2.0, 64))
    for symmetric in (True, False):
        gptq = gptq_quantize(weight, hessian, block_size=16, symmetric=symmetric)
        rtn = quantize_blockwise(weight, block_size=16, symmetric=symmetric)
        assert gptq.values.tobytes() == rtn.values.tobytes()
        assert gptq.scale.tobytes() == rtn.scale.tobytes()


def test_gptq_is_deterministic_and_handles_dead_inputs():
    k = 80  # not a multiple of the block: a short last block
    weight = _layer(k, 20, seed=7)
    x = _correlated_inputs(400, k, seed=8)
    dead = [3, 40, 79]
    x[:, dead] = 0.0  # inputs never active in calibration
    acc = HessianAccumulator(k)
    acc.update(x)
    first = gptq_quantize(weight, acc.hessian(), block_size=32, act_order=True)
    second = gptq_quantize(weight.copy(), acc.hessian().copy(), block_size=32, act_order=True)
    for a, b in ((first.values, second.values), (first.scale, second.scale)):
        assert a.tobytes() == b.tobytes()
    assert first.scale.shape == (3, 20) and np.all(np.isfinite(dequantize(first)))
    # dead rows keep their weights, rounded to nearest on their block's grid (not zeroed)
    block_scale = np.repeat(first.scale, 32, axis=0)[:k]
    rtn = np.clip(np.rint(weight / block_scale), -8, 7)
    np.testing.assert_array_equal(first.values[dead], rtn[dead])
    assert np.any(first.values[dead] != 0)


def test_bad_hessians_are_rejected():
    weight = _layer(16, 4)
    with pytest.raises(CalibrationError, match="does not match K=16"):
        gptq_quantize(weight, np.eye(8))
    with pytest.raises(CalibrationError, match="not positive definite"):
        gptq_quantize(weight, -np.eye(16), damp=0.0)
