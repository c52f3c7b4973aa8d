"""Text files as windows of a model's own tokens, with the next tokens as labels.

A decoder LLM is calibrated and evaluated on text, not on arrays: the text is cut into windows
of the tokens its own tokenizer makes (a `tokenizer.json` of the Hugging Face `tokenizers`
format, the file every model folder saved by transformers holds), and every model input is
filled the way a prefill from an empty cache fills it: `input_ids` the window, `attention_mask`
ones, `position_ids` 0..N-1, each KV-cache input an empty past. The labels are the next token of
every position, so evaluate can score perplexity; a position with nothing to predict (the last of
each window, or one whose target an earlier overlapping window already scored) is IGNORE_LABEL.

The files are one token stream, each tokenized whole in the order given (no separator token
between them), and nothing depends on anything but the files, the tokenizer and the settings:
the same text gives the same windows on every machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qtool.data.spec import InputSpec, TextSource
from qtool.errors import DataError

# A label that marks a position with nothing to predict (PyTorch's cross-entropy ignore_index).
IGNORE_LABEL = -100
# Names of KV-cache inputs (Optimum / ONNX Runtime GenAI and older exports).
KV_PREFIXES = ("past_key_values.", "past.")
FILLED = "input_ids, attention_mask, position_ids and KV-cache inputs (past_key_values.*, past.*)"
_INTEGER = ("int64", "int32")
_CHUNK = 64  # windows per chunk handed to the re-batcher


def input_role(name: str) -> str | None:
    """What the text source feeds input `name`: 'tokens', 'mask', 'positions', 'past' or None."""
    if name == "input_ids":
        return "tokens"
    if name == "attention_mask":
        return "mask"
    if name == "position_ids":
        return "positions"
    if name.startswith(KV_PREFIXES):
        return "past"
    return None


def inputs_problem(inputs: Iterable[InputSpec], window: int) -> str | None:
    """Why a text source of `window` tokens cannot fill `inputs`, or None; shared by the recipe
    reader (an error at load time, naming the recipe key) and the reader below."""
    inputs = tuple(inputs)
    if not any(spec.name == "input_ids" for spec in inputs):
        names = ", ".join(spec.name for spec in inputs)
        return f"a text source feeds 'input_ids', which the model's inputs lack ({names})"
    for spec in inputs:
        role = input_role(spec.name)
        shape = list(spec.shape)
        if role is None:
            return f"cannot fill input {spec.name!r}: a text source fills {FILLED}"
        if role == "past":
            if not any(dim == 0 for dim in spec.shape[1:]):
                return (
                    f"input {spec.name!r} {shape}: a text source feeds an empty past; declare "
                    "its past axis as 0 (e.g. [1, 3, 0, 64])"
                )
            if not spec.dtype.startswith("float"):
                return f"input {spec.name!r} is {spec.dtype}: a KV-cache input must be float"
            continue
        if spec.dtype not in _INTEGER:
            return f"input {spec.name!r} is {spec.dtype}: it must be int64 or int32"
        if len(spec.shape) != 2 or spec.shape[1] != window:
            what = "past + sequence, with no past" if role == "mask" else "sequence"
            return (
                f"input {spec.name!r} {shape} must be [batch, {window}] for windows of {window} "
                f"tokens (its second axis is the {what})"
            )
    return None


def tokenizer_file(path: Path) -> Path | None:
    """The tokenizer.json that `path` names: the file itself, or the one inside the folder."""
    if path.is_dir():
        inside = path / "tokenizer.json"
        return inside if inside.is_file() else None
    return path if path.is_file() else None


def text_chunks(
    source: TextSource, inputs: tuple[InputSpec, ...], where: str
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(arrays by input name, labels) of up to _CHUNK windows at a time: every input filled,
    the labels the next tokens ([windows, window] int64)."""
    problem = inputs_problem(inputs, source.window)
    if problem is not None:
        raise DataError(f"{where}.text: {problem}")
    tokenizer = load_tokenizer(source.tokenizer, where)
    bos = bos_id(tokenizer, source, where)
    counter = _Counter()
    stream = _token_stream(source.files, tokenizer, counter)
    windows = _windows(stream, source.body, source.step, source.max_windows)
    labeller = _Labeller(source.window, bos is not None)
    produced = 0
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    for start, body in windows:
        ids = body if bos is None else np.concatenate([np.asarray([bos], np.int64), body])
        pending.append((ids, labeller.labels(start, ids)))
        produced += 1
        if len(pending) == _CHUNK:
            yield _batch(pending, inputs)
            pending = []
    if pending:
        yield _batch(pending, inputs)
    if produced == 0:
        raise DataError(
            f"{where}.text: the text has {counter.tokens} tokens, fewer than one window of "
            f"{source.body}"
        )


def load_tokenizer(path: Path, where: str) -> Any:
    """The `tokenizers` Tokenizer of a tokenizer.json; DataError when it cannot be read."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            f"{where}.text: reading text needs the tokenizers package: pip install 'qtool[text]'"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for any bad file
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise DataError(f"{path}: not a readable tokenizer.json ({reason})") from None


def bos_id(tokenizer: Any, source: TextSource, where: str) -> int | None:
    """The id each window starts with: none, the BOS of tokenizer_config.json, or the token
    named in the recipe."""
    if source.bos is False:
        return None
    token = source.bos if isinstance(source.bos, str) else _configured_bos(source.tokenizer)
    if token is None:
        config = source.tokenizer.parent / "tokenizer_config.json"
        raise DataError(
            f"{where}.text.bos: true needs the BOS token, but {config} names none; give the "
            'token itself (bos: "<s>")'
        )
    found = tokenizer.token_to_id(token)
    if found is None:
        raise DataError(f"{where}.text.bos: {source.tokenizer} has no token {token!r}")
    return int(found)


def _configured_bos(tokenizer: Path) -> str | None:
    """`bos_token` of the tokenizer_config.json beside the tokenizer (a string, or a mapping
    with its `content` in older files); None when there is none."""
    config = tokenizer.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{config}: not readable JSON ({exc})") from None
    token = data.get("bos_token") if isinstance(data, dict) else None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


class _Counter:
    """Tokens the stream has produced, for the 'shorter than one window' message."""

    def __init__(self) -> None:
        self.tokens = 0


def _token_stream(files: tuple[Path, ...], tokenizer: Any, counter: _Counter) -> Iterator:
    """Each file's tokens (no special tokens), file by file: a file is read only when the
    windows before it did not reach max_windows."""
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        counter.tokens += len(ids)
        yield ids


def _windows(
    stream: Iterator[np.ndarray], body: int, step: int, limit: int | None
) -> Iterator[tuple[int, np.ndarray]]:
    """(start, tokens[start:start + body]) over the stream, a window every `step` tokens; the
    incomplete tail is dropped. Only the tokens of windows still to come are kept."""
    buffer = np.zeros(0, np.int64)
    offset = 0  # stream index of buffer[0]
    start = 0
    count = 0
    if limit is not None and limit < 1:
        return
    for ids in stream:
        buffer = np.concatenate([buffer, ids])
        while start + body <= offset + len(buffer):
            yield start, buffer[start - offset : start - offset + body].copy()
            count += 1
            if limit is not None and count >= limit:
                return  # before the next file is read
            start += step
        if start > offset:  # drop what no later window reads
            cut = min(start - offset, len(buffer))
            buffer, offset = buffer[cut:], offset + cut


class _Labeller:
    """Next-token labels of each window; a target an earlier (overlapping) window already
    scored is IGNORE_LABEL, so every text token counts once in the perplexity."""

    def __init__(self, window: int, bos: bool) -> None:
        # stream index of the token position p predicts: with a BOS first, position 0 predicts
        # the window's first text token
        self.shift = 0 if bos else 1
        self.positions = np.arange(window - 1)
        self.scored_until = 0  # every target before this stream index has been scored

    def labels(self, start: int, ids: np.ndarray) -> np.ndarray:
        labels = np.full(len(ids), IGNORE_LABEL, np.int64)
        labels[:-1] = ids[1:]
        targets = start + self.shift + self.positions
        labels[:-1][targets < self.scored_until] = IGNORE_LABEL
        self.scored_until = max(self.scored_until, int(targets[-1]) + 1)
        return labels


def _batch(
    windows: list[tuple[np.ndarray, np.ndarray]], inputs: tuple[InputSpec, ...]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    ids = np.stack([w[0] for w in windows])
    labels = np.stack([w[1] for w in windows])
    count, window = ids.shape
    arrays: dict[str, np.ndarray] = {}
    for spec in inputs:
        role = input_role(spec.name)
        dtype = np.dtype(spec.dtype)
        if role == "tokens":
            arrays[spec.name] = ids.astype(dtype)
        elif role == "mask":
            arrays[spec.name] = np.ones((count, window), dtype)
        elif role == "positions":
            arrays[spec.name] = np.broadcast_to(np.arange(window, dtype=dtype), ids.shape).copy()
        else:  # past: empty, of the declared shape (inputs_problem checked its 0 axis)
            arrays[spec.name] = np.zeros((count, *spec.shape[1:]), dtype)
    return arrays, labels
