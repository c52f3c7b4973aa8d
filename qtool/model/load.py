"""Load the FP32 model a recipe names, as an ONNX ModelProto whose inputs match the recipe.

PyTorch models are exported with the TorchScript-based exporter (``dynamo=False``) because it
names nodes after the module path (``/conv1/Conv``), so recipe overrides can name layers the way
the model's author knows them; the batch dimension is exported dynamic so calibration and
evaluation can use any batch size.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import math
import pickletools
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from qtool.data.spec import InputSpec
from qtool.errors import ModelError, first_line
from qtool.model.external_data import lazy_file, raw_nbytes
from qtool.model.spec import ModelSpec
from qtool.phases import phase

_ONNX_DTYPES = {
    "float32": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "int64": onnx.TensorProto.INT64,
    "int32": onnx.TensorProto.INT32,
    "bool": onnx.TensorProto.BOOL,
}


def load_entry_point(spec: str, what: str):
    """Import ``/abs/path/file.py:name`` and return the attribute; the file's folder is put on
    sys.path first so the file can import its neighbours (a model module next to its data module).
    """
    file_part, _, name = spec.rpartition(":")
    path = Path(file_part)
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_qtool_user_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModelError(f"{path}: cannot import {what}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ModelError(
                f"{path}: importing {what} failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not hasattr(module, name):
        raise ModelError(f"{path}: has no '{name}' ({what})")
    return getattr(module, name)


def load_model(
    spec: ModelSpec,
    inputs: tuple[InputSpec, ...],
    digest: hashlib._Hash | None = None,
    read_files: list[Path] | None = None,
) -> onnx.ModelProto:
    """Return the FP32 model as ONNX, checked against the recipe's declared inputs.

    `digest`: for an ONNX source, fed the file and its external data as they are read (see
    load_onnx), so provenance needs no second read of a model that may be gigabytes;
    `read_files`: extended with the files read (the model file, then its external data)."""
    if spec.onnx is not None:
        model = load_onnx(Path(spec.onnx), digest, read_files)
        source = str(spec.onnx)
    else:
        model = export_pytorch(spec, inputs)
        source = spec.pytorch or "pytorch model"
    check_inputs(model, inputs, source)
    check_defined(model, source)
    fit_ir_version(model, source)
    return model


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return (
        f"node {node.name!r} ({node.op_type})" if node.name else f"node #{index} ({node.op_type})"
    )


def check_defined(model: onnx.ModelProto, source: str) -> None:
    """Refuse a graph where a node reads, or the graph outputs, a tensor that nothing defines
    (no graph input, initializer or node output), naming the node and the tensor.

    Without this check such a tensor surfaced far from its cause: as an element type shape
    inference "cannot infer" for the reading node's output, or as no node being quantizable.
    Subgraphs (If, Loop) may read their outer graph's tensors and are left to ONNX Runtime."""
    graph = model.graph
    defined = {""}  # an empty name is an omitted optional input
    defined.update(value.name for value in graph.input)
    defined.update(tensor.name for tensor in graph.initializer)
    defined.update(sparse.values.name for sparse in graph.sparse_initializer)
    for node in graph.node:
        defined.update(node.output)
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name not in defined:
                raise ModelError(
                    f"{source}: {_node_label(node, index)} reads tensor {name!r}, which no "
                    "node, initializer or graph input defines"
                )
    for value in graph.output:
        if value.name not in defined:
            raise ModelError(
                f"{source}: graph output {value.name!r} is not defined by any node, initializer "
                "or graph input"
            )


def load_onnx(
    path: Path, digest: hashlib._Hash | None = None, read_files: list[Path] | None = None
) -> onnx.ModelProto:
    """Read an ONNX file and the external data files beside it (models over 2 GB keep their
    weights there: see qtool.model.external_data); a missing data file is named in the error.

    `digest` is updated with the file's bytes, then with each external data file in
    first-reference order: provenance.sha256_model's definition, computed from the one read
    (hashing the file afterwards re-read and re-parsed it: 0.2 CPU s on a 90 MB encoder)."""
    from qtool.model import external_data
    from qtool.model.external_data import clear_default_locations, external_files, hash_files

    lazy = _load_large_inline(path, digest, external_data.STAGE_WEIGHTS_THRESHOLD)
    if lazy is not None:
        if read_files is not None:
            read_files.append(path)
        check_initializers(lazy, str(path))
        return lazy
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the model file ({first_line(exc)})") from None
    if digest is not None:
        digest.update(content)
    try:
        model = onnx.load_model_from_string(content)
    except Exception as exc:
        raise ModelError(f"{path}: not a readable ONNX model ({first_line(exc)})") from None
    del content
    files = external_files(path, model)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ModelError(
            f"{path}: its weights are stored in {missing[0].name}, which is not in "
            f"{missing[0].parent}"
        )
    if digest is not None:
        hash_files(digest, files, path)
    if read_files is not None:  # the source's size without parsing the file again
        read_files.extend([path, *files])
    large = _external_nbytes(model) >= external_data.STAGE_WEIGHTS_THRESHOLD
    if large and not external_data.external_beyond_initializers(model):
        _reference_in_place(model, path)
        check_initializers(model, str(path))
        return model
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # a location outside the folder, a file shorter than an offset
        raise ModelError(f"{path}: cannot read its external data ({first_line(exc)})") from None
    clear_default_locations(model)
    check_initializers(model, str(path))
    return model


def _external_nbytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initializers that live in external data files."""
    return sum(
        raw_nbytes(t)
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    )


def _reference_in_place(model: onnx.ModelProto, path: Path) -> None:
    """Leave a large model's external weights in the user's data files, as lazy weights
    (external_data.lazy_file) read one at a time when a stage needs one, as a large inline
    model's are: reading them all into the proto cost a 2.15 GB decoder 2 CPU s and its whole
    size in memory before preparation began. Each reference is checked as onnx's loader checks
    it: inside the model's folder, within its file."""
    from qtool.model.external_data import make_lazy

    folder = path.parent.resolve()
    sizes: dict[Path, int] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        file = (folder / location).resolve()
        if not location or Path(location).is_absolute() or not file.is_relative_to(folder):
            raise ModelError(
                f"{path}: initializer {tensor.name!r}: external data location {location!r} is "
                "not a file in the model's folder"
            )
        if file not in sizes:
            sizes[file] = file.stat().st_size
        try:
            offset = int(entries.get("offset", 0))
            length = int(entries["length"]) if "length" in entries else raw_nbytes(tensor)
        except ValueError:
            raise ModelError(
                f"{path}: initializer {tensor.name!r}: external data offset or length is not "
                "a number"
            ) from None
        if offset < 0 or length < 0 or offset + length > sizes[file]:
            raise ModelError(
                f"{path}: initializer {tensor.name!r}: {file.name} ends before offset "
                f"{offset} + {length} bytes"
            )
    make_lazy(model, folder)


def _load_large_inline(
    path: Path, digest: hashlib._Hash | None, threshold: int
) -> onnx.ModelProto | None:
    """A single-file model of `threshold` bytes or more, its weights left in the file (lazy:
    qtool.model.inline_lazy), so loading it holds its graph, not its weights; None for a
    smaller file or one that reader leaves to onnx's loader."""
    from qtool.model.inline_lazy import load_inline_lazy

    try:
        if path.stat().st_size < threshold:
            return None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the model file ({first_line(exc)})") from None
    return load_inline_lazy(path, digest)


# Element types stored one value per element in a typed field (complex ones two), when a
# tensor has no raw_data. Sub-byte types pack theirs and are not counted here.
_TYPED_STORAGE = {
    onnx.TensorProto.FLOAT: ("float_data", 1),
    onnx.TensorProto.COMPLEX64: ("float_data", 2),
    onnx.TensorProto.DOUBLE: ("double_data", 1),
    onnx.TensorProto.COMPLEX128: ("double_data", 2),
    onnx.TensorProto.INT64: ("int64_data", 1),
    onnx.TensorProto.UINT32: ("uint64_data", 1),
    onnx.TensorProto.UINT64: ("uint64_data", 1),
    **{
        getattr(onnx.TensorProto, name): ("int32_data", 1)
        for name in (
            "INT32",
            "INT16",
            "INT8",
            "UINT8",
            "UINT16",
            "BOOL",
            "FLOAT16",
            "BFLOAT16",
            "FLOAT8E4M3FN",
            "FLOAT8E4M3FNUZ",
            "FLOAT8E5M2",
            "FLOAT8E5M2FNUZ",
        )  # fmt: skip
        if hasattr(onnx.TensorProto, name)
    },
}


def _amount(count: int) -> str:
    """A count for a message: exact up to 15 digits, else 3 significant ones (10**53 elements)."""
    return str(count) if count < 10**15 else f"{count:.3e}"


def _data_problem(tensor: onnx.TensorProto) -> str | None:
    """What is wrong with a tensor's data given its dims and type, or None when they agree."""
    dims = list(tensor.dims)
    if any(dim < 0 for dim in dims):
        return f"has a negative dimension in its dims {dims}"
    lazy = lazy_file(tensor)
    if tensor.data_location == onnx.TensorProto.EXTERNAL and lazy is None:
        return None  # not loaded (onnx.load_external_data_for_model checks what it reads)
    count = math.prod(dims)
    if tensor.data_type == onnx.TensorProto.STRING:
        have = len(tensor.string_data)
        return None if have == count else f"has dims {dims} ({count} strings) but holds {have}"
    try:
        type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
        need = raw_nbytes(tensor)
    except (KeyError, ValueError, TypeError):
        return f"has element type {tensor.data_type}, which is not an ONNX tensor type"
    claim = f"dims {dims} ({_amount(count)} {type_name} elements, {_amount(need)} bytes)"
    if lazy is not None:  # its raw_data's length, as recorded in the file
        return None if lazy[2] == need else f"has {claim} but holds {lazy[2]} bytes of data"
    if tensor.HasField("raw_data"):
        have = len(tensor.raw_data)  # copies the bytes (~1 ms per MB), one tensor at a time
        return None if have == need else f"has {claim} but holds {have} bytes of data"
    storage = _TYPED_STORAGE.get(tensor.data_type)
    if storage is None:
        return None
    field, per_element = storage
    have = len(getattr(tensor, field))
    if have != count * per_element:
        return f"has {claim} but holds {have} values in {field}"
    return None


def check_initializers(model: onnx.ModelProto, source: str) -> None:
    """Refuse a model whose initializers' data disagree with their dims and type, naming the
    initializer, its dims and its byte count.

    onnx's loader does not compare them, so a tensor whose dims claim 10**53 elements over 16
    bytes used to surface inside shape inference as "element type of tensor ... cannot be
    inferred" (naming a node output, not the tensor at fault), and a short one as a numpy or
    ONNX Runtime error about a reshape."""
    for tensor in model.graph.initializer:
        problem = _data_problem(tensor)
        if problem is not None:
            raise ModelError(f"{source}: initializer {tensor.name!r} {problem}")


# Element types newer than IR 8 and the IR version that added each (onnx.proto's history).
_TYPE_IR = {
    name: version
    for version, names in (
        (9, ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")),
        (10, ("UINT4", "INT4")),
        (11, ("FLOAT4E2M1",)),
        (12, ("FLOAT8E8M0",)),
        (13, ("UINT2", "INT2")),
        (14, ("FLOAT6E2M3", "FLOAT6E3M2")),
    )
    for name in names
}


def _graph_types(graph: onnx.GraphProto) -> set[int]:
    """Every element type a graph (and its subgraphs) declares, stores or casts to."""
    found = {init.data_type for init in graph.initializer}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            found.add(value.type.tensor_type.elem_type)
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.type == onnx.AttributeProto.INT:
                found.add(attr.i)
            if attr.HasField("t"):
                found.add(attr.t.data_type)
            if attr.HasField("g"):
                found |= _graph_types(attr.g)
            for sub in attr.graphs:
                found |= _graph_types(sub)
    return found


def required_ir_version(model: onnx.ModelProto) -> tuple[int, str]:
    """The oldest IR version that can express `model`, and what needs it (for messages)."""
    version = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    reason = "its opsets"
    for elem in sorted(_graph_types(model.graph)):
        name = onnx.TensorProto.DataType.Name(elem) if elem else ""
        if _TYPE_IR.get(name, 0) > version:
            version, reason = _TYPE_IR[name], f"element type {name}"
    if model.functions and version < 8:
        version, reason = 8, "model-local functions"
    return version, reason


def fit_ir_version(model: onnx.ModelProto, source: str) -> None:
    """Lower the IR version to one the installed onnxruntime loads, when the model needs no newer
    feature: the installed onnx package writes a newer IR version than the ORT release beside it
    reads (onnx 1.23 writes 14, ORT 1.31 reads up to 13), so a model fresh from onnx.helper would
    otherwise be refused by every session qtool opens, and so would qtool's own outputs."""
    from qtool.ort.sessions import max_ir_version

    newest = max_ir_version()
    if model.ir_version <= newest:
        return
    required, reason = required_ir_version(model)
    if required > newest:
        import onnxruntime

        raise ModelError(
            f"{source}: needs ONNX IR version {required} (for {reason}), but the installed "
            f"onnxruntime {onnxruntime.__version__} reads IR <= {newest}"
        )
    model.ir_version = newest


def export_pytorch(spec: ModelSpec, inputs: tuple[InputSpec, ...]) -> onnx.ModelProto:
    """Build the module from its factory, load the state_dict safely, export to ONNX in memory."""
    with phase("exporting PyTorch model"):  # importing torch alone takes seconds
        return _export_pytorch(spec, inputs)


def _export_pytorch(spec: ModelSpec, inputs: tuple[InputSpec, ...]) -> onnx.ModelProto:
    return export_module(build_pytorch_module(spec), spec, inputs)


def build_pytorch_module(spec: ModelSpec):
    """The recipe's nn.Module from its factory, with its weights file loaded (QAT trains it)."""
    import torch

    factory = load_entry_point(spec.pytorch, "model factory")
    try:
        module = factory()
    except Exception as exc:
        raise ModelError(f"{spec.pytorch}: factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"{spec.pytorch}: factory returned {type(module).__name__}, not nn.Module")
    if spec.weights is not None:
        load_weights(module, spec.weights)
    return module


def export_module(module, spec: ModelSpec, inputs: tuple[InputSpec, ...]) -> onnx.ModelProto:
    """Export `module` (eval mode) to ONNX in memory, the way every PyTorch source is exported."""
    import torch

    module.eval()
    examples = tuple(torch.from_numpy(np.zeros(i.shape, dtype=np.dtype(i.dtype))) for i in inputs)
    names = [i.name for i in inputs]
    buffer = io.BytesIO()
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = module(*examples)
            outputs = probe if isinstance(probe, (tuple, list)) else (probe,)
            output_names = (
                ["output"] if len(outputs) == 1 else [f"output_{k}" for k in range(len(outputs))]
            )
            dynamic = {n: {0: "batch"} for n in names + output_names}
            torch.onnx.export(
                module,
                examples,
                buffer,
                input_names=names,
                output_names=output_names,
                opset_version=spec.opset,
                dynamo=False,
                dynamic_axes=dynamic,
                do_constant_folding=True,
            )
    except Exception as exc:
        raise ModelError(f"{spec.pytorch}: export to ONNX failed: {first_line(exc)}") from None
    return onnx.load_from_string(buffer.getvalue())


# torch names the global a refused pickle wanted: "GLOBAL posix.system", "GLOBAL model.DigitsCNN".
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_LISTED = 4  # keys named in a mismatch message; the rest are counted


_SCANNED_BYTES = 1 << 20


def _foreign_import(path: Path) -> str | None:
    """The first non-torch global a raw pickle imports, read from its opcodes without running
    them: torch's loader stops at the first opcode it does not know (protocol 4 framing) before
    it reaches the global, so its message cannot say why the file is dangerous."""
    strings: list[str] = []
    try:
        with open(path, "rb") as handle:
            data = handle.read(_SCANNED_BYTES)
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL":
                name = str(arg).replace(" ", ".")
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                name = f"{strings[-2]}.{strings[-1]}"
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if not name.startswith(("torch.", "collections.OrderedDict")):
                return name
    except Exception:  # not a pickle, or cut off at the scan limit: nothing (more) to name
        pass
    return None


def _some(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LISTED])
    return shown + (f", ... {len(keys) - _LISTED} more" if len(keys) > _LISTED else "")


def load_weights(module, path: Path) -> None:
    """Load a state_dict file into `module`, tensors only, with one line naming what is wrong.

    torch.load(weights_only=True) refuses pickles that would run code, but its messages span
    paragraphs, come with warnings, and advise weights_only=False, which would run that code: a
    tool must never pass that on. load_state_dict's mismatch report is many lines too, so the
    keys and shapes are compared here first.
    """
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        refused = _REFUSED_GLOBAL.search(str(exc))
        imported = refused.group(1) if refused is not None else _foreign_import(path)
        if imported is not None:
            raise ModelError(
                f"{path}: refused: loading it would import {imported}; weights files may "
                "hold only tensors (save them with torch.save(model.state_dict(), path))"
            ) from None
        raise ModelError(
            f"{path}: not a PyTorch state_dict file ({type(exc).__name__}); "
            "write one with torch.save(model.state_dict(), path)"
        ) from None
    if not isinstance(state, Mapping):
        raise ModelError(
            f"{path}: holds a {type(state).__name__}, not a state_dict (a mapping of names to "
            "tensors)"
        )
    others = [str(k) for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise ModelError(
            f"{path}: not a state_dict: {len(others)} entries are not tensors ({_some(others)}); "
            "a training checkpoint? save model.state_dict() instead"
        )
    expected = module.state_dict()
    architecture = type(module).__name__
    missing = [k for k in expected if k not in state]
    unexpected = [str(k) for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys ({_some(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({_some(unexpected)})")
        raise ModelError(
            f"{path}: weights for another architecture than {architecture}: " + ", ".join(parts)
        )
    shapes = [
        f"{k} {list(state[k].shape)} vs {list(v.shape)}"
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if shapes:
        raise ModelError(
            f"{path}: {len(shapes)} tensors do not fit {architecture} (file vs model): "
            + _some(shapes)
        )
    try:
        module.load_state_dict(state)
    except Exception as exc:
        raise ModelError(f"{path}: cannot load weights: {first_line(exc)}") from None


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str | None]:
    dims: list[int | str | None] = []
    for dim in value_info.type.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return dims


def check_inputs(model: onnx.ModelProto, inputs: tuple[InputSpec, ...], source: str) -> None:
    """The recipe's inputs must be exactly the model's graph inputs, with compatible shapes."""
    initializers = {t.name for t in model.graph.initializer}
    graph_inputs = {vi.name: vi for vi in model.graph.input if vi.name not in initializers}
    declared = {i.name for i in inputs}
    for name in graph_inputs:
        if name not in declared:
            raise ModelError(
                f"{source}: model input '{name}' is not declared in the recipe's inputs"
            )
    for spec in inputs:
        if spec.name not in graph_inputs:
            known = ", ".join(sorted(graph_inputs)) or "none"
            raise ModelError(
                f"recipe inputs.{spec.name}: the model has no such input (inputs: {known})"
            )
        vi = graph_inputs[spec.name]
        elem = vi.type.tensor_type.elem_type
        if elem != _ONNX_DTYPES[spec.dtype]:
            actual = onnx.helper.tensor_dtype_to_np_dtype(elem)
            raise ModelError(
                f"recipe inputs.{spec.name}: dtype {spec.dtype} but the model expects {actual}"
            )
        dims = _dims(vi)
        if len(dims) != len(spec.shape):
            raise ModelError(
                f"recipe inputs.{spec.name}: shape {list(spec.shape)} has rank {len(spec.shape)} "
                f"but the model expects {dims}"
            )
        for axis, (want, have) in enumerate(zip(spec.shape, dims, strict=True)):
            if axis > 0 and isinstance(have, int) and have != want:
                raise ModelError(
                    f"recipe inputs.{spec.name}: shape {list(spec.shape)} does not match the "
                    f"model's {dims} at axis {axis}"
                )
