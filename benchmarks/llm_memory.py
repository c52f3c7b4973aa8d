"""Memory and time of quantizing an LLM-sized decoder: qtool against ONNX Runtime's MatMulNBits
quantizer, on one generated file, each tool in its own measured process.

The model is a Llama-like decoder generated here (seeded, so the same arguments give the same
file): token embedding, `--layers` blocks of RMSNorm -> attention (GQA, RoPE, causal mask) ->
RMSNorm -> SwiGLU MLP with residuals, a final RMSNorm and an untied lm_head; every weight float32,
stored as external data (`decoder.onnx` + `decoder.onnx.data`), as large exports are shipped.
The number of layers is chosen so the file reaches `--size-gb`; hidden sizes are large and the
layers few, so each weight is large (what memory is about) and the run stays short.

Runs (benchmarks._measure.run_measured: peak RSS is the kernel's high-water mark of the child,
CPU s its user + system time):

* `ort-matmulnbits`: `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`,
  4-bit, block 32, symmetric, round to nearest (DefaultWeightOnlyQuantConfig), MatMul only;
  the result saved with external data. The baseline of issue 19's targets.
* `qtool-int4`: `qtool quantize`, MatMul weights 4-bit block 32 (symmetric RTN), activations
  float (weight-only: MatMulNBits).
* `qtool-int8-wo`: `qtool quantize`, MatMul weights int8 per channel, activations float.
* `qtool-w8a8`: `qtool quantize`, int8 weights and activations (static ranges, min-max,
  calibrated on `--samples` random token windows).

    python -m benchmarks.llm_memory [--size-gb 2.15] [--runs ort-matmulnbits,qtool-int4,...]
        [--work DIR] [--json out.json]

On an exported model instead (SmolLM2-135M: examples/smollm, one 653 MB file): ORT's quantizer
on the model, then `qtool quantize` on each recipe given (their own data and settings):

    python -m benchmarks.llm_memory --existing examples/smollm/model/model.onnx \
        examples/smollm/recipe.yaml examples/smollm/recipe-int8.yaml

Each row prints peak RSS against the FP32 file and against ORT's peak, CPU s against ORT's, and
what the output folder holds (a float copy of the model, when there is one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._measure import run_measured

REPO = Path(__file__).resolve().parent.parent
RUNS = ("ort-matmulnbits", "qtool-int4", "qtool-int8-wo", "qtool-w8a8")
BLOCK = 32
SEQUENCE = 16  # tokens per calibration / verification window


# ------------------------------------------------------------------------ the generated model


def _layer_bytes(hidden: int, inter: int, kv_dim: int) -> int:
    """float32 bytes of one decoder block's weights."""
    return 4 * (2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden)


def plan_layers(size_gb: float, hidden: int, inter: int, kv_dim: int, vocab: int) -> int:
    """Layers for a file of about `size_gb` (1e9 bytes) with these dimensions (at least 1)."""
    fixed = 4 * (2 * vocab * hidden + hidden)
    return max(1, round((size_gb * 1e9 - fixed) / _layer_bytes(hidden, inter, kv_dim)))


class _Writer:
    """Initializers streamed to one data file as they are generated (the generator never holds
    the model's weights: 2 GB of them would be a third of a small machine's memory)."""

    def __init__(self, folder: Path, location: str, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        self.location = location
        self.handle = open(folder / location, "wb")
        self.initializers: list = []

    def add(self, name: str, shape: tuple[int, ...], std: float | None) -> str:
        """A float32 initializer: normal(0, std) values, or ones when `std` is None (norms)."""
        from onnx import TensorProto

        np = self.np
        if std is None:
            array = np.ones(shape, dtype=np.float32)
        else:
            array = self.rng.standard_normal(shape, dtype=np.float32)
            array *= np.float32(std)
        offset = self.handle.tell()
        self.handle.write(array.tobytes())
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.location),
            ("offset", offset),
            ("length", array.nbytes),
        ):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        self.initializers.append(tensor)
        return name

    def const(self, name: str, array) -> str:
        """A small initializer kept inside the .onnx file (shapes, tables)."""
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def close(self) -> None:
        self.handle.close()


def write_decoder(
    folder: Path,
    *,
    layers: int,
    hidden: int = 2048,
    inter: int = 5632,
    heads: int = 16,
    kv_heads: int = 4,
    vocab: int = 32000,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """Write `decoder.onnx` + `decoder.onnx.data` into `folder`; returns the model's path.

    Inputs `input_ids`, `position_ids` [batch, sequence] int64; output `logits`
    [batch, sequence, vocab]. Opset 17, as torch.onnx's TorchScript exporter writes it."""
    import numpy as np
    from onnx import TensorProto, helper

    head_dim = hidden // heads
    kv_dim = kv_heads * head_dim
    location = "decoder.onnx.data"
    writer = _Writer(folder, location, seed)
    nodes: list = []

    def node(op: str, inputs: list[str], name: str, **attrs) -> str:
        out = f"{name}_out"
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    eps = writer.const("eps", np.array(1e-5, dtype=np.float32))
    neg = writer.const("neg_inf", np.array(-1e4, dtype=np.float32))
    scale = writer.const("attn_scale", np.array(head_dim**-0.5, dtype=np.float32))
    expand = writer.const("kv_repeat", np.array([1, 1, heads // kv_heads, 1, 1], dtype=np.int64))
    q_shape = writer.const("q_shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
    kv_shape = writer.const("kv_shape", np.array([0, 0, kv_heads, head_dim], dtype=np.int64))
    gqa_shape = writer.const("gqa_shape", np.array([0, heads, -1, head_dim], dtype=np.int64))
    out_shape = writer.const("out_shape", np.array([0, 0, hidden], dtype=np.int64))
    one = writer.const("axis_one", np.array([1], dtype=np.int64))
    two = writer.const("axis_two", np.array([2], dtype=np.int64))
    half = writer.const("rope_split", np.array([head_dim // 2, head_dim // 2], dtype=np.int64))
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_positions), inv)
    angles = np.concatenate([angles, angles], axis=1)
    cos_table = writer.const("rope_cos", np.cos(angles).astype(np.float32))
    sin_table = writer.const("rope_sin", np.sin(angles).astype(np.float32))

    def rms_norm(x: str, prefix: str) -> str:
        gamma = writer.add(f"{prefix}.weight", (hidden,), None)
        square = node("Mul", [x, x], f"/{prefix}/Pow")
        mean = node("ReduceMean", [square], f"/{prefix}/ReduceMean", axes=[-1], keepdims=1)
        root = node("Sqrt", [node("Add", [mean, eps], f"/{prefix}/Add")], f"/{prefix}/Sqrt")
        return node("Mul", [node("Div", [x, root], f"/{prefix}/Div"), gamma], f"/{prefix}/Mul")

    def linear(x: str, prefix: str, n_in: int, n_out: int) -> str:
        weight = writer.add(f"{prefix}.weight", (n_in, n_out), 0.02)
        return node("MatMul", [x, weight], f"/{prefix}/MatMul")

    def rope(x: str, prefix: str, cos: str, sin: str) -> str:
        parts = [f"/{prefix}/rope_lo", f"/{prefix}/rope_hi"]
        nodes.append(helper.make_node("Split", [x, half], parts, name=f"/{prefix}/Split", axis=-1))
        rotated = node(
            "Concat",
            [node("Neg", [parts[1]], f"/{prefix}/Neg"), parts[0]],
            f"/{prefix}/Concat",
            axis=-1,
        )
        return node(
            "Add",
            [
                node("Mul", [x, cos], f"/{prefix}/MulCos"),
                node("Mul", [rotated, sin], f"/{prefix}/MulSin"),
            ],
            f"/{prefix}/AddRope",
        )

    embed = writer.add("model.embed_tokens.weight", (vocab, hidden), 0.02)
    x = node("Gather", [embed, "input_ids"], "/model/embed_tokens/Gather")
    # RoPE tables per position, [batch, 1, sequence, head_dim]; the causal mask [sequence]^2
    cos = node("Unsqueeze", [node("Gather", [cos_table, "position_ids"], "/rope/GatherCos"), one],
               "/rope/UnsqueezeCos")  # fmt: skip
    sin = node("Unsqueeze", [node("Gather", [sin_table, "position_ids"], "/rope/GatherSin"), one],
               "/rope/UnsqueezeSin")  # fmt: skip
    length = node("Shape", ["input_ids"], "/mask/Shape", start=1, end=2)
    square_shape = node("Concat", [length, length], "/mask/Concat", axis=0)
    filled = node(
        "ConstantOfShape",
        [square_shape],
        "/mask/ConstantOfShape",
        value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
    )
    mask = node("Mul", [node("Trilu", [filled, one], "/mask/Trilu", upper=1), neg], "/mask/Mul")

    for i in range(layers):
        p = f"model.layers.{i}"
        normed = rms_norm(x, f"{p}.input_layernorm")
        q = linear(normed, f"{p}.self_attn.q_proj", hidden, hidden)
        k = linear(normed, f"{p}.self_attn.k_proj", hidden, kv_dim)
        v = linear(normed, f"{p}.self_attn.v_proj", hidden, kv_dim)
        q = node("Transpose", [node("Reshape", [q, q_shape], f"/{p}/q/Reshape")],
                 f"/{p}/q/Transpose", perm=[0, 2, 1, 3])  # fmt: skip
        q = rope(q, f"{p}/q", cos, sin)

        def heads_of(t: str, tag: str, p: str = p) -> str:
            t = node("Transpose", [node("Reshape", [t, kv_shape], f"/{p}/{tag}/Reshape")],
                     f"/{p}/{tag}/Transpose", perm=[0, 2, 1, 3])  # fmt: skip
            if tag == "k":
                t = rope(t, f"{p}/k", cos, sin)
            t = node("Unsqueeze", [t, two], f"/{p}/{tag}/Unsqueeze")
            t = node("Expand", [t, expand], f"/{p}/{tag}/Expand")
            return node("Reshape", [t, gqa_shape], f"/{p}/{tag}/ReshapeGqa")

        k, v = heads_of(k, "k"), heads_of(v, "v")
        kt = node("Transpose", [k], f"/{p}/k/TransposeT", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], f"/{p}/attn/MatMulQK"), scale],
                      f"/{p}/attn/Scale")  # fmt: skip
        probs = node("Softmax", [node("Add", [scores, mask], f"/{p}/attn/Mask")],
                     f"/{p}/attn/Softmax", axis=-1)  # fmt: skip
        context = node("MatMul", [probs, v], f"/{p}/attn/MatMulPV")
        context = node("Transpose", [context], f"/{p}/attn/TransposeOut", perm=[0, 2, 1, 3])
        context = node("Reshape", [context, out_shape], f"/{p}/attn/ReshapeOut")
        attn = linear(context, f"{p}.self_attn.o_proj", hidden, hidden)
        x = node("Add", [x, attn], f"/{p}/attn/Residual")
        normed = rms_norm(x, f"{p}.post_attention_layernorm")
        gate = linear(normed, f"{p}.mlp.gate_proj", hidden, inter)
        up = linear(normed, f"{p}.mlp.up_proj", hidden, inter)
        silu = node("Mul", [gate, node("Sigmoid", [gate], f"/{p}/mlp/Sigmoid")], f"/{p}/mlp/Silu")
        down = linear(node("Mul", [silu, up], f"/{p}/mlp/Mul"), f"{p}.mlp.down_proj", inter, hidden)
        x = node("Add", [x, down], f"/{p}/mlp/Residual")

    x = rms_norm(x, "model.norm")
    logits = linear(x, "lm_head", hidden, vocab)
    nodes[-1].output[0] = "logits"
    writer.close()
    del logits
    graph = helper.make_graph(
        nodes,
        "llama_like",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])],
        initializer=writer.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "decoder.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def write_data(folder: Path, vocab: int, samples: int, seed: int) -> Path:
    """Random token windows of SEQUENCE tokens (weights are random: any tokens exercise them)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    ids = rng.integers(0, vocab, size=(samples, SEQUENCE), dtype=np.int64)
    positions = np.broadcast_to(np.arange(SEQUENCE, dtype=np.int64), ids.shape).copy()
    path = folder / "tokens.npz"
    np.savez(path, input_ids=ids, position_ids=positions)
    return path


# ------------------------------------------------------------------------ the runs


def _recipe(folder: Path, model: Path, data: Path, run: str, samples: int) -> Path:
    quantization: dict = {"op_types": ["MatMul"]}
    if run == "qtool-int4":
        quantization["weights"] = {"bits": 4, "block_size": BLOCK}
    elif run == "qtool-int8-wo":
        quantization["activations"] = "float"
    recipe = {
        "model": {"onnx": str(model)},
        "inputs": {
            "input_ids": {"shape": [1, SEQUENCE], "dtype": "int64"},
            "position_ids": {"shape": [1, SEQUENCE], "dtype": "int64"},
        },
        "calibration": {
            "data": {"npz": str(data)},
            "batch_size": 1,
            "max_samples": samples,
            "method": "minmax",
        },
        "quantization": quantization,
        "output": {"dir": str(folder / "out")},
    }
    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe, indent=1))  # JSON is YAML
    return path


def _ort_child(model: str, out: str) -> None:
    """Child: ORT's MatMulNBits quantizer, block 32, symmetric RTN, saved with external data."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=BLOCK, is_symmetric=True, op_types_to_quantize=("MatMul",)
    )
    quantizer = MatMulNBitsQuantizer(
        model,
        block_size=BLOCK,
        is_symmetric=True,
        op_types_to_quantize=("MatMul",),
        algo_config=config,
    )
    quantizer.process()
    quantizer.model.save_model_to_file(out, use_external_data_format=True)


def _folder_files(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run_one(run: str, model: Path, data: Path, work: Path, samples: int, timeout: float) -> dict:
    folder = work / run
    if folder.exists():
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    if run == "ort-matmulnbits":
        out = folder / "out" / "model.int4.onnx"
        out.parent.mkdir()
        cmd = [sys.executable, "-m", "benchmarks.llm_memory", "--ort-child", str(model), str(out)]
    else:
        recipe = _recipe(folder, model, data, run, samples)
        cmd = [sys.executable, "-m", "qtool.cli", "quantize", str(recipe), "--no-progress"]
    measured = run_measured(cmd, folder / "run.log", timeout, cwd=REPO)
    row = {"run": run, "cmd": cmd, **measured.to_dict()}
    row["outputs"] = _folder_files(folder / "out") if (folder / "out").is_dir() else {}
    return row


def run_existing(model: Path, recipes: list[Path], work: Path, timeout: float) -> list[dict]:
    """ORT's MatMulNBits quantizer on `model`, then `qtool quantize` on each recipe (into the
    work folder: `-o`), each measured in its own process."""
    rows = []
    folder = work / "ort-matmulnbits"
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    (folder / "out").mkdir(parents=True)
    out = folder / "out" / "model.int4.onnx"
    cmd = [sys.executable, "-m", "benchmarks.llm_memory", "--ort-child", str(model), str(out)]
    measured = run_measured(cmd, folder / "run.log", timeout, cwd=REPO)
    rows.append({"run": "ort-matmulnbits", "cmd": cmd, **measured.to_dict()})
    rows[-1]["outputs"] = _folder_files(folder / "out")
    for recipe in recipes:
        name = f"qtool {recipe.stem}"
        folder = work / recipe.stem
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.mkdir(parents=True)
        cmd = [sys.executable, "-m", "qtool.cli", "quantize", str(recipe), "--no-progress"]
        cmd += ["-o", str(folder / "out")]
        measured = run_measured(cmd, folder / "run.log", timeout, cwd=REPO)
        rows.append({"run": name, "cmd": cmd, **measured.to_dict()})
        out_dir = folder / "out"
        rows[-1]["outputs"] = _folder_files(out_dir) if out_dir.is_dir() else {}
        print(f"{name}: {measured.status}", file=sys.stderr, flush=True)
    return rows


def _model_bytes(model: Path) -> int:
    import onnx

    from qtool.model.external_data import external_files

    files = [model, *external_files(model, onnx.load(str(model), load_external_data=False))]
    return sum(f.stat().st_size for f in files)


def cpu_name() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")
    flags = sorted({f for f in ("avx512_vnni", "avx2") if f" {f}" in text})
    return (
        f"{name or platform.processor()} ({', '.join(flags) or 'no avx2'}), {os.cpu_count()} CPUs"
    )


def table(rows: list[dict], model_bytes: int) -> str:
    ort = next((r for r in rows if r["run"] == "ort-matmulnbits" and r["status"] == "ok"), None)
    lines = [
        "| run | status | wall s | CPU s | CPU / ORT | peak RSS GB | peak / FP32 file | "
        "peak / ORT | output folder |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = r["peak_mb"] * 2**20
        vs_ort = (
            (f"{r['cpu_s'] / ort['cpu_s']:.2f}x", f"{r['peak_mb'] / ort['peak_mb']:.2f}x")
            if ort
            else ("-", "-")
        )
        out = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in r["outputs"].items())
        lines.append(
            f"| {r['run']} | {r['status']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {vs_ort[0]} "
            f"| {peak / 1e9:.2f} | {peak / model_bytes:.2f}x | {vs_ort[1]} | {out} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.15, help="FP32 file size (1e9 bytes)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=4, help="calibration windows (W8A8)")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ort-child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--existing",
        nargs="+",
        type=Path,
        metavar=("MODEL", "RECIPE"),
        help="measure on an exported model and these recipes instead of a generated one",
    )
    args = parser.parse_args()
    if args.ort_child:
        _ort_child(*args.ort_child)
        return
    if args.existing:
        work = args.work or Path(tempfile.mkdtemp(prefix="qtool-llm-memory-"))
        model, recipes = args.existing[0].resolve(), [r.resolve() for r in args.existing[1:]]
        rows = run_existing(model, recipes, work, args.timeout)
        model_bytes = _model_bytes(model)
        print(f"model: {model} ({model_bytes / 1e9:.2f} GB)\nCPU: {cpu_name()}\n")
        print(table(rows, model_bytes))
        result = {"model_bytes": model_bytes, "model": str(model), "cpu": cpu_name(), "rows": rows}
        (args.json or work / "llm_memory.json").write_text(json.dumps(result, indent=2))
        return
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown[0]!r} (known: {', '.join(RUNS)})")
    work = args.work or Path(tempfile.mkdtemp(prefix="qtool-llm-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    layers = plan_layers(args.size_gb, args.hidden, args.intermediate, args.hidden // 4, args.vocab)
    model = work / "decoder.onnx"
    stamp = work / "decoder.json"
    spec = {
        "layers": layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "vocab": args.vocab,
        "seed": args.seed,
    }
    if not (model.exists() and stamp.exists() and json.loads(stamp.read_text()) == spec):
        write_decoder(
            work,
            layers=layers,
            hidden=args.hidden,
            inter=args.intermediate,
            vocab=args.vocab,
            seed=args.seed,
        )
        stamp.write_text(json.dumps(spec))
    data = write_data(work, args.vocab, max(args.samples, 4), args.seed)
    model_bytes = model.stat().st_size + (work / "decoder.onnx.data").stat().st_size
    rows = []
    for run in runs:
        rows.append(run_one(run, model, data, work, args.samples, args.timeout))
        print(f"{run}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    header = (
        f"model: {model_bytes / 1e9:.2f} GB FP32 ({layers} layers, hidden {args.hidden}, "
        f"intermediate {args.intermediate}, vocab {args.vocab}), work dir {work}\nCPU: {cpu_name()}"
    )
    print(header + "\n\n" + table(rows, model_bytes))
    result = {"model_bytes": model_bytes, "model": spec, "cpu": cpu_name(), "rows": rows}
    (args.json or work / "llm_memory.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
