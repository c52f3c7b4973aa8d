"""qtool.metrics.signal: the one signal-quality accumulator, against numpy written out here.

The callers moved onto it (evaluate, verify's fused-vs-unfused check, analyze, SmoothQuant,
bias correction and AdaRound, the QAT export check) must print the numbers they printed before,
so the formulas they used are repeated below and compared bit for bit, not approximately.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qtool.metrics.signal import (
    SignalQuality,
    cosine_rows,
    db_from_noise_ratio,
    format_db,
    json_float,
    noise_ratio_from_db,
    sqnr_db,
    top1_margins,
)


@pytest.fixture
def pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    """Three batches of [rows, 7] float32 references and noisy copies."""
    rng = np.random.default_rng(0)
    out = []
    for rows in (5, 9, 3):
        ref = rng.normal(size=(rows, 7)).astype(np.float32)
        out.append((ref, (ref + rng.normal(size=ref.shape) * 0.1).astype(np.float32)))
    return out


def test_sums_are_bit_identical_to_the_formulas_callers_used(pairs) -> None:
    quality = SignalQuality(peak=True)
    signal = noise = 0.0  # runtime/fusion.py compare_fused_unfused, before
    total, count = 0.0, 0  # algorithms/bias_correction.py output_error, before
    peak = 0.0  # qat/export.py max_difference, before
    for ref, test in pairs:
        quality.update(ref, test)
        ref64, test64 = np.asarray(ref, np.float64), np.asarray(test, np.float64)
        signal += float(np.sum(ref64 * ref64))
        noise += float(np.sum((ref64 - test64) ** 2))
        diff = ref64 - test64
        total += float(np.sum(diff * diff))
        count += diff.size
        peak = max(peak, float(np.abs(ref.astype(np.float64) - test.astype(np.float64)).max()))
    assert quality.signal == signal and quality.noise == noise
    assert quality.sqnr_db() == 10.0 * math.log10(signal / noise)
    assert quality.mse() == total / count
    assert quality.max_abs_diff == peak


def test_row_cosine_and_agreement_match_numpy(pairs) -> None:
    quality = SignalQuality(cosine="rows", top1=True)
    for ref, test in pairs:
        quality.update(ref, test)
    ref = np.concatenate([r for r, _ in pairs]).astype(np.float64)
    test = np.concatenate([t for _, t in pairs]).astype(np.float64)
    per_row = np.sum(ref * test, 1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(test, axis=1))
    assert quality.cosine() == pytest.approx(float(np.mean(per_row)), abs=1e-12)
    agree = int(np.sum(np.argmax(ref, 1) == np.argmax(test, 1)))
    assert quality.agreement() == agree / len(ref)
    assert quality.changed() == len(ref) - agree
    assert quality.rows == len(ref)


def test_global_cosine_is_one_cosine_of_all_values(pairs) -> None:
    quality = SignalQuality(cosine="global")
    for ref, test in pairs:
        quality.update(ref, test)
    ref = np.concatenate([r.ravel() for r, _ in pairs]).astype(np.float64)
    test = np.concatenate([t.ravel() for _, t in pairs]).astype(np.float64)
    expected = ref @ test / (np.linalg.norm(ref) * np.linalg.norm(test))
    assert quality.cosine() == pytest.approx(float(expected), abs=1e-12)


def test_merge_equals_one_stream(pairs) -> None:
    whole = SignalQuality(cosine="rows", top1=True, peak=True)
    parts = [SignalQuality(cosine="rows", top1=True, peak=True) for _ in pairs]
    for (ref, test), part in zip(pairs, parts, strict=True):
        whole.update(ref, test)
        part.update(ref, test)
    merged = SignalQuality(cosine="rows", top1=True, peak=True)
    for part in parts:
        merged.merge(part)
    assert vars(merged) == vars(whole)
    with pytest.raises(ValueError, match="same things"):
        merged.merge(SignalQuality())


def test_margin_noise_is_the_mean_squared_change_of_the_reference_top1_margin(pairs) -> None:
    quality = SignalQuality(margin=True)
    parts = [SignalQuality(margin=True) for _ in pairs]
    changes = []
    for (ref, test), part in zip(pairs, parts, strict=True):
        quality.update(ref, test)
        part.update(ref, test)
        for r, t in zip(ref.astype(np.float64), test.astype(np.float64), strict=True):
            top, runner = np.argsort(-r, kind="stable")[:2]
            changes.append((t[top] - t[runner]) - (r[top] - r[runner]))
    assert quality.margin_noise() == pytest.approx(float(np.mean(np.square(changes))), rel=1e-12)
    merged = SignalQuality(margin=True)
    for part in parts:
        merged.merge(part)
    assert merged.margin_noise() == quality.margin_noise()
    # A shift of every class score by the same amount moves no margin.
    shifted = SignalQuality(margin=True)
    shifted.update(pairs[0][0], pairs[0][0] + 5.0)
    assert shifted.margin_noise() == pytest.approx(0.0, abs=1e-9) and shifted.noise > 0
    ref = pairs[0][0].astype(np.float64)
    ordered = np.sort(ref, axis=1)
    assert np.allclose(top1_margins(ref), ordered[:, -1] - ordered[:, -2])
    assert np.allclose(top1_margins(ref.reshape(1, *ref.shape)), top1_margins(ref))


def test_edge_cases() -> None:
    zeros = np.zeros((2, 3), np.float32)
    exact = SignalQuality(cosine="rows", top1=True)
    exact.update(zeros, zeros)
    assert exact.sqnr_db() == math.inf and exact.cosine() == 1.0 and exact.agreement() == 1.0
    vector = SignalQuality(top1=True, margin=True)
    vector.update(np.ones(4), np.zeros(4))  # rank 1: no class axis
    assert vector.agreement() is None and vector.sqnr_db() == 0.0
    assert vector.margin_noise() is None
    with pytest.raises(ValueError, match="class axis of 2"):
        top1_margins(np.ones((3, 1)))
    assert sqnr_db(0.0, 1.0) == -math.inf
    with pytest.raises(ValueError, match="no cosine"):
        SignalQuality().cosine()
    assert np.array_equal(cosine_rows(zeros, np.ones((2, 3))), [0.0, 0.0])


def test_db_conversions_and_formats() -> None:
    assert db_from_noise_ratio(0.01) == -10.0 * math.log10(0.01)
    assert db_from_noise_ratio(0.0) == math.inf
    assert noise_ratio_from_db(20.0) == 10.0 ** (-20.0 / 10.0)
    assert noise_ratio_from_db(math.inf) == 0.0
    assert json_float(math.inf) == "inf" and json_float(-math.inf) == "-inf"
    assert format_db(17.2249) == "17.22" and format_db(math.inf) == "inf"


@pytest.mark.parametrize("cosine", ["rows", "global"])
def test_a_batch_over_the_chunk_size_is_measured_by_slices_like_a_small_one(
    monkeypatch, cosine
) -> None:
    """An LLM's logits (134M values) are read slice by slice; every measure equals the
    whole-batch one (sums to float64 rounding, counts exactly), zero rows included."""
    from qtool.metrics import signal

    rng = np.random.default_rng(7)
    reference = rng.standard_normal((3, 5, 40)).astype(np.float32)
    test = (reference + 0.05 * rng.standard_normal(reference.shape)).astype(np.float32)
    reference[1], test[1] = 0.0, 0.0  # an all-zero sample: cosine 1
    test[2, :, 3] += 9.0  # changes top-1 predictions
    measures = {"cosine": cosine, "top1": True, "peak": True, "margin": True}
    whole = SignalQuality(**measures)
    whole.update(reference, test)
    monkeypatch.setattr(signal, "CHUNK_ELEMENTS", 80)  # two rows of 40 per slice
    sliced = SignalQuality(**measures)
    sliced.update(reference, test)
    for name in ("sqnr_db", "mse", "cosine", "margin_noise"):
        assert getattr(sliced, name)() == pytest.approx(getattr(whole, name)(), rel=1e-12)
    assert (sliced.agree, sliced.predictions) == (whole.agree, whole.predictions)
    assert whole.changed() > 0
    assert (sliced.rows, sliced.elements) == (whole.rows, whole.elements)
    assert sliced.max_abs_diff == whole.max_abs_diff
