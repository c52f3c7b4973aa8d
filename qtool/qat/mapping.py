"""Tie the Layout's QDQ tensors and stored weights to the torch module that produced the graph.

The TorchScript exporter names nodes after module paths (`/conv1/Conv` for module `conv1`) and
keeps parameter names as initializer names (`conv1.weight`). A quantized activation tensor is
fake-quantized at the output of the module whose node produces it (a graph input: at the model's
input); a stored weight is the parameter of the same name. Names only suggest the tie:
`check_sites` proves it by running the float module and ONNX Runtime on the same batch and
comparing every tensor, so a node inside a module (not its output), a module called twice, or a
functional op with no module is an error naming the tensor, never a fake quantizer in the wrong
place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.errors import ModelError
from qtool.ort.sessions import create_session
from qtool.plan.layout import Layout


@dataclass(frozen=True)
class Site:
    """Where a quantized tensor appears in torch: module output, or graph input number `index`."""

    tensor: str
    module: str | None  # module path ("" is the root); None for a graph input
    index: int = 0


def module_path(node: onnx.NodeProto) -> str:
    """`/block/conv1/Conv` -> `block.conv1` (the exporter's scope naming)."""
    name = node.name
    if not name.startswith("/") or "/" not in name[1:]:
        raise ModelError(
            f"node '{name}' ({node.op_type}) has no module scope in its name: it comes from a "
            "functional call, not a module, and qtool qat cannot place its fake quantizer"
        )
    return name[1:].rsplit("/", 1)[0].replace("/", ".")


def activation_sites(model: onnx.ModelProto, layout: Layout, input_names: list[str]) -> list[Site]:
    producers = {out: node for node in model.graph.node for out in node.output}
    sites = []
    for tensor in sorted(layout.activations):
        if tensor in input_names:
            sites.append(Site(tensor, None, input_names.index(tensor)))
            continue
        node = producers.get(tensor)
        if node is None:
            raise ModelError(f"quantized tensor '{tensor}' has no producer in the prepared model")
        sites.append(Site(tensor, module_path(node)))
    return sites


@dataclass(frozen=True)
class WeightTie:
    """A planned weight initializer and the module parameter it holds: the same values, or
    (`transposed`) the parameter's transpose, the constant the exporter writes for a Linear
    applied to a 3-D input (a MatMul reading `onnx::MatMul_N` = weight.T)."""

    parameter: str
    transposed: bool = False


def weight_parameters(model: onnx.ModelProto, layout: Layout, module) -> dict[str, WeightTie]:
    """Planned weight initializer -> the parameter it holds.

    A parameter of the initializer's name, else the `weight` of the reading node's module when
    the initializer is its transpose. The values must match exactly: preparation rewrote any
    weight that differs (folded, reshaped), and training the torch copy would then not be
    exported.
    """
    initializers = {init.name: init for init in model.graph.initializer}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            if name in layout.weights:
                readers.setdefault(name, node)
    ties = {}
    for name in sorted(layout.weights):
        node = readers[name]
        stored = numpy_helper.to_array(initializers[name])
        owner = module_path(node)
        tie = WeightTie(name)
        try:
            parameter = module.get_parameter(name)
        except AttributeError:
            tie = WeightTie(f"{owner}.weight" if owner else "weight", transposed=True)
            try:
                parameter = module.get_parameter(tie.parameter)
            except AttributeError:
                raise ModelError(
                    f"weight '{name}' of node '{node.name}' is not a parameter of the PyTorch "
                    f"module, nor the transpose of '{tie.parameter}': qtool qat cannot map it "
                    "back"
                ) from None
        if tie.parameter.rpartition(".")[0] != owner:
            raise ModelError(
                f"weight '{name}' is read by node '{node.name}', not by module "
                f"'{tie.parameter.rpartition('.')[0]}'"
            )
        value = parameter.detach().cpu().numpy()
        if tie.transposed:
            value = value.T
        if stored.shape != value.shape or not np.array_equal(stored, value):
            raise ModelError(
                f"weight '{name}': the prepared ONNX model holds other values than the module's "
                f"parameter '{tie.parameter}'{' (transposed)' if tie.transposed else ''} (shape "
                f"{list(stored.shape)} vs {list(value.shape)}): preparation rewrote it, so the "
                "trained parameter could not be exported"
            )
        ties[name] = tie
    return ties


def initializer_state(
    state: dict[str, np.ndarray], ties: dict[str, WeightTie], initializers: set[str]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The trained parameters under their initializer names (a transposed tie written back
    transposed), and the parameters the graph does not hold (the exporter dropped them as
    unused, such as BERT's pooler): those are frozen before training, so nothing is lost."""
    aliases = {tie.parameter: (name, tie.transposed) for name, tie in ties.items()}
    mapped, unused = {}, []
    for parameter, value in state.items():
        name, transposed = aliases.get(parameter, (parameter, False))
        if name not in initializers:
            unused.append(parameter)
            continue
        mapped[name] = np.ascontiguousarray(value.T) if transposed else value
    return mapped, unused


def check_sites(
    module, float_model: onnx.ModelProto, sites: list[Site], feeds: dict[str, np.ndarray]
) -> None:
    """Run the float module with capturing hooks and ONNX Runtime with the same tensors as
    outputs; every site must be called once per forward and hold the same values."""
    import torch

    if not sites:  # weight-only plans quantize no activation
        return
    captured: dict[str, list[np.ndarray]] = {site.tensor: [] for site in sites}
    handles = []
    for site in sites:
        if site.module is None:
            continue
        try:
            target = module.get_submodule(site.module)
        except AttributeError:
            raise ModelError(
                f"quantized tensor '{site.tensor}': module '{site.module}' (from its node's "
                "name) does not exist in the PyTorch model"
            ) from None

        def hook(_module, _inputs, output, tensor=site.tensor):
            if isinstance(output, torch.Tensor):
                captured[tensor].append(output.detach().cpu().numpy())
            else:
                captured[tensor].append(None)

        handles.append(target.register_forward_hook(hook))
    names = list(feeds)
    try:
        with torch.no_grad():
            module(*(torch.from_numpy(feeds[n]) for n in names))
    finally:
        for handle in handles:
            handle.remove()
    probe = onnx.ModelProto()
    probe.CopyFrom(float_model)
    existing = {o.name for o in probe.graph.output}
    for site in sites:
        if site.tensor not in existing:
            probe.graph.output.append(onnx.ValueInfoProto(name=site.tensor))
    session = create_session(probe.SerializeToString(), optimize=False, threads=1)
    wanted = [site.tensor for site in sites]
    values = dict(zip(wanted, session.run(wanted, feeds), strict=True))
    for site in sites:
        if site.module is None:
            continue
        calls = captured[site.tensor]
        if len(calls) != 1 or calls[0] is None:
            raise ModelError(
                f"quantized tensor '{site.tensor}': module '{site.module}' ran {len(calls)} "
                "times per forward or returned no single tensor; qtool qat needs one call"
            )
        got, want = calls[0], values[site.tensor]
        bound = 1e-4 * max(1.0, float(np.abs(want).max()))
        if got.shape != want.shape or float(np.abs(got - want).max()) > bound:
            raise ModelError(
                f"quantized tensor '{site.tensor}' is not the output of module '{site.module}' "
                "(values differ from ONNX Runtime's): qtool qat cannot place its fake quantizer"
            )
