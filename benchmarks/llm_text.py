"""Text for the LLM benchmark: calibration, tuning and held-out windows from two unrelated
sources, both installed from package registries (nothing is downloaded at run time).

* `python-docstrings` (calibration and tuning): the docstrings of the Python standard library
  the interpreter ships (every module, class and function docstring of 200+ characters under
  `sysconfig.get_paths()["stdlib"]`, tests, idlelib, lib2to3, turtledemo and site-packages left
  out), read with `ast` (no module is imported). Technical English with code. PSF License 2.0.
  It depends on the interpreter's version (this machine: CPython 3.11.7), so every run records
  the sha256 of the text it used.
* `fortunes` (held-out): Debian's `fortunes` package (`apt-get install fortunes`;
  /usr/share/games/fortunes): 15k quotations, jokes, poems and definitions from literature,
  science, politics, computing... Conversational and literary English, another source and
  another register than the calibration text. BSD licence (Debian's fortune-mod copyright); the
  `ascii-art` file (drawings) and `translate-me` are left out.

Every source is split by DOCUMENT (a docstring, a fortune) into calibration / tuning / test parts
(60 / 20 / 20 % of its documents, shuffled with a fixed seed), so no document is in two parts.
The benchmark calibrates on `python-docstrings`' calibration part, tunes (e.g. qtool's --auto
perplexity budget) on its tuning part, and reports perplexity on `fortunes`' test part only: the
held-out numbers come from text that neither calibration nor tuning has seen, from another source.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.llm_models import split_windows, tokenize

PARTS = ("calibration", "tuning", "test")
FRACTIONS = (0.6, 0.2, 0.2)
SEED = 20261204
FORTUNES = Path("/usr/share/games/fortunes")
_FORTUNES_LEFT_OUT = {"ascii-art", "translate-me"}
_STDLIB_LEFT_OUT = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages"}
_MIN_DOCSTRING = 200
# overstrike sequences ("x\bx", "_\bx") of old fortune files, and other control characters
_OVERSTRIKE = re.compile(r".\x08")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclasses.dataclass(frozen=True)
class TextSource:
    """A text source: where it comes from, its licence, and how to read it as documents."""

    name: str
    origin: str
    license: str
    install: str
    read: Callable[[], list[str]]


def python_docstrings(root: Path | None = None) -> list[str]:
    """Docstrings (>= 200 characters) of the standard library's modules, classes and functions,
    in file and line order. Files that do not parse (none in CPython 3.11) are skipped by name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"no standard library at {root}")
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if _STDLIB_LEFT_OUT & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # e.g. lib2to3 test data written in Python 2 (left out above anyway)
        nodes = [tree] + [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= _MIN_DOCSTRING:
                docs.append(doc)
    if not docs:
        raise FileNotFoundError(f"no docstrings found under {root}")
    return docs


def fortunes(root: Path = FORTUNES) -> list[str]:
    """Every fortune of Debian's `fortunes` package (files split on lines of "%"), in file order.
    FileNotFoundError with the install command when the package is missing."""
    if not root.is_dir():
        raise FileNotFoundError(f"no {root}: apt-get install fortunes (the held-out text)")
    docs: list[str] = []
    for path in sorted(root.iterdir()):
        if path.suffix in (".dat", ".u8") or path.name in _FORTUNES_LEFT_OUT or path.is_dir():
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        text = _CONTROL.sub("", _OVERSTRIKE.sub("", raw))
        docs += [d.strip() for d in re.split(r"^%$", text, flags=re.M) if d.strip()]
    if not docs:
        raise FileNotFoundError(f"{root} has no fortune files: apt-get install fortunes")
    return docs


SOURCES: dict[str, TextSource] = {
    s.name: s
    for s in (
        TextSource(
            "python-docstrings",
            "docstrings of the CPython standard library this interpreter ships",
            "PSF-2.0",
            "(comes with Python)",
            python_docstrings,
        ),
        TextSource(
            "fortunes",
            "Debian package `fortunes` (/usr/share/games/fortunes)",
            "BSD (fortune-mod)",
            "apt-get install fortunes",
            fortunes,
        ),
    )
}
# The held-out draw (pick_windows) that reports, at the reporting count HELDOUT_WINDOWS: draws 0
# and 1 have informed choices (int4-mixed-llm's fallback share was chosen on draw 0, then
# re-chosen on draws 0 and 1 pooled), so a figure read off them would be read off its own tuning
# rows. Draws are disjoint only among picks of the same count, hence one count for both scripts.
REPORT_DRAW = 2
HELDOUT_WINDOWS = 16
# which source and part each set is drawn from
SETS = {
    "calibration": ("python-docstrings", "calibration"),
    "tuning": ("python-docstrings", "tuning"),
    "heldout": ("fortunes", "test"),
}


def split_documents(
    docs: list[str], seed: int = SEED, fractions: tuple[float, ...] = FRACTIONS
) -> dict[str, list[str]]:
    """The documents shuffled with `seed` and cut into PARTS by `fractions` (disjoint, every
    document in exactly one part, each part in shuffled order)."""
    if len(fractions) != len(PARTS) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be {len(PARTS)} numbers summing to 1, got {fractions}")
    order = np.random.default_rng(seed).permutation(len(docs))
    cuts = np.cumsum([0, *(round(f * len(docs)) for f in fractions[:-1]), 0])
    cuts[-1] = len(docs)
    return {part: [docs[i] for i in order[cuts[k] : cuts[k + 1]]] for k, part in enumerate(PARTS)}


def text_sets(seed: int = SEED) -> dict[str, dict[str, Any]]:
    """Every set in SETS: its source, part, documents and the sha256 of their text."""
    cache: dict[str, dict[str, list[str]]] = {}
    result: dict[str, dict[str, Any]] = {}
    for name, (source, part) in SETS.items():
        if source not in cache:
            cache[source] = split_documents(SOURCES[source].read(), seed)
        docs = cache[source][part]
        digest = hashlib.sha256("\n\n".join(docs).encode()).hexdigest()
        result[name] = {
            "source": source,
            "part": part,
            "documents": docs,
            "characters": sum(len(d) for d in docs),
            "sha256": digest,
            "license": SOURCES[source].license,
        }
    return result


def pick_windows(
    windows: np.ndarray, count: int | None, seed: int = SEED, draw: int = 0
) -> np.ndarray:
    """`count` of the windows, chosen with `seed` and kept in stream order (all when None or
    when there are fewer). ValueError when the text gives no window at all.

    `draw` k > 0 picks `count` windows none of the draws before it picked (seed + k among the
    rest): a fresh held-out sample once draw 0 has been looked at so often that choices were
    made with it in view, so the figures a README reports come from windows no choice has seen.
    ValueError when the text has too few windows left for that draw."""
    if len(windows) == 0:
        raise ValueError("the text is shorter than one window")
    if draw < 0:
        raise ValueError(f"draw must be >= 0, got {draw}")
    if count is None and draw:
        raise ValueError("a draw other than 0 needs a window count")
    if count is None or (draw == 0 and count >= len(windows)):
        return windows
    left = np.arange(len(windows))
    for k in range(draw + 1):
        if count > len(left):
            raise ValueError(
                f"draw {draw} needs {count} windows from {len(left)} left "
                f"after {k} draws of {count} (the text gives {len(windows)})"
            )
        chosen = np.sort(np.random.default_rng(seed + k).choice(left, count, replace=False))
        left = np.setdiff1d(left, chosen)
    return windows[chosen]


def window_sets(
    tokenizer: Any,
    length: int,
    counts: dict[str, int | None],
    bos: int | None = None,
    seed: int = SEED,
    sets: dict[str, dict[str, Any]] | None = None,
    draws: dict[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Token windows of each set named in `counts` ({set: how many windows, None = all}) with the
    model's own tokenizer: {set: {"windows": int64 [n, length], "available": how many the text
    gave, "draw": which pick_windows draw, plus the set's source, part, sha256}}. `draws`
    ({set: k}, 0 when absent) names a later draw of a set (pick_windows)."""
    sets = sets or text_sets(seed)
    result: dict[str, dict[str, Any]] = {}
    for name, count in counts.items():
        info = sets[name]
        windows = split_windows(tokenize(tokenizer, info["documents"]), length, bos)
        draw = (draws or {}).get(name, 0)
        picked = pick_windows(windows, count, seed, draw)
        meta = {k: v for k, v in info.items() if k != "documents"}
        result[name] = {**meta, "windows": picked, "available": len(windows), "draw": draw}
    return result
