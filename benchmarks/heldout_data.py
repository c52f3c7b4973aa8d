"""Calibration and held-out data of benchmarks/heldout.py: calibration from one source, held-out
rows from OTHER sources, so a choice that fits the calibration source is not rewarded.

- MiniLM: calibration on every line of examples/minilm/sentences.txt (everyday English written
  for the example); held-out: the sentences of benchmarks/heldout_texts.py (Python's docstrings,
  the license texts under /usr/share/common-licenses, scikit-learn's dataset descriptions).
- Swin: calibration on crops of the eight photographs examples/effnet_lite calibrates on
  (scikit-image / scikit-learn wheels); held-out: crops of its eight evaluation photographs
  (other scenes). Per image the central square and a 3 x 3 grid of squares of 0.6 of the short
  side, each also mirrored (20 crops), resized to 64 x 64, ImageNet mean/std.
- decoder: bytes are the tokens. Windows of PAST + NEW bytes: the first PAST are read by the
  float torch model (its keys/values are the past the ONNX decode step is fed), the NEW are the
  step's input ids. Calibration windows from sentences.txt, held-out windows from the held-out
  texts above.
- tuning (`*_tuning`, for the rows whose recipe names a `tuning.data`): fortunes sentences
  (heldout_texts.py) for MiniLM and the decoder, eight more scikit-image pictures for Swin:
  neither the calibration source nor any held-out one.

Recipes name the calibration functions (`python: heldout_data.py:minilm_calibration`); qtool
loads this file by path, so it puts the repository on sys.path itself.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import heldout_models as models  # noqa: E402
from benchmarks.heldout_texts import heldout_sentences, tuning_sentences  # noqa: E402

BATCH = 32
MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
DECODER_WINDOWS = 128  # per source set (calibration: sentences.txt; held-out: the texts)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _minilm_data():
    return _load(REPO / "examples" / "minilm" / "data.py", "_minilm_data")


@cache
def _effnet_data():
    return _load(REPO / "examples" / "effnet_lite" / "data.py", "_effnet_data")


def _batched(arrays: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    count = len(next(iter(arrays.values())))
    for start in range(0, count, BATCH):
        yield {name: array[start : start + BATCH] for name, array in arrays.items()}


# --------------------------------------------------------------------------- MiniLM


def minilm_tokens(sentences: list[str]) -> dict[str, np.ndarray]:
    return _minilm_data().tokenize(sentences)


def minilm_calibration() -> Iterator[dict[str, np.ndarray]]:
    """Every sentence of examples/minilm/sentences.txt (294), in file order."""
    return _batched(minilm_tokens(_minilm_data().load_sentences()))


def minilm_tuning() -> Iterator[dict[str, np.ndarray]]:
    """The separate tuning rows (`tuning.data`): 128 fortunes sentences, tokenized."""
    return _batched(minilm_tokens(tuning_sentences()))


def minilm_heldout() -> dict[str, dict[str, np.ndarray]]:
    """Source name -> its held-out sentences tokenized."""
    return {name: minilm_tokens(s) for name, s in heldout_sentences().items()}


# --------------------------------------------------------------------------- Swin


def _crops(images: tuple[tuple[str, str], ...]) -> np.ndarray:
    from PIL import Image

    data = _effnet_data()
    out = []
    for package, name in images:
        pixels = data.load_image(package, name)
        height, width = pixels.shape[:2]
        short = min(height, width)
        boxes = [((height - short) // 2, (width - short) // 2, short)]
        side = int(0.6 * short)
        for row in range(3):
            for col in range(3):
                top = row * (height - side) // 2
                left = col * (width - side) // 2
                boxes.append((top, left, side))
        for top, left, size in boxes:
            square = Image.fromarray(pixels[top : top + size, left : left + size])
            small = np.asarray(square.resize((models.IMAGE, models.IMAGE), Image.BILINEAR))
            for view in (small, small[:, ::-1]):
                out.append(view.transpose(2, 0, 1).astype(np.float32) / 255.0)
    return ((np.stack(out) - MEAN) / STD).astype(np.float32)


def swin_calibration() -> Iterator[dict[str, np.ndarray]]:
    return _batched({"pixel_values": _crops(_effnet_data().CALIBRATION_IMAGES)})


# The separate tuning rows of the Swin case: eight more scikit-image pictures, in neither the
# calibration nor the evaluation set of examples/effnet_lite (several gray, all as RGB).
TUNING_IMAGES = (
    ("skimage", "camera.png"),
    ("skimage", "coins.png"),
    ("skimage", "horse.png"),
    ("skimage", "microaneurysms.png"),
    ("skimage", "cell.png"),
    ("skimage", "chessboard_RGB.png"),
    ("skimage", "page.png"),
    ("skimage", "moon.png"),
)


def swin_tuning() -> Iterator[dict[str, np.ndarray]]:
    return _batched({"pixel_values": _crops(TUNING_IMAGES)})


def swin_heldout() -> dict[str, dict[str, np.ndarray]]:
    return {"photos": {"pixel_values": _crops(_effnet_data().EVALUATION_IMAGES)}}


# --------------------------------------------------------------------------- decoder


def _windows(text: str, count: int) -> np.ndarray:
    """`count` byte windows of PAST + NEW, evenly spread over `text`."""
    data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    span = models.PAST + models.NEW
    if len(data) < count * span:
        raise ValueError(f"{len(data)} bytes cannot make {count} windows of {span}")
    starts = np.linspace(0, len(data) - span, count).astype(np.int64)
    return np.stack([data[s : s + span] for s in starts])


@cache
def _decoder():
    return models.decoder_model()


def decoder_feeds(windows: np.ndarray) -> dict[str, np.ndarray]:
    """The decode-step inputs of every window: the past from the torch model's prefill."""
    import torch

    prefix = torch.from_numpy(windows[:, : models.PAST])
    past = models.decoder_past(_decoder(), prefix)
    names, _ = models.decoder_io()
    count = len(windows)
    feed = {
        "input_ids": windows[:, models.PAST :].copy(),
        "attention_mask": np.ones((count, models.PAST + models.NEW), np.int64),
        "position_ids": np.broadcast_to(
            np.arange(models.PAST, models.PAST + models.NEW, dtype=np.int64), (count, models.NEW)
        ).copy(),
    }
    for name, tensor in zip(names[3:], past, strict=True):
        feed[name] = tensor.numpy().astype(np.float32)
    return feed


def decoder_calibration() -> Iterator[dict[str, np.ndarray]]:
    text = "\n".join(_minilm_data().load_sentences())
    return _batched(decoder_feeds(_windows(text, DECODER_WINDOWS)))


def decoder_tuning() -> Iterator[dict[str, np.ndarray]]:
    """Windows of the fortunes (the separate tuning rows)."""
    return _batched(decoder_feeds(_windows(" ".join(tuning_sentences()), DECODER_WINDOWS // 2)))


def decoder_heldout() -> dict[str, dict[str, np.ndarray]]:
    texts = heldout_sentences()
    return {
        name: decoder_feeds(_windows(" ".join(sentences), DECODER_WINDOWS // 2))
        for name, sentences in texts.items()
    }
