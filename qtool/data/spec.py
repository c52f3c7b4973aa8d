"""What a data source is, as the recipe describes it: model inputs and where samples come from.

These are the data stage's typed inputs. The recipe loader (qtool/config) builds them; the batch
readers (qtool/data/batches.py) and everything downstream read them, never the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

INPUT_DTYPES = ("float32", "float16", "int64", "int32", "bool")

IMAGE_MODES = ("L", "RGB")


@dataclass(frozen=True)
class InputSpec:
    """One model input: its shape (first dim is the batch) and dtype.

    A recipe gives every dim as an integer. Shapes read from a model file (`qtool evaluate
    --data`) keep a symbolic dim as its name (str) or None, and data of any size fits it there.
    """

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class ImageFolder:
    """An image folder with the preprocessing that turns each file into one model input sample."""

    dir: Path
    input: str
    size: tuple[int, int]
    mode: str = "RGB"
    scale: float = 255.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()


@dataclass(frozen=True)
class TextSource:
    """Text files read as windows of a model's own tokens, with the next tokens as labels.

    The files are one token stream, in order; window k starts `stride` tokens after window k-1.
    `stride` None means `window` (minus the BOS, with `bos`): windows that do not overlap.
    `bos`: False, True (the BOS token that tokenizer_config.json beside the tokenizer names) or
    a token string; each window then starts with that token and holds window - 1 text tokens.
    """

    files: tuple[Path, ...]
    tokenizer: Path  # a tokenizer.json (the Hugging Face `tokenizers` format)
    window: int
    stride: int | None = None
    max_windows: int | None = None
    bos: bool | str = False

    @property
    def body(self) -> int:
        """Text tokens per window: the window less its BOS token, when it starts with one."""
        return self.window - (0 if self.bos is False else 1)

    @property
    def step(self) -> int:
        """Text tokens from one window's start to the next's."""
        return self.stride if self.stride is not None else self.body


@dataclass(frozen=True)
class DataSpec:
    """Exactly one data source; the field that is set says which kind."""

    where: str  # key path in the recipe, for error messages
    npz: Path | None = None
    npy: dict[str, Path] | None = None
    labels: Path | None = None
    images: ImageFolder | None = None
    python: str | None = None  # "path/to/file.py:function" with the path resolved
    synthetic: bool = False
    samples: int = 64
    text: TextSource | None = None

    @property
    def kind(self) -> str:
        for kind in ("npz", "npy", "images", "python", "text"):
            if getattr(self, kind) is not None:
                return kind
        return "synthetic"
