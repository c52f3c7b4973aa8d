"""Held-out texts for the MiniLM case of benchmarks/heldout.py: sentences of other domains than
examples/minilm/sentences.txt (everyday English written for the example), read from what this
machine already has installed, so nothing is downloaded and the set is the same on every
machine with the same packages:

- `python-docs`: the docstrings of a fixed list of standard-library modules (module, class and
  function docstrings, parsed with `ast` from the interpreter's own sources: technical prose);
- `licenses`: the license texts under /usr/share/common-licenses (legal prose; Debian and Ubuntu
  ship them with `base-files`);
- `sklearn-descr`: scikit-learn's dataset descriptions (`sklearn/datasets/descr/*.rst`:
  scientific prose about measurements, species, census data).

A fourth source, `fortunes` (Debian's `fortunes` package under /usr/share/games/fortunes:
quotations, jokes, poems), is no held-out source: it is the separate `tuning.data` of the rows
that name one (`tuning_sentences`), so that a tool's choices are scored on a domain that is
neither the calibration text nor any text the figures are reported on.

Each source is cut into sentences (whitespace collapsed, split after . ! ?), filtered to prose
(40-400 characters, at least 6 words, mostly letters, no reStructuredText markup lines),
deduplicated in order, and `per_source` sentences are taken evenly spread over the source. A
source that is missing on this machine is an error naming it, never a silently smaller set.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
FORTUNES = Path("/usr/share/games/fortunes")
# Standard-library modules whose docstrings are read (pure-Python files present in every
# CPython 3.11+ install); order fixed so the set never depends on the file system's.
STDLIB_MODULES = (
    "argparse",
    "calendar",
    "collections/__init__",
    "contextlib",
    "csv",
    "dataclasses",
    "decimal",
    "difflib",
    "email/message",
    "fractions",
    "functools",
    "gzip",
    "heapq",
    "http/client",
    "inspect",
    "json/__init__",
    "logging/__init__",
    "pathlib",
    "pickle",
    "random",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "zipfile",
)
SOURCES = ("python-docs", "licenses", "sklearn-descr")
MIN_CHARS, MAX_CHARS, MIN_WORDS = 40, 400, 6
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


def _docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one source file, in file order."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text:
                yield text


def python_docs() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            raise FileNotFoundError(f"python-docs: {path} not found")
        texts.extend(_docstrings(path))
    return texts


def licenses() -> list[str]:
    if not LICENSES.is_dir():
        raise FileNotFoundError(f"licenses: {LICENSES} not found (Debian/Ubuntu base-files)")
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"licenses: no license file under {LICENSES}")
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def sklearn_descr() -> list[str]:
    import sklearn.datasets

    folder = Path(sklearn.datasets.__file__).parent / "descr"
    files = sorted(folder.glob("*.rst"))
    if not files:
        raise FileNotFoundError(f"sklearn-descr: no .rst under {folder}")
    return [p.read_text(encoding="utf-8") for p in files]


def fortunes() -> list[str]:
    """Every fortune file's text (the `%` separators become paragraph breaks), in name order."""
    if not FORTUNES.is_dir():
        raise FileNotFoundError(f"fortunes: {FORTUNES} not found (apt-get install fortunes)")
    files = sorted(
        p for p in FORTUNES.iterdir() if p.is_file() and not p.is_symlink() and not p.suffix
    )
    if not files:
        raise FileNotFoundError(f"fortunes: no fortune file under {FORTUNES}")
    texts = []
    for path in files:
        raw = path.read_text(encoding="utf-8", errors="replace")
        texts.append(re.sub(r"^%$", "", raw, flags=re.M))
    return texts


def _prose_lines(text: str) -> str:
    """The text without reStructuredText markup lines (titles' underlines, tables, fields,
    directives, literal blocks' markers) that would glue into non-sentences."""
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith((":", "..", "=", "-", "|", "*", "+", ">>>")):
            kept.append("")
            continue
        kept.append(stripped)
    return "\n".join(kept)


def sentences(text: str) -> list[str]:
    """Prose sentences of `text`: paragraphs joined, split after sentence ends, filtered."""
    out = []
    for paragraph in re.split(r"\n\s*\n", _prose_lines(text)):
        flat = " ".join(paragraph.split())
        for sentence in _SPLIT.split(flat):
            letters = sum(c.isalpha() for c in sentence)
            if not MIN_CHARS <= len(sentence) <= MAX_CHARS:
                continue
            if len(sentence.split()) < MIN_WORDS or letters < 0.7 * len(sentence):
                continue
            out.append(sentence)
    return out


_READERS = {
    "python-docs": python_docs,
    "licenses": licenses,
    "sklearn-descr": sklearn_descr,
    "fortunes": fortunes,
}


def source_sentences(source: str, per_source: int) -> list[str]:
    """`per_source` sentences of one source, deduplicated, spread evenly over it."""
    seen: dict[str, None] = {}
    for text in _READERS[source]():
        for sentence in sentences(text):
            seen.setdefault(sentence)
    unique = list(seen)
    if len(unique) < per_source:
        raise ValueError(f"{source}: only {len(unique)} sentences, {per_source} asked for")
    step = len(unique) / per_source
    return [unique[int(i * step)] for i in range(per_source)]


def heldout_sentences(per_source: int = 96) -> dict[str, list[str]]:
    """Source name -> its sentences, for every source."""
    return {source: source_sentences(source, per_source) for source in SOURCES}


def tuning_sentences(count: int = 128) -> list[str]:
    """The tuning source's sentences (fortunes), spread evenly over it."""
    return source_sentences("fortunes", count)
