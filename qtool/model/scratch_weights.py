"""Float weights an algorithm rewrote, kept in a temporary data file instead of in the model.

A lazy model (external_data: weights referenced in their file, read one at a time) stays small
only while its weights stay on disk. An algorithm that rewrites weights (AWQ scales the input
channels of every weight-only MatMul) would otherwise put each new array into the model proto,
where protobuf's arena holds it until the whole model goes (SmolLM2-135M: 0.52 GB of scaled
weights held through the weight quantization that reads each once). Here each array goes to a
scratch file in the system's temporary folder and the initializer becomes a lazy weight pointing
at it, so the build reads it back like any other lazy weight.

The file lives as long as the `ScratchWeights` that wrote it: whoever holds a model with such
references (the build's result) holds the store too, since the writer copies the bytes of lazy
weights it keeps when the model is staged.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, numpy_helper

from qtool.errors import OutputError
from qtool.model.external_data import DATA_FIELDS, copy_fields, lazy_file

__all__ = ["ScratchWeights"]


class ScratchWeights:
    """A temporary data file of rewritten float weights, each referenced by a lazy initializer."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="qtool-weights-")
        self.path = Path(self._folder.name) / "weights.data"
        self._end = 0

    def put(self, tensor: TensorProto, values: np.ndarray) -> None:
        """Replace `tensor`'s data by `values`, written to the scratch file: `tensor` becomes a
        lazy weight of the same name, type and shape as `values`."""
        array = numpy_helper.from_array(values, tensor.name)
        data = array.raw_data
        try:
            with open(self.path, "ab") as handle:
                handle.write(data)
        except OSError as exc:
            raise OutputError(
                f"{self.path}: cannot hold the rewritten weight {tensor.name!r} ({exc.strerror}); "
                "free space in the temporary folder or point TMPDIR at a larger one"
            ) from None
        offset, self._end = self._end, self._end + len(data)
        tensor.Clear()
        copy_fields(array, tensor, DATA_FIELDS)  # name, dims, type
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path), ("offset", offset), ("length", len(data))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        assert lazy_file(tensor) == (self.path, offset, len(data))

    def close(self) -> None:
        """Remove the file now (it goes with the store otherwise)."""
        self._folder.cleanup()
