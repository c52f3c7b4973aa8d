"""Data entry points for the ocr_cls example: text-line crops of a real page, upright and 180.

The page is scikit-image's `page.png` (a photographed book page, 384 x 191, seven text lines);
`fetch.py` reads it out of the scikit-image wheel. Each text line (LINES: row bands measured on
that image) is cut into windows of width ASPECTS x the line's height, one every line-height
pixels, and every window is given twice: as it is (label 0, "0 degrees") and turned by 180
degrees (label 1, "180"), the two classes of the model. Labels are therefore real, not a model's
guess. Lines 0, 2, 4, 6 go to evaluation and lines 1, 3, 5 to calibration, so no pixel of an
evaluation crop is ever seen by calibration.

Preprocessing is the model's own (rapidocr's ch_ppocr_cls/text_cls.py `resize_norm_img`): resize
to height 48 keeping the aspect ratio (width at most 192), scale to [-1, 1], pad the right with
zeros to 3 x 48 x 192. The gray page is repeated over the three channels. Pillow's bilinear
resize stands in for OpenCV's (almost all crops are enlarged, where the two agree closely).
This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

PAGE = Path(__file__).resolve().parent / "fetched" / "page.png"
INPUT = "x"
HEIGHT, WIDTH = 48, 192
# (top, bottom) rows of the seven text lines of page.png: the title, five lines of body text and
# the line of code at the bottom (found from the row profile of dark pixels).
LINES = ((11, 38), (48, 64), (64, 82), (83, 100), (100, 118), (118, 136), (170, 191))
ASPECTS = (2, 3, 4, 6, 10)  # window width / line height; 4 fills the model's 48 x 192 exactly
EVALUATION_LINES = (0, 2, 4, 6)
BATCH_SIZE = 32


def load_page() -> np.ndarray:
    """page.png as uint8 gray [191, 384]; a clear error when fetch.py has not been run."""
    from PIL import Image

    if not PAGE.is_file():
        raise FileNotFoundError(f"{PAGE}: not found; run `python examples/ocr_cls/fetch.py` once")
    with Image.open(PAGE) as image:
        return np.asarray(image.convert("L"))


def normalize(crop: np.ndarray) -> np.ndarray:
    """One gray crop [h, w] uint8 -> the model's input [3, 48, 192] float32 (text_cls.py)."""
    from PIL import Image

    height, width = crop.shape
    resized_width = min(WIDTH, math.ceil(HEIGHT * width / height))
    image = Image.fromarray(crop).resize((resized_width, HEIGHT), Image.BILINEAR)
    resized = (np.asarray(image, dtype=np.float32) / 255.0 - 0.5) / 0.5
    padded = np.zeros((3, HEIGHT, WIDTH), dtype=np.float32)
    padded[:, :, :resized_width] = resized[None]
    return padded


def line_crops(page: np.ndarray, line: int) -> Iterator[np.ndarray]:
    """The windows of one text line, by aspect then left to right."""
    top, bottom = LINES[line]
    band = page[top:bottom]
    height = bottom - top
    for aspect in ASPECTS:
        width = min(aspect * height, band.shape[1])
        for left in range(0, band.shape[1] - width + 1, height):
            yield band[:, left : left + width]


def samples(lines: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [N, 3, 48, 192] float32, labels [N] int64) for the crops of `lines`."""
    page = load_page()
    inputs, labels = [], []
    for line in lines:
        for crop in line_crops(page, line):
            inputs += [normalize(crop), normalize(np.ascontiguousarray(crop[::-1, ::-1]))]
            labels += [0, 1]
    return np.stack(inputs), np.array(labels, dtype=np.int64)


def calibration_lines() -> tuple[int, ...]:
    return tuple(i for i in range(len(LINES)) if i not in EVALUATION_LINES)


def calibration_batches() -> Iterator[dict[str, np.ndarray]]:
    """Crops of lines 1, 3, 5 (both orientations) as {"x": [B, 3, 48, 192]} batches."""
    inputs, _ = samples(calibration_lines())
    for start in range(0, len(inputs), BATCH_SIZE):
        yield {INPUT: inputs[start : start + BATCH_SIZE]}


def evaluation_batches() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Crops of lines 0, 2, 4, 6 (both orientations) with their labels (0 upright, 1 turned)."""
    inputs, labels = samples(EVALUATION_LINES)
    for start in range(0, len(inputs), BATCH_SIZE):
        stop = start + BATCH_SIZE
        yield {INPUT: inputs[start:stop]}, labels[start:stop]
