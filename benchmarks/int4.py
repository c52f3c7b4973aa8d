"""INT4 benchmark: qtool's weight-only INT4 (each scale method) vs ONNX Runtime's own INT4 tool.

One run, per model (MiniLM from examples/minilm with its real weights and data; the random-weight
benchmark encoder of calibration.py), all from the same FP32 graph (the `model.fp32.onnx` that
`qtool quantize` writes: qtool's prepared graph at opset 21), block size 32 everywhere:

- rows: `qtool quantize` with `quantization.weights.method` minmax / mse / gptq, symmetric and
  asymmetric, the embedding tables float or quantized (int4 or int8); and
  `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` with its default
  (round-to-nearest) config, HQQ, and GPTQ;
- columns: output cosine (and SQNR) to FP32 on the evaluation rows, computed as `qtool evaluate`
  computes it (qtool.metrics.signal.SignalQuality); file size; quantize wall time, CPU seconds
  and peak
  RSS (each quantizer in its own process, benchmarks/_measure.run_measured); the MatMulNBits
  accuracy level ORT actually runs; latency at batch 1 and 8, one thread and ORT's default
  threads (median, interleaved rounds, the same session options for every model).

Every quantizer runs as a child process so that its time and memory are its own; the ORT child
(`python -m benchmarks.int4 ort-quantize ...`) and the measuring child (`... measure ...`) import
neither torch nor the rest of this benchmark, which is why this module keeps its top-level
imports to the standard library. See benchmarks/README.md.

    python -m benchmarks.int4 --quick          # smoke run, a few minutes
    python -m benchmarks.int4 --models minilm  # the MiniLM table of the README
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks._measure import _batches, run_measured

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BLOCK_SIZE = 32
QTOOL_METHODS = ("minmax", "mse", "gptq")
TABLES = ("float", "int4", "int8")
# ORT's configurations: its default (RTN, `is_symmetric` as the row says), the same with
# accuracy_level=4 written on the node (the int8 compute VNNI CPUs run fast; qtool writes its
# MatMulNBits nodes with the level `accuracy_level_for` picks for this CPU),
# HQQ (asymmetric only: float zero points) and GPTQ (the vendored neural-compressor code).
ORT_ALGOS = ("default", "default-al4", "hqq", "gptq")
MODELS = ("minilm", "bert")
SHIPPED_RECIPE = REPO / "examples" / "minilm" / "recipe-int4.yaml"
LATENCY_BATCHES = (1, 8)
# Op types read from the graph ORT optimizes: what actually runs the 4-bit weights.
KERNEL_OPS = ("MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMul", "Gather")


@dataclass(frozen=True)
class Row:
    """One quantized model: which tool, scale method, symmetry, and the embedding tables."""

    tool: str  # "qtool" | "ort"
    # qtool: minmax | mse | gptq, or "recipe" (examples/minilm/recipe-int4.yaml's quantization);
    # ort: default | default-al4 | hqq | gptq
    method: str
    symmetric: bool
    table: str  # "float" | "int4" | "int8" (Gather data)
    # Measured with session config session.qdq_matmulnbits_accuracy_level set to this (a qtool
    # model measured a second time: same file, the compute ORT's own tool's models use).
    level: int | None = None

    @property
    def tag(self) -> str:
        tag = f"{self.tool}-{self.method}-{'sym' if self.symmetric else 'asym'}-{self.table}"
        return tag if self.level is None else f"{tag}-level{self.level}"

    @property
    def layout(self) -> str:
        """Rows with the same layout write the same graph with other weight values: qtool's
        scale methods change values only (same MatMulNBits / GatherBlockQuantized nodes, same
        zero-point presence). Latency is measured once per layout unless --latency-every-row."""
        if self.tool == "qtool" and self.method in QTOOL_METHODS and self.level is None:
            return f"qtool-*-{'sym' if self.symmetric else 'asym'}-{self.table}"
        return self.tag


def build_rows(
    methods,
    symmetric,
    tables,
    ort_algos,
    table_methods=("minmax", "mse"),
    asym_tables: bool = False,
    recipe: bool = False,
    level1: bool = False,
) -> list[Row]:
    """The qtool grid: method x symmetry with float tables; quantized tables with
    `table_methods` (GPTQ costs a calibration pass per row, and the shipped recipe row is GPTQ
    with int8 tables), symmetric only unless `asym_tables` (8-bit tables are asymmetric
    whatever the setting). The shipped recipe. With `level1`, the symmetric minmax and the
    recipe models measured again at MatMulNBits accuracy level 1 (fp32 compute, what ORT's tool's
    models run at). Then the ORT rows its tool can make: ORT quantizes Gather to 4 bits only
    and not with HQQ; HQQ has no symmetric form; GPTQ (17 minutes per run here, see README)
    runs symmetric with float tables only."""
    rows = [
        Row("qtool", m, s, t)
        for t in tables
        for m in methods
        for s in symmetric
        if t == "float" or ((s or asym_tables) and m in table_methods)
    ]
    if recipe:
        rows.append(Row("qtool", "recipe", False, "int8"))
    if level1:
        rows += [
            dataclasses.replace(r, level=1)
            for r in rows
            if (r.method, r.symmetric, r.table)
            in (("minmax", True, "float"), ("recipe", False, "int8"))
        ]
    for algo in ort_algos:
        if algo == "default":
            rows += [
                Row("ort", algo, s, t) for t in tables if t in ("float", "int4") for s in symmetric
            ]
        elif algo == "default-al4":
            rows += [Row("ort", algo, True, "float")]
        elif algo == "hqq":
            rows += [Row("ort", algo, False, "float")]
        elif algo == "gptq":
            rows += [Row("ort", algo, True, "float")]
    return rows


# --------------------------------------------------------------------------- the models


@dataclass
class Source:
    """A model to quantize: the recipe its data comes from, the common FP32 graph, and the
    calibration / evaluation samples as .npz (the ORT and measuring children read those)."""

    name: str
    recipe: object  # qtool.config.recipe.Recipe (imported lazily)
    fp32: Path
    calibration_npz: Path
    evaluation_npz: Path
    evaluation_samples: int
    fp32_sha256: str = ""


def _int4_spec(recipe):
    """The recipe's quantization with INT4 block-32 weights on MatMul/Gemm/Gather: prepare()
    then upgrades the graph to opset 21, as every INT4 `qtool quantize` run does."""
    from qtool.plan.settings import WeightSettings

    return dataclasses.replace(
        recipe.quantization,
        op_types=("MatMul", "Gemm", "Gather"),
        weights=WeightSettings(bits=4, block_size=BLOCK_SIZE),
    )


def _save_npz(path: Path, batches: list[dict], limit: int | None = None) -> int:
    import numpy as np

    arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    if limit is not None:
        arrays = {k: v[:limit] for k, v in arrays.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return len(next(iter(arrays.values())))


def make_source(name: str, work: Path, eval_limit: int | None) -> Source:
    """Export (MiniLM: PyTorch; encoder: calibration.py's ONNX) and prepare the FP32 graph once,
    and write the samples every side reads."""
    from qtool.app.common import prepare
    from qtool.config.recipe import load_recipe
    from qtool.data.batches import iter_batches

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    if name == "minilm":
        recipe = load_recipe(REPO / "examples" / "minilm" / "recipe.yaml", folder / "base")
        spec = recipe.evaluation
        batches = iter_batches(spec.data, recipe.inputs, spec.batch_size, None, recipe.seed)
        evaluation = [b.inputs for b in batches]
    else:
        from benchmarks.calibration import write_calibration_data, write_recipe
        from benchmarks.models import build_bert, calibration_inputs

        model = build_bert(work / "models", small=False)
        data = write_calibration_data(model, [64], folder)[64]
        recipe = load_recipe(write_recipe(model, data, "minmax", folder / "base"))
        held_out = calibration_inputs(model, 32, seed=1)  # not the calibration draw (seed 1234)

        evaluation = [held_out]
    cal = recipe.calibration
    calibration = list(
        iter_batches(cal.data, recipe.inputs, cal.batch_size, cal.max_samples, recipe.seed)
    )
    calibration_npz = folder / "calibration.npz"
    _save_npz(calibration_npz, [b.inputs for b in calibration])
    evaluation_npz = folder / "evaluation.npz"
    samples = _save_npz(evaluation_npz, evaluation, eval_limit)
    prepared = prepare(dataclasses.replace(recipe, quantization=_int4_spec(recipe)))
    fp32 = folder / "model.fp32.onnx"
    fp32.write_bytes(prepared.model.serialized)
    return Source(
        name, recipe, fp32, calibration_npz, evaluation_npz, samples, prepared.model.fingerprint
    )


# --------------------------------------------------------------------------- quantizers


def qtool_recipe(source: Source, row: Row, folder: Path) -> Path:
    """A standalone recipe (absolute paths) for one qtool row, starting from the common FP32."""
    import yaml

    recipe = source.recipe
    data = recipe.calibration.data
    data_yaml = {"python": data.python} if data.kind == "python" else {"npz": str(data.npz)}
    quantization: dict = {
        "target": "ort-cpu",
        "op_types": ["MatMul", "Gemm"] + ([] if row.table == "float" else ["Gather"]),
        "weights": {
            "bits": 4,
            "block_size": BLOCK_SIZE,
            "method": row.method,
            "symmetric": row.symmetric,
        },
    }
    if row.table == "int8":
        quantization["overrides"] = [{"op_types": ["Gather"], "precision": "int8"}]
    if row.method == "recipe":  # the shipped INT4 recipe's settings, as written there
        shipped = yaml.safe_load(SHIPPED_RECIPE.read_text())["quantization"]
        quantization = {"target": "ort-cpu", **shipped}
    text = {
        "seed": recipe.seed,
        "model": {"onnx": str(source.fp32)},
        "inputs": {i.name: {"shape": list(i.shape), "dtype": i.dtype} for i in recipe.inputs},
        "calibration": {
            "data": data_yaml,
            "batch_size": recipe.calibration.batch_size,
            "method": "minmax",  # weight-only: no activation ranges are used
        },
        "quantization": quantization,
        "output": {"dir": str(folder / "out")},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(text, sort_keys=False))
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_quantizer(source: Source, row: Row, folder: Path, timeout: float) -> dict:
    """One row's quantizer in its own measured process; the model it wrote, or why not."""
    from benchmarks.calibration import qtool_command

    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's model must never count
    folder.mkdir(parents=True)
    if row.tool == "qtool":
        cmd = [
            *qtool_command(),
            "quantize",
            str(qtool_recipe(source, row, folder)),
            "--no-progress",
        ]
        out = folder / "out" / "model.int4.onnx"
    else:
        out = folder / "model.int4.onnx"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.int4",
            "ort-quantize",
            "--model",
            str(source.fp32),
            "--out",
            str(out),
            "--algo",
            row.method,
            "--data",
            str(source.calibration_npz),
            "--batch-size",
            str(source.recipe.calibration.batch_size),
        ]
        cmd += ["--symmetric"] if row.symmetric else []
        cmd += ["--gather"] if row.table != "float" else []
    m = run_measured(cmd, folder / "quantize.log", timeout, cwd=REPO)
    result = {**m.to_dict(), "cmd": cmd, "model": str(out)}
    if m.ok and not out.exists():
        result["status"] = f"failed: exited 0 but wrote no {out.name}"
    if result["status"] == "ok":
        result["size_bytes"] = out.stat().st_size
        if row.tool == "qtool":
            # qtool re-prepares the FP32 it is given; the row's own float model must be the
            # common one, or the rows do not start from the same graph.
            own = folder / "out" / "model.fp32.onnx"
            result["same_fp32"] = own.exists() and _sha256(own) == source.fp32_sha256
            own.unlink(missing_ok=True)  # 90 MB per row, identical to the common file
            report = json.loads((folder / "out" / "report.json").read_text())
            result["low_bit"] = report.get("low_bit")
    return result


def _ort_quantize(args: argparse.Namespace) -> None:
    """Child: MatMulNBitsQuantizer at block 32 on the common FP32, in ORT's QOperator format
    (MatMulNBits / GatherBlockQuantized written directly), every other option at its default."""
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        GPTQWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    class Reader(CalibrationDataReader):
        """Index-based so that the deep copy ORT's GPTQ makes of it starts from the top."""

        def __init__(self, batches: list[dict]) -> None:
            self.batches, self.index = batches, 0

        def get_next(self) -> dict | None:
            if self.index >= len(self.batches):
                return None
            self.index += 1
            return self.batches[self.index - 1]

    op_types = ("MatMul", "Gather") if args.gather else ("MatMul",)
    level = 4 if args.algo == "default-al4" else None
    if args.algo in ("default", "default-al4"):
        config = DefaultWeightOnlyQuantConfig(
            block_size=BLOCK_SIZE,
            is_symmetric=args.symmetric,
            accuracy_level=level,
            op_types_to_quantize=op_types,
        )
    elif args.algo == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=BLOCK_SIZE, op_types_to_quantize=op_types)
    else:
        reader = Reader(_batches(args.data, args.batch_size))
        config = GPTQWeightOnlyQuantConfig(
            calibration_data_reader=reader, op_types_to_quantize=op_types
        )
    quantizer = MatMulNBitsQuantizer(
        args.model,
        block_size=BLOCK_SIZE,
        is_symmetric=args.symmetric,
        accuracy_level=level,
        op_types_to_quantize=op_types,
        algo_config=config,
    )
    quantizer.process()
    tmp = Path(args.out).with_suffix(".tmp")
    quantizer.model.save_model_to_file(str(tmp), use_external_data_format=False)
    tmp.replace(args.out)


# --------------------------------------------------------------------------- measuring child


def _measure(args: argparse.Namespace) -> None:
    """Child: cosine/SQNR to FP32 over the evaluation samples (qtool evaluate's accumulator, the
    fused session: what deploys), what ORT runs the weights with, then latency.

    Latency, of the models in spec["latency_models"]: every session is created with qtool's
    create_session (the same options for all: ORT_ENABLE_ALL, sequential, the given intra-op
    threads, no session config, so MatMulNBits formed from QDQ would run at level 4), warmed
    up, then timed in interleaved rounds (a few runs of each model in turn) so that load from
    other processes hits all alike. A model that fails to load or run gets a `failed` entry; the
    others still run.
    """
    import numpy as np

    from qtool.metrics.signal import SignalQuality
    from qtool.ort.sessions import create_session
    from qtool.runtime.fusion import optimized_graph

    spec = json.loads(Path(args.spec).read_text())
    with np.load(spec["evaluation"]) as data:
        arrays = {k: data[k] for k in data.files}
    n = len(next(iter(arrays.values())))
    step = spec["eval_batch"]
    batches = [{k: v[i : i + step] for k, v in arrays.items()} for i in range(0, n, step)]
    models = {"fp32": spec["fp32"], **spec["models"]}
    results: dict = {}
    sessions = {}
    reference = None
    started = time.perf_counter()
    for tag, path in models.items():
        try:
            config = spec["configs"].get(tag)
            session = create_session(Path(path), config=config)
            outputs = [session.run(None, b)[0] for b in batches]
            graph = optimized_graph(Path(path), config=config)
        except Exception as exc:  # noqa: BLE001 - reported per model, the others still run
            results[tag] = {"status": f"failed: {type(exc).__name__}: {exc}".splitlines()[0]}
            continue
        ops = Counter(node.op_type for node in graph.graph.node)
        levels = Counter(
            next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            for node in graph.graph.node
            if node.op_type == "MatMulNBits"
        )
        entry = {
            "status": "ok",
            "ops": {op: ops[op] for op in KERNEL_OPS if ops[op]},
            "matmulnbits_accuracy_levels": {str(k): v for k, v in sorted(levels.items())},
        }
        if reference is None:
            reference = outputs
        else:
            quality = SignalQuality(cosine="rows")
            for ref, got in zip(reference, outputs, strict=True):
                quality.update(ref, got)
            entry.update(cosine=quality.cosine(), sqnr_db=quality.sqnr_db(), samples=quality.rows)
        results[tag] = entry
        if tag in spec["latency_models"]:
            sessions[tag] = session  # ORT's default threads, reused for that latency setting
        del session
    if "fp32" not in sessions:
        Path(args.json).write_text(json.dumps(results))
        return
    results["fp32"]["evaluation_phase_s"] = time.perf_counter() - started
    latency = spec["latency"]
    for threads in latency["threads"]:  # None: ORT's default (one per physical core)
        if threads is not None:
            tags = list(sessions)
            sessions = {}  # the previous setting's sessions go before the new ones load
            sessions = {
                tag: create_session(
                    Path(models[tag]), threads=threads, config=spec["configs"].get(tag)
                )
                for tag in tags
            }
        label = "default" if threads is None else str(threads)
        for batch in LATENCY_BATCHES:
            feed = {k: np.ascontiguousarray(v[:batch]) for k, v in arrays.items()}
            if len(next(iter(feed.values()))) < batch:
                continue
            runs = latency["runs"][str(batch)]
            per_round = max(1, runs // latency["rounds"])
            for session in sessions.values():
                for _ in range(latency["warmup"]):
                    session.run(None, feed)
            times: dict[str, list[float]] = {tag: [] for tag in sessions}
            for _ in range(latency["rounds"]):
                for tag, session in sessions.items():
                    for _ in range(per_round):
                        t0 = time.perf_counter()
                        session.run(None, feed)
                        times[tag].append((time.perf_counter() - t0) * 1e3)
            for tag, values in times.items():
                results[tag].setdefault("latency", {})[f"b{batch}/t{label}"] = {
                    "median_ms": float(np.median(values)),
                    "p90_ms": float(np.percentile(values, 90)),
                    "runs": len(values),
                }
    results["fp32"]["measure_phase_s"] = time.perf_counter() - started
    Path(args.json).write_text(json.dumps(results))


def measure_models(
    source: Source, quantized: dict[str, str], configs: dict, timed: list[str], args, folder: Path
) -> dict:
    """Run the measuring child over the FP32 and every quantized model of one source (with the
    session config in `configs` for a tag that has one); latency of FP32 and `timed`."""
    spec = {
        "fp32": str(source.fp32),
        "models": quantized,
        "configs": configs,
        "latency_models": ["fp32", *timed],
        "evaluation": str(source.evaluation_npz),
        "eval_batch": 32,
        "latency": {
            "threads": [None, 1],
            "runs": {"1": args.runs_b1, "8": args.runs_b8},
            "rounds": args.rounds,
            "warmup": args.warmup,
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, out = folder / "measure.spec.json", folder / "measure.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.int4", "measure", "--spec", str(spec_path)]
    m = run_measured([*cmd, "--json", str(out)], folder / "measure.log", args.timeout, cwd=REPO)
    if not m.ok or not out.exists():
        reason = m.status if not m.ok else "failed: wrote no measure.json"
        return {tag: {"status": f"measure {reason}"} for tag in ["fp32", *quantized]}
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- the table


def _latency_cell(entry: dict, fp32: dict, key: str) -> str:
    got = entry.get("latency", {}).get(key)
    ref = fp32.get("latency", {}).get(key)
    if got is None:
        return "-"
    if ref is None or entry is fp32:
        return f"{got['median_ms']:.1f}"
    return f"{got['median_ms']:.1f} ({ref['median_ms'] / got['median_ms']:.2f}x)"


def speed_verdict(entry: dict, fp32: dict) -> tuple[str, dict]:
    """'yes' when every latency setting beats FP32 by more than 5%, 'no' when none does, else
    'mixed'; a 5% band because the machine is shared (the speed-ups themselves are in the row)."""
    ups = {}
    for key, got in entry.get("latency", {}).items():
        ref = fp32.get("latency", {}).get(key)
        if ref:
            ups[key] = ref["median_ms"] / got["median_ms"]
    if not ups:
        return "-", ups
    faster = [k for k, v in ups.items() if v > 1.05]
    if len(faster) == len(ups):
        return "yes", ups
    if not faster:
        return "no", ups
    return "mixed (faster: " + ", ".join(faster) + ")", ups


def _kernels_cell(entry: dict) -> str:
    ops = entry.get("ops", {})
    levels = entry.get("matmulnbits_accuracy_levels", {})
    parts = []
    if ops.get("MatMulNBits"):
        level = "/".join(f"{k}" for k in levels) or "?"
        parts.append(f"{ops['MatMulNBits']} MatMulNBits @{level}")
    if ops.get("GatherBlockQuantized"):
        parts.append(f"{ops['GatherBlockQuantized']} GatherBQ")
    if ops.get("DequantizeLinear"):
        parts.append(f"{ops['DequantizeLinear']} DQ")
    return ", ".join(parts) or "float"


def _describe(row: Row) -> tuple[str, str, str]:
    tool = "qtool" if row.tool == "qtool" else "ORT MatMulNBitsQuantizer"
    method = {
        "default": "default (RTN)",
        "default-al4": "default (RTN), accuracy_level=4",
        "hqq": "HQQ",
        "recipe": "examples/minilm/recipe-int4.yaml",
    }.get(row.method, row.method)
    if row.level is not None:
        method += f", session accuracy level {row.level}"
    table = {"float": "float", "int4": "int4", "int8": "int8 (asym)"}[row.table]
    return tool, method, table


def markdown_table(model: dict) -> str:
    """README-ready: one line per model, failures as `failed` (the reason is listed below)."""
    keys = [f"b{b}/t{t}" for b in LATENCY_BATCHES for t in ("1", "default")]
    head = (
        "| tool | method | sym | embedding table | cosine | SQNR dB | size MB | quantize s (CPU s) "
        "| peak MB | kernels (MatMulNBits @accuracy level) | "
        + " | ".join(f"batch {k.split('/')[0][1:]}, {k.split('/t')[1]} thr ms" for k in keys)
        + " | faster than FP32 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    measured = model["measured"]
    fp32 = measured.get("fp32", {})
    size = model["fp32_size_bytes"] / 1e6
    cells = ["FP32", "-", "-", "float", "1.00000", "inf", f"{size:.1f}", "-", "-"]
    cells += [_kernels_cell(fp32)] + [_latency_cell(fp32, fp32, k) for k in keys] + ["-"]
    lines.append("| " + " | ".join(cells) + " |")
    for r in model["rows"]:
        row = Row(**r["row"])
        tool, method, table = _describe(row)
        q, e = r["quantize"], measured.get(row.tag, {})
        sym = "yes" if row.symmetric else "no"
        if q["status"] != "ok" or e.get("status") != "ok":
            cells = [tool, method, sym, table] + ["failed"] + ["-"] * (len(keys) + 6)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        verdict, _ = speed_verdict(e, fp32)
        cells = [
            tool,
            method,
            sym,
            table,
            f"{e['cosine']:.5f}",
            f"{e['sqnr_db']:.2f}",
            f"{q['size_bytes'] / 1e6:.1f}",
            f"{q['wall_s']:.1f} ({q['cpu_s']:.1f})",
            f"{q['peak_mb']:.0f}",
            _kernels_cell(e),
        ]
        cells += [_latency_cell(e, fp32, k) for k in keys] + [verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison(model: dict) -> list[str]:
    """Best qtool row against best ORT row on each axis, whichever side wins."""
    measured = model["measured"]
    ok = [
        (Row(**r["row"]), r["quantize"], measured[Row(**r["row"]).tag])
        for r in model["rows"]
        if r["quantize"]["status"] == "ok"
        and measured.get(Row(**r["row"]).tag, {}).get("status") == "ok"
    ]
    fp32 = measured.get("fp32", {})
    axes = {
        "cosine (higher is better)": (lambda q, e: e["cosine"], max, "{:.5f}"),
        "size MB": (lambda q, e: q["size_bytes"] / 1e6, min, "{:.1f}"),
        "quantize wall s": (lambda q, e: q["wall_s"], min, "{:.1f}"),
        "peak MB": (lambda q, e: q["peak_mb"], min, "{:.0f}"),
    }
    for key in fp32.get("latency", {}):
        axes[f"latency {key} ms"] = (
            lambda q, e, key=key: e.get("latency", {}).get(key, {}).get("median_ms", float("inf")),
            min,
            "{:.1f}",
        )
    lines = []
    for name, (value, pick, fmt) in axes.items():
        best = {}
        for tool in ("qtool", "ort"):
            side = [(value(q, e), row) for row, q, e in ok if row.tool == tool]
            if side:
                best[tool] = pick(side, key=lambda x: x[0])
        if len(best) < 2:
            continue
        (qv, qr), (ov, orow) = best["qtool"], best["ort"]
        if fmt.format(qv) == fmt.format(ov):
            winner = "tie at this precision"
        else:
            winner = "qtool" if pick(qv, ov) == qv else "ORT"
        lines.append(
            f"- {name}: best qtool {fmt.format(qv)} ({qr.tag}), best ORT {fmt.format(ov)} "
            f"({orow.tag}): **{winner}**"
        )
    return lines


def print_report(report: dict) -> None:
    cpu = report["machine"]["cpu_features"]
    print(f"\nCPU: {cpu}; onnxruntime {report['machine']['onnxruntime']}")
    for name, model in report["models"].items():
        print(
            f"\n### {name}: block {BLOCK_SIZE}, cosine on {model['evaluation_samples']} "
            f"evaluation samples, latency median of {report['settings']['runs_b1']} (batch 1) / "
            f"{report['settings']['runs_b8']} (batch 8) runs\n"
        )
        print(markdown_table(model))
        print()
        for line in comparison(model):
            print(line)
        failures = [
            f"- {Row(**r['row']).tag}: quantize {r['quantize']['status']}; "
            f"measure {model['measured'].get(Row(**r['row']).tag, {}).get('status', '-')}"
            for r in model["rows"]
            if r["quantize"]["status"] != "ok"
            or model["measured"].get(Row(**r["row"]).tag, {}).get("status") != "ok"
        ]
        if failures:
            print("\nDid not run (logs under the work folder):")
            print("\n".join(failures))
        shared = sorted(
            {
                f"{Row(**r['row']).tag} as {e['latency_from']}"
                for r in model["rows"]
                if (e := model["measured"].get(Row(**r["row"]).tag, {})).get("latency_from")
            }
        )
        if shared:
            print(
                "\nLatency timed once per graph layout (scale methods change weight values, not "
                "the graph): " + "; ".join(shared)
            )
        different = [
            Row(**r["row"]).tag for r in model["rows"] if r["quantize"].get("same_fp32") is False
        ]
        if different:
            print(f"\nqtool re-prepared a different FP32 graph in: {', '.join(different)}")


# --------------------------------------------------------------------------- main


def _csv(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        if not set(items) <= set(choices):
            raise argparse.ArgumentTypeError(f"expected a comma list from {', '.join(choices)}")
        return items

    return parse


def _symmetry(text: str) -> list[bool]:
    names = {"sym": True, "asym": False}
    items = [x for x in text.split(",") if x]
    if not items or not set(items) <= set(names):
        raise argparse.ArgumentTypeError("expected a comma list from sym, asym")
    return [names[x] for x in items]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.int4",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=_csv(MODELS), default=list(MODELS))
    p.add_argument("--methods", type=_csv(QTOOL_METHODS), default=list(QTOOL_METHODS))
    p.add_argument("--symmetry", type=_symmetry, default=[True, False], help="sym,asym")
    p.add_argument("--tables", type=_csv(TABLES), default=list(TABLES))
    p.add_argument(
        "--ort",
        type=_csv(ORT_ALGOS),
        default=[a for a in ORT_ALGOS if a != "gptq"],
        help="ORT configurations; gptq is not in the default (17 minutes on MiniLM here)",
    )
    p.add_argument(
        "--table-methods",
        type=_csv(QTOOL_METHODS),
        default=["minmax", "mse"],
        help="qtool methods that also get rows with quantized tables",
    )
    p.add_argument(
        "--level1",
        action="store_true",
        help="also measure qtool models with the session's MatMulNBits accuracy level set to 1 "
        "(changes only nodes ORT forms from QDQ: qtool's ort-cpu models carry the level already)",
    )
    p.add_argument(
        "--asym-tables", action="store_true", help="also asymmetric rows with quantized tables"
    )
    p.add_argument(
        "--no-recipe", action="store_true", help="no row for examples/minilm/recipe-int4.yaml"
    )
    p.add_argument(
        "--latency-every-row",
        action="store_true",
        help="time every model, not one per graph layout (qtool's scale methods share one)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few rows, samples and runs")
    p.add_argument("--eval-samples", type=int, default=None, help="first N evaluation samples")
    p.add_argument("--runs-b1", type=int, default=10, help="latency runs per model, batch 1")
    p.add_argument("--runs-b8", type=int, default=4, help="latency runs per model, batch 8")
    p.add_argument("--rounds", type=int, default=2, help="interleaved latency rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per model and setting")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    p.add_argument("--json", type=Path, default=RESULTS / "int4.json")
    p.add_argument("--work", type=Path, default=RESULTS / "int4", help="models, logs, recipes")
    args = p.parse_args(argv)
    if args.quick:
        args.models = [m for m in args.models if m == "minilm"] or args.models[:1]
        args.methods = [m for m in args.methods if m != "gptq"][:2] or args.methods[:1]
        args.symmetry = [True]
        args.tables = [t for t in args.tables if t in ("float", "int4")]
        args.ort = [a for a in args.ort if a in ("default", "hqq")]
        args.eval_samples = args.eval_samples or 16
        args.runs_b1, args.runs_b8, args.rounds = 4, 2, 2
        args.no_recipe = True
        args.level1 = False
    return args


def machine() -> dict:
    import onnxruntime

    from qtool.ort.cpu import detect_cpu

    return {
        "cpu_features": detect_cpu().describe(),
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
        "onnxruntime": onnxruntime.__version__,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.calibration import machine_info, save_json
    from qtool.ort.accuracy_level import ACCURACY_LEVEL_KEY

    work = args.work.resolve()
    report: dict = {
        "machine": {**machine_info(), **machine()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"block_size": BLOCK_SIZE},
        "models": {},
    }
    started = time.perf_counter()
    for name in args.models:
        print(f"[{name}] exporting and preparing the FP32 graph", file=sys.stderr)
        source = make_source(name, work, args.eval_samples)
        model: dict = {
            "fp32": str(source.fp32),
            "fp32_sha256": source.fp32_sha256,
            "fp32_size_bytes": source.fp32.stat().st_size,
            "evaluation_samples": source.evaluation_samples,
            "rows": [],
        }
        report["models"][name] = model
        rows = build_rows(
            args.methods,
            args.symmetry,
            args.tables,
            args.ort,
            table_methods=args.table_methods,
            asym_tables=args.asym_tables,
            recipe=name == "minilm" and not args.no_recipe,
            level1=args.level1,
        )
        for row in rows:
            t0 = time.perf_counter()
            if row.level is not None:  # the same file as its row, measured a second way
                base = dataclasses.replace(row, level=None)
                result = next(r["quantize"] for r in model["rows"] if Row(**r["row"]) == base)
                model["rows"].append({"row": dataclasses.asdict(row), "quantize": result})
                continue
            result = run_quantizer(source, row, work / name / "rows" / row.tag, args.timeout)
            print(
                f"[{name}] {row.tag}: {result['status']} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
            model["rows"].append({"row": dataclasses.asdict(row), "quantize": result})
            save_json(report, args.json)
        done = [Row(**r["row"]) for r in model["rows"] if r["quantize"]["status"] == "ok"]
        quantized = {
            Row(**r["row"]).tag: r["quantize"]["model"]
            for r in model["rows"]
            if r["quantize"]["status"] == "ok"
        }
        timed_by_layout: dict[str, str] = {}
        for row in done:
            timed_by_layout.setdefault(row.tag if args.latency_every_row else row.layout, row.tag)
        timed = list(timed_by_layout.values())
        print(
            f"[{name}] measuring {len(quantized)} models + FP32 (latency of {len(timed)})",
            file=sys.stderr,
        )
        configs = {
            row.tag: {ACCURACY_LEVEL_KEY: str(row.level)} for row in done if row.level is not None
        }
        model["measured"] = measure_models(source, quantized, configs, timed, args, work / name)
        for row in done:  # a row whose layout was timed on a sibling shows the sibling's numbers
            source_tag = timed_by_layout[row.tag if args.latency_every_row else row.layout]
            entry = model["measured"].get(row.tag, {})
            sibling = model["measured"].get(source_tag, {})
            if source_tag != row.tag and entry.get("status") == "ok" and "latency" in sibling:
                entry["latency"] = sibling["latency"]
                entry["latency_from"] = source_tag
        for r in model["rows"]:
            entry = model["measured"].get(Row(**r["row"]).tag, {})
            r["faster_than_fp32"], r["speedup"] = speed_verdict(
                entry, model["measured"].get("fp32", {})
            )
        save_json(report, args.json)
    report["machine"]["load_average_end"] = os.getloadavg()
    report["total_s"] = time.perf_counter() - started
    save_json(report, args.json)
    print_report(report)
    print(f"\nJSON: {args.json}  ({report['total_s']:.0f} s)")
    failed = any(
        r["quantize"]["status"] != "ok" for m in report["models"].values() for r in m["rows"]
    )
    return 1 if failed else 0


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int4")
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("ort-quantize")
    q.add_argument("--model", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--algo", choices=ORT_ALGOS, required=True)
    q.add_argument("--symmetric", action="store_true")
    q.add_argument("--gather", action="store_true")
    q.add_argument("--data", required=True)
    q.add_argument("--batch-size", type=int, default=32)
    q.set_defaults(fn=_ort_quantize)
    m = sub.add_parser("measure")
    m.add_argument("--spec", required=True)
    m.add_argument("--json", required=True)
    m.set_defaults(fn=_measure)
    args = p.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("ort-quantize", "measure"):
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(main())
