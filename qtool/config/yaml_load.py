"""The YAML loader for recipes and presets: PyYAML's safe loader with every input bounded.

A recipe is a page of settings, so anything that takes more than a page's worth of work to read is
an attack or a mistake, and is refused with a one-line RecipeError naming the file and the line
(and the key path when it is known) before it can cost memory, time or a Python traceback:

- size: more than MAX_RECIPE_BYTES of text is refused unread.
- nesting: PyYAML's composer recurses once per level, so a list nested a few hundred deep used to
  end in RecursionError. The composer here counts its depth and stops at MAX_YAML_DEPTH, long
  before the interpreter's limit, whatever the input (a 100000-deep document is refused at level
  65, having recursed 64 times).
- aliases: a "billion laughs" document is cheap to parse (PyYAML shares aliased nodes) but
  expands to billions of values in anything that walks it (a repr in an error message, merging a
  preset). The composed node graph is measured, iteratively, before any Python object exists:
  the expanded value count (MAX_YAML_NODES), the depth through aliases (MAX_YAML_DEPTH) and
  aliases that contain themselves.
- integers: Python refuses to convert a decimal string of more than 4300 digits (ValueError) and
  takes quadratic time below that. No qtool setting needs more than MAX_INT_DIGITS digits, so an
  integer scalar longer than that is refused from its text, before int() sees it.
- values whose explicit tag does not fit them (`!!int abc`, `!!bool maybe`, `!!timestamp
  2021-02-30`) make PyYAML's constructors raise ValueError/KeyError/AttributeError; they are
  reported with the line instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from qtool.errors import RecipeError

# A recipe is a page of settings: anything larger, or any document whose aliases expand to more
# nodes than this, is an attack (a "billion laughs" alias bomb) or a mistake, refused before any
# walk over the parsed data (a repr, a merge) could expand it.
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
# Levels of nested lists/mappings. The deepest recipe setting is 6 levels down
# (quantization.overrides[i].weights.bits); 64 leaves room for any layout while keeping the
# composer's recursion (about 2 frames a level) far below Python's limit of 1000.
MAX_YAML_DEPTH = 64
# Decimal digits of an integer scalar. 2**31 - 1, the largest any setting takes, has 10; up to
# 100 digits int() is instant and the recipe reader's own message (`must be <= 16384`, with the
# bound) is the more useful one, so only longer numbers (a paste accident or an attack) stop here.
MAX_INT_DIGITS = 100
# Problems quoted from PyYAML may quote the input (an anchor name, a tag); one line stays short.
_MAX_PROBLEM_CHARS = 160
_MAX_LABEL_CHARS = 40
_INT_TAG = "tag:yaml.org,2002:int"
_CONSTRUCTION_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError)


def load_yaml(path: Path) -> Any:
    """Parse one YAML file with bounded size, nesting, alias expansion and integer length.

    Returns the document's Python value (None for an empty file). Every problem is a RecipeError
    of one line: `{path}: line N: [key.path: ]problem`.
    """
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"{path}: larger than {MAX_RECIPE_BYTES // 1024} KiB: not a recipe (they are a page)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    loader = None
    try:
        loader = _BoundedLoader(text, path)  # its reader refuses control characters up front
        root = loader.get_single_node()
        if root is None:
            return None
        loader.check_graph(root)
        return loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: {_where(exc, text)}: malformed YAML: {_problem(exc)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _where(exc: yaml.YAMLError, text: str) -> str:
    """`line N` of a PyYAML error: its problem mark, or for a reader error (a control character)
    the line of the character's position."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}"
    position = getattr(exc, "position", None)
    if isinstance(position, int):
        return f"line {text.count(chr(10), 0, position) + 1}"
    return "YAML"


def _problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).strip() or type(exc).__name__
    return _clip(problem.splitlines()[0], _MAX_PROBLEM_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _label(key: Node) -> str:
    """A mapping key as it appears in a key path: its text, shortened; '?' for a key that is
    itself a list or mapping."""
    if not isinstance(key, ScalarNode):
        return "?"
    text = key.value
    if not text.isprintable():
        text = repr(text)[1:-1]
    return _clip(text, _MAX_LABEL_CHARS)


def _int_digits(text: str) -> int:
    """An upper bound on the decimal digits of the integer PyYAML would make of `text`, computed
    from the text alone (PyYAML's construct_yaml_int: underscores dropped, 0b/0x/0 prefixes,
    and base-60 `a:b:c`)."""
    value = text.replace("_", "").strip().lstrip("+-")
    if ":" in value:  # a * 60**k + ...: every later part adds < 2 digits, a carry at most one
        parts = value.split(":")
        return sum(len(part) for part in parts) + 2 * len(parts) + 1
    base, body = 10, value
    if value.startswith(("0b", "0B")):
        base, body = 2, value[2:]
    elif value.startswith(("0x", "0X")):
        base, body = 16, value[2:]
    elif value.startswith("0"):
        base = 8
    body = body.lstrip("0")
    return math.ceil(len(body) * math.log10(base))


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a depth-counting composer, an integer-length check on every
    integer scalar, a measure of the composed graph, and constructor errors tied to their line."""

    def __init__(self, text: str, path: Path) -> None:
        super().__init__(text)
        self.path = path
        self._keys: list[str] = []  # the key path of the node being composed, one part a level
        self._depth = 0  # lists and mappings open around the node being composed

    # -- errors ------------------------------------------------------------------------------

    def _fail(self, mark: yaml.Mark | None, problem: str, keys: list[str] | None = None) -> None:
        where = f"line {mark.line + 1}" if mark is not None else "YAML"
        key_path = _key_path(keys) if keys else ""
        prefix = f"{self.path}: {where}: " + (f"{key_path}: " if key_path else "")
        raise RecipeError(prefix + problem)

    # -- composing: depth, key paths and integer lengths --------------------------------------

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if isinstance(parent, SequenceNode):
            part = f"[{index}]"
        elif isinstance(parent, MappingNode) and index is not None:
            part = "." + _label(index)
        else:  # the root, or a mapping key (which has its mapping's path)
            part = ""
        self._keys.append(part)
        try:
            return super().compose_node(parent, index)
        finally:
            self._keys.pop()

    def _enter(self) -> None:
        """Called before a list or mapping is composed: refuse it past MAX_YAML_DEPTH, so the
        composer's recursion stops there whatever the document."""
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            self._fail(
                self.peek_event().start_mark,
                f"nested more than {MAX_YAML_DEPTH} levels deep (a recipe needs a few)",
                self._keys,
            )

    def compose_sequence_node(self, anchor: str | None) -> SequenceNode:
        self._enter()
        try:
            return super().compose_sequence_node(anchor)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: str | None) -> MappingNode:
        self._enter()
        try:
            return super().compose_mapping_node(anchor)
        finally:
            self._depth -= 1

    def compose_scalar_node(self, anchor: str | None) -> ScalarNode:
        node = super().compose_scalar_node(anchor)
        if node.tag == _INT_TAG:
            digits = _int_digits(node.value)
            if digits > MAX_INT_DIGITS:
                self._fail(
                    node.start_mark,
                    f"integer {_clip(node.value.strip(), 24)} has about {digits} digits; no "
                    f"setting takes more than {MAX_INT_DIGITS}",
                    self._keys,
                )
        return node

    # -- the composed graph: expansion, depth through aliases, cycles -------------------------

    def check_graph(self, root: Node) -> None:
        """Refuse a graph whose aliases expand past MAX_YAML_NODES values, nest deeper than
        MAX_YAML_DEPTH, or contain themselves. Iterative (an explicit stack), each distinct node
        visited once, before any Python object is constructed."""
        size: dict[int, int] = {}
        height: dict[int, int] = {}
        open_nodes: set[int] = set()  # started and not finished: the current node's ancestors
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, finished = stack.pop()
            key = id(node)
            children = _children(node)
            if finished:
                open_nodes.discard(key)
                total = 1 + sum(size[id(child)] for child in children)
                levels = int(not isinstance(node, ScalarNode)) + max(
                    (height[id(child)] for child in children), default=0
                )
                if total > MAX_YAML_NODES:
                    self._fail(
                        node.start_mark,
                        f"YAML aliases expand to more than {MAX_YAML_NODES} values (an alias "
                        "bomb?); a recipe needs far fewer",
                    )
                if levels > MAX_YAML_DEPTH:
                    self._fail(
                        node.start_mark,
                        f"aliases nest values more than {MAX_YAML_DEPTH} levels deep (a recipe "
                        "needs a few)",
                    )
                size[key], height[key] = total, levels
                continue
            if key in size:
                continue
            if key in open_nodes:
                self._fail(node.start_mark, "YAML alias refers to itself (a recursive document)")
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in size)

    # -- constructing: constructor errors with their line --------------------------------------

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """PyYAML's construct_object, with the exceptions its scalar constructors raise for a
        value that does not fit its explicit tag turned into a ConstructorError at the node."""
        try:
            return super().construct_object(node, deep)
        except _CONSTRUCTION_ERRORS as exc:
            tag = node.tag.rsplit(":", 1)[-1]
            value = _clip(str(node.value), 40) if isinstance(node, ScalarNode) else "a collection"
            raise ConstructorError(
                None,
                None,
                f"{value!r} is not a valid !!{tag} ({type(exc).__name__})",
                node.start_mark,
            ) from None


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _key_path(parts: list[str]) -> str:
    """`calibration.data.npz`, `seed[0][0]`; paths longer than a few parts are elided in the
    middle so the message stays one short line."""
    parts = [part for part in parts if part]
    if len(parts) > 6:
        parts = [*parts[:4], "...", parts[-1].lstrip(".")]
    return "".join(parts).lstrip(".")
