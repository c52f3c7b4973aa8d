"""The presets shipped inside the package (qtool/config/presets/*.yaml, also reachable as the
checkout's `configs/`), so `base: int8-cnn` works from any folder and any install."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "presets"


def names() -> list[str]:
    return sorted(path.stem for path in FOLDER.glob("*.yaml"))


def resolve_base(value: str, folder: Path) -> Path | None:
    """A bare name (no folder, no suffix) is a preset; anything else is a path relative to
    `folder`, the recipe's own. None: a bare name that names no preset."""
    if "/" not in value and "\\" not in value and not value.endswith((".yaml", ".yml")):
        path = FOLDER / f"{value}.yaml"
        return path if path.is_file() else None
    return (folder / value).resolve()
