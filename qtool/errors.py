"""Error types.

Every failure a user can cause (bad recipe, missing file, wrong shape, NaN in data) is raised as a
`QtoolError` subclass with a one-line message that names the file, field or tensor at fault. The
CLI prints that line and exits with code 2; anything else is a bug and keeps its traceback.
"""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty): errors stay one line
    even when a library (torch, ORT, onnx) raises a multi-line message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class QtoolError(Exception):
    """A user-facing error: one line, names what is wrong, CLI exit code 2."""

    exit_code = 2


class RecipeError(QtoolError):
    """The recipe YAML is malformed, has unknown keys, wrong types or bad values."""


class ModelError(QtoolError):
    """The model cannot be loaded, exported or does not match the declared inputs."""


class DataError(QtoolError):
    """Calibration or evaluation data is missing, malformed, or contains NaN/Inf."""


class KernelError(QtoolError):
    """A compiled kernel library is missing or a kernel rejected its arguments."""


class CalibrationError(QtoolError):
    """Statistics cannot be collected or the stats file does not match the model."""


class OutputError(QtoolError):
    """An output file or folder cannot be written (a file in the way, no permission, disk full)."""
