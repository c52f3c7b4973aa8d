"""Data entry points for the effnet_lite example: crops of real photographs that ship in wheels.

Images: the natural colour images bundled inside the scikit-image wheel (`skimage/data/`, what
`skimage.data.<name>()` returns without a download) and scikit-learn's two sample images
(`sklearn/datasets/images/`). They are read straight from the installed packages' folders.
Disjoint images: CALIBRATION_IMAGES feed calibration, EVALUATION_IMAGES evaluation; no image (and
no scene: both motorcycle views are on the evaluation side) is on both.

Crops (deterministic): per image, the central square (scale 1.0) and a 3 x 3 grid of squares of
SCALES 0.7 and 0.5 of the short side, each also mirrored left-right: 38 crops per image. Each
square is resized to 224 x 224 (Pillow, bicubic, as TensorFlow's EfficientNet evaluation does)
and normalised as the EfficientNet-Lite models were trained (the official TF builder's
MEAN_RGB = 127, STDDEV_RGB = 128: (x - 127) / 128, RGB, channels first). No labels exist: the
metric is top-1 agreement with the FP32 model (`qtool evaluate` without labels).
This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

INPUT = "input"
SIZE = 224
MEAN, STD = 127.0, 128.0  # efficientnet/lite/efficientnet_lite_builder.py: MEAN_RGB, STDDEV_RGB
SCALES = (0.7, 0.5)  # 3 x 3 grid of squares at each, plus the whole central square
GRID = 3
BATCH_SIZE = 16
# (package, file): the package's data folder is found from the installed module.
CALIBRATION_IMAGES = (
    ("skimage", "astronaut.png"),
    ("skimage", "coffee.png"),
    ("skimage", "rocket.jpg"),
    ("skimage", "hubble_deep_field.jpg"),
    ("skimage", "grass.png"),
    ("skimage", "brick.png"),
    ("skimage", "color.png"),
    ("sklearn", "china.jpg"),
)
EVALUATION_IMAGES = (
    ("skimage", "chelsea.png"),
    ("skimage", "motorcycle_left.png"),
    ("skimage", "motorcycle_right.png"),
    ("skimage", "retina.jpg"),
    ("skimage", "ihc.png"),
    ("skimage", "gravel.png"),
    ("skimage", "logo.png"),
    ("sklearn", "flower.jpg"),
)


def image_path(package: str, name: str) -> Path:
    """Where the installed wheel keeps the image (no download: the file is in the package)."""
    if package == "skimage":
        import skimage

        return Path(skimage.__file__).resolve().parent / "data" / name
    if package == "sklearn":
        import sklearn

        return Path(sklearn.__file__).resolve().parent / "datasets" / "images" / name
    raise ValueError(f"unknown image package {package!r}")


def load_image(package: str, name: str) -> np.ndarray:
    """The image as uint8 RGB [H, W, 3] (gray and RGBA images converted by Pillow)."""
    from PIL import Image

    path = image_path(package, name)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; install qtool[effnet] (scikit-image, -learn)")
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def boxes(height: int, width: int) -> list[tuple[int, int, int]]:
    """(top, left, side) of every square crop: the central one, then each scale's grid."""
    short = min(height, width)
    out = [((height - short) // 2, (width - short) // 2, short)]
    for scale in SCALES:
        side = int(round(scale * short))
        for row in range(GRID):
            for col in range(GRID):
                top = (height - side) * row // (GRID - 1)
                left = (width - side) * col // (GRID - 1)
                out.append((top, left, side))
    return out


def normalize(crop: np.ndarray) -> np.ndarray:
    """One uint8 RGB crop [h, w, 3] -> the model's input [3, 224, 224] float32."""
    from PIL import Image

    resized = Image.fromarray(crop).resize((SIZE, SIZE), Image.BICUBIC)
    scaled = (np.asarray(resized, dtype=np.float32) - MEAN) / STD
    return np.ascontiguousarray(scaled.transpose(2, 0, 1))


def image_crops(image: np.ndarray) -> Iterator[np.ndarray]:
    """The model inputs of one image: each box as it is, then mirrored left-right."""
    for top, left, side in boxes(*image.shape[:2]):
        crop = image[top : top + side, left : left + side]
        yield normalize(crop)
        yield normalize(np.ascontiguousarray(crop[:, ::-1]))


def samples(images: tuple[tuple[str, str], ...]) -> np.ndarray:
    """Inputs [N, 3, 224, 224] float32 for every crop of `images`, image by image."""
    return np.stack([x for image in images for x in image_crops(load_image(*image))])


def _batches(images: tuple[tuple[str, str], ...]) -> Iterator[np.ndarray]:
    """Batches of BATCH_SIZE crops, one image decoded at a time (bounded memory)."""
    pending: list[np.ndarray] = []
    for image in images:
        pending.extend(image_crops(load_image(*image)))
        while len(pending) >= BATCH_SIZE:
            yield np.stack(pending[:BATCH_SIZE])
            pending = pending[BATCH_SIZE:]
    if pending:
        yield np.stack(pending)


def calibration_batches() -> Iterator[dict[str, np.ndarray]]:
    """Crops of CALIBRATION_IMAGES as {"input": [B, 3, 224, 224]} batches."""
    for batch in _batches(CALIBRATION_IMAGES):
        yield {INPUT: batch}


def evaluation_batches() -> Iterator[dict[str, np.ndarray]]:
    """Crops of EVALUATION_IMAGES (no labels: agreement with FP32 is the metric)."""
    for batch in _batches(EVALUATION_IMAGES):
        yield {INPUT: batch}
