"""Write the example's text: calibration text from one source, held-out text from another.

    python examples/smollm/prepare_text.py      # -> examples/smollm/text/{calibration,heldout}.txt

Both sources come from package registries; nothing is downloaded at run time:

* calibration: the docstrings of the Python standard library this interpreter ships (module,
  class and function docstrings of 200+ characters; tests, idlelib, lib2to3, turtledemo and
  site-packages left out), read with `ast`. Technical English with code. PSF License 2.0.
* held-out: Debian's `fortunes` package (`apt-get install fortunes`): quotations, jokes, poems
  and definitions. Another source and another register. BSD licence; `ascii-art` and
  `translate-me` left out.

Each source is split by document (60 / 20 / 20 % calibration / tuning / test, shuffled with seed
20261204) and a part is written as its documents joined by a blank line: the sets, seed and
joining of benchmarks/llm_text.py, so qtool's windows of heldout.txt are the LLM benchmark's
held-out windows, in stream order. The files record nothing else; the script prints their
sha256, which the benchmark's report records too.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sysconfig
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 20261204
FRACTIONS = (0.6, 0.2, 0.2)  # calibration, tuning, test
FORTUNES = Path("/usr/share/games/fortunes")
_FORTUNES_LEFT_OUT = {"ascii-art", "translate-me"}
_STDLIB_LEFT_OUT = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages"}
_MIN_DOCSTRING = 200
_OVERSTRIKE = re.compile(r".\x08")  # "x\bx" and "_\bx" of old fortune files
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def python_docstrings() -> list[str]:
    """Docstrings (>= 200 characters) of the standard library, in file and line order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if _STDLIB_LEFT_OUT & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= _MIN_DOCSTRING:
                docs.append(doc)
    return docs


def fortunes() -> list[str]:
    """Every fortune (files split on lines of "%"), in file order."""
    if not FORTUNES.is_dir():
        raise SystemExit(f"no {FORTUNES}: apt-get install fortunes (the held-out text)")
    docs: list[str] = []
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix in (".dat", ".u8") or path.name in _FORTUNES_LEFT_OUT or path.is_dir():
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        text = _CONTROL.sub("", _OVERSTRIKE.sub("", raw))
        docs += [d.strip() for d in re.split(r"^%$", text, flags=re.M) if d.strip()]
    return docs


def part(docs: list[str], index: int) -> list[str]:
    """Part `index` (0 calibration, 1 tuning, 2 test) of the documents shuffled with SEED."""
    order = np.random.default_rng(SEED).permutation(len(docs))
    cuts = np.cumsum([0, *(round(f * len(docs)) for f in FRACTIONS[:-1]), 0])
    cuts[-1] = len(docs)
    return [docs[i] for i in order[cuts[index] : cuts[index + 1]]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "text", help="folder to write")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs in (
        ("calibration", part(python_docstrings(), 0)),
        ("heldout", part(fortunes(), 2)),
    ):
        text = "\n\n".join(d.strip() for d in docs if d.strip())
        path = args.out / f"{name}.txt"
        path.write_bytes(text.encode("utf-8"))
        digest = hashlib.sha256(text.encode()).hexdigest()
        print(f"{path}: {len(docs)} documents, {len(text)} characters, sha256 {digest}")


if __name__ == "__main__":
    main()
