"""The SHA-256 of a recipe as resolved: presets merged, values validated, whether it came from
a file or was changed in code. Provenance stamps it into every quantized model, so two recipes
that mean the same settings hash the same and a change in a base preset changes the hash.

Paths are written relative to the recipe's folder, so the hash does not depend on where the
checkout lives; the recipe's own file name and the output folder (which `-o` overrides) are left
out: they change where files go, not what is in them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from qtool.config.recipe import Recipe
from qtool.pipeline.tuning import TuningSpec

_ABSENT = object()

_NOT_SETTINGS = ("path", "output_dir")
# Sections added after recipes were first hashed: at their defaults they are left out, so a
# recipe that does not use them keeps the hash (and the model bytes) it had before.
_LATER_SECTIONS = {"tuning": TuningSpec()}


def recipe_sha256(recipe: Recipe) -> str:
    folder = str(recipe.path.resolve().parent)
    values = {
        field.name: _plain(getattr(recipe, field.name), folder)
        for field in dataclasses.fields(recipe)
        if field.name not in _NOT_SETTINGS
        and _LATER_SECTIONS.get(field.name, _ABSENT) != getattr(recipe, field.name)
    }
    text = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any, folder: str) -> Any:
    """`value` as JSON-ready data, paths (and 'file.py:function' entry points) relative to
    `folder`."""
    if dataclasses.is_dataclass(value):
        return {
            field.name: _plain(getattr(value, field.name), folder)
            for field in dataclasses.fields(value)
        }
    if isinstance(value, Path):
        return _relative(str(value), folder)
    if isinstance(value, str):
        file, sep, function = value.rpartition(":")
        if sep and file.endswith(".py") and function.isidentifier():  # an entry point
            return _relative(file, folder) + sep + function
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item, folder) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, folder) for item in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _relative(path: str, folder: str) -> str:
    """`path` (absolute, or relative to the working folder as the recipe loader leaves it)
    relative to `folder`."""
    return Path(os.path.relpath(os.path.abspath(path), folder)).as_posix()
