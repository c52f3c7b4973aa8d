"""Back from torch to the writer: trained weights into the prepared model, and the proof that
the exported QDQ model computes what the fake-quant module computes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from qtool.errors import ModelError
from qtool.metrics.signal import SignalQuality
from qtool.ort.sessions import create_session
from qtool.qat.train import outputs_tuple


def with_trained_weights(model: onnx.ModelProto, state: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of the prepared float model whose initializers hold the trained parameters.

    Every trained parameter must be an initializer of the same name and shape: one the exporter
    folded into another constant would silently lose its training.
    """
    trained = onnx.ModelProto()
    trained.CopyFrom(model)
    index = {init.name: k for k, init in enumerate(trained.graph.initializer)}
    for name, value in sorted(state.items()):
        if name not in index:
            raise ModelError(
                f"trained parameter '{name}' is no initializer of the prepared ONNX model (the "
                "exporter or preparation folded it): its trained value cannot be exported"
            )
        old = trained.graph.initializer[index[name]]
        if list(old.dims) != list(value.shape):
            raise ModelError(
                f"trained parameter '{name}' has shape {list(value.shape)}, its initializer "
                f"{list(old.dims)}"
            )
        trained.graph.initializer[index[name]].CopyFrom(
            numpy_helper.from_array(value.astype(np.float32), name)
        )
    return trained


def torch_outputs(
    model, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str]
) -> list[list[np.ndarray]]:
    """Outputs per batch of a torch module in eval mode (the fake-quant model, or FP32); `names`
    are the model's inputs in the order its forward takes them."""
    model.eval()
    result = []
    with torch.no_grad():
        for feed in feeds:
            outs = outputs_tuple(model(*(torch.from_numpy(feed[n]) for n in names)))
            result.append([o.detach().cpu().numpy() for o in outs])
    return result


def ort_outputs(model: bytes, feeds: Sequence[dict[str, np.ndarray]], fused: bool):
    """ONNX Runtime's outputs: `fused` as it deploys (graph optimizations on, integer kernels),
    else the unfused QDQ semantics (no rewrites)."""
    session = create_session(model, optimize=fused, threads=1)
    return [session.run(None, feed) for feed in feeds]


def max_difference(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> float:
    """The largest absolute difference between two runs' outputs, over every batch and output."""
    quality = SignalQuality(peak=True)
    for xs, ys in zip(a, b, strict=True):
        for x, y in zip(xs, ys, strict=True):
            quality.update(x, y)
    return quality.max_abs_diff


def output_step(reference: list[list[np.ndarray]]) -> float:
    """One 8-bit quantization step of the first output: its range over the data / 255."""
    first = np.concatenate([outs[0].reshape(-1) for outs in reference])
    return float(first.max() - first.min()) / 255.0


def accuracy(outputs: list[list[np.ndarray]], labels: Sequence[np.ndarray]) -> float:
    """Top-1 accuracy (percent) of the first output."""
    hits = sum(
        int((outs[0].argmax(axis=-1) == y).sum()) for outs, y in zip(outputs, labels, strict=True)
    )
    return 100.0 * hits / sum(len(y) for y in labels)
