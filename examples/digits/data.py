"""Data entry points for the digits example: calibration from train, evaluation from held-out.

The split is a fixed stratified 70/30 split of `sklearn.datasets.load_digits` (1,797 real 8x8
images that ship inside scikit-learn), so nothing is downloaded and calibration never sees an
evaluation image. This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from collections.abc import Iterator

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLIT_SEED = 0
TEST_FRACTION = 0.3
CALIBRATION_SAMPLES = 512
BATCH_SIZE = 100


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (x_train, x_test, y_train, y_test); x is float32 [N, 1, 8, 8] in [0, 1], y int64.

    The raw pixels are integers 0..16, hence the division by 16.
    """
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    return x_train, x_test, y_train, y_test


def calibration_batches() -> Iterator[dict[str, np.ndarray]]:
    """Yield the first CALIBRATION_SAMPLES training images as {"image": [B, 1, 8, 8]} batches."""
    x_train = load_split()[0][:CALIBRATION_SAMPLES]
    for start in range(0, len(x_train), BATCH_SIZE):
        yield {"image": x_train[start : start + BATCH_SIZE]}


def evaluation_batches() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Yield the whole held-out split as ({"image": [B, 1, 8, 8]}, labels [B]) batches."""
    _, x_test, _, y_test = load_split()
    for start in range(0, len(x_test), BATCH_SIZE):
        stop = start + BATCH_SIZE
        yield {"image": x_test[start:stop]}, y_test[start:stop]


def training_batches() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Yield the whole training split with labels (for `qtool qat`; never an evaluation image)."""
    x_train, _, y_train, _ = load_split()
    for start in range(0, len(x_train), BATCH_SIZE):
        stop = start + BATCH_SIZE
        yield {"image": x_train[start:stop]}, y_train[start:stop]
