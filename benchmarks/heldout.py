"""Held-out accuracy: every preset and algorithm set against plain min-max and ONNX Runtime's
quantize_static (and NNCF when asked), calibrated on one source and scored on rows of OTHER
sources that no tool saw (benchmarks/heldout_data.py), on three transformers:

- `minilm`: all-MiniLM-L6-v2 (real weights, `qtool[minilm]`), embedding cosine; the issue's
  target is cosine >= 0.995 at <= 25 MB (int8 tables);
- `swin`: a small Swin classifier with seeded random weights (benchmarks/heldout_models.py),
  logits SQNR;
- `decoder`: a small Llama-style decoder with seeded random weights, exported with
  past_key_values, one decode step of 16 tokens after 16 cached ones, logits SQNR.

qtool rows run the CLI (`qtool quantize RECIPE`) in a subprocess, so `--qtool-path` can point at
another checkout (e.g. main, for the figures before a change). Recipes have no evaluation
section: quantize never reads the held-out rows, and its model-level comparison scores output
SQNR on its tuning rows (a split of the calibration set). Every model is scored here against
the same float model on every held-out source: fused (ORT_ENABLE_ALL, what deploys) and unfused
(ORT_DISABLE_ALL, the QDQ semantics).

    python -m benchmarks.heldout --cases swin,decoder
    python -m benchmarks.heldout --cases minilm --peers nncf --peer-root PATH
    python -m benchmarks.heldout --render benchmarks/results/heldout.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from benchmarks import heldout_data, heldout_models
from benchmarks.accuracy import cpu_flags, run_ort, versions
from qtool.config import presets
from qtool.data.batches import Batch, iter_batches
from qtool.data.spec import DataSpec, InputSpec
from qtool.metrics.signal import SignalQuality, json_float
from qtool.ort.sessions import create_session

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DATA = Path(heldout_data.__file__).resolve()


@dataclass(frozen=True)
class Case:
    """One model: how a recipe names it, its inputs, its calibration entry point, its held-out
    sources, and the op types of its plain min-max and ORT rows."""

    model: dict
    inputs: dict
    calibration: str  # a function of heldout_data.py
    heldout: Callable[[], dict[str, dict[str, np.ndarray]]]
    op_types: tuple[str, ...]
    metric: str  # what the table leads with: cosine or sqnr
    tuning: str  # a function of heldout_data.py: the rows' separate `tuning.data`
    # The qtool rows run without --rows (None: every row); MiniLM's exports and passes take
    # minutes each, so it runs the rows the targets name.
    default_rows: tuple[str, ...] | None = None


def _decoder_inputs() -> dict:
    names, _ = heldout_models.decoder_io()
    past = [1, heldout_models.KV_HEADS, heldout_models.PAST, heldout_models.HEAD_DIM]
    inputs: dict = {
        "input_ids": {"shape": [1, heldout_models.NEW], "dtype": "int64"},
        "attention_mask": {
            "shape": [1, heldout_models.PAST + heldout_models.NEW],
            "dtype": "int64",
        },
        "position_ids": {"shape": [1, heldout_models.NEW], "dtype": "int64"},
    }
    inputs.update({name: past for name in names[3:]})
    return inputs


MINILM_ROWS = (
    "minmax",
    "int8-transformer",
    "int8-transformer+objective-layer",
    "int8-transformer+no-comparison",
    "int8-transformer+tuning-data",
)


def cases(work: Path) -> dict[str, Case]:
    minilm_model = {"pytorch": str(REPO / "examples/minilm/model.py") + ":make_model", "opset": 17}
    return {
        "minilm": Case(
            minilm_model,
            {
                "input_ids": {"shape": [1, 128], "dtype": "int64"},
                "attention_mask": {"shape": [1, 128], "dtype": "int64"},
            },
            "minilm_calibration",
            heldout_data.minilm_heldout,
            ("MatMul", "Gemm", "Gather"),
            "cosine",
            "minilm_tuning",
            MINILM_ROWS,
        ),
        "swin": Case(
            {"onnx": str(work / "swin" / "swin.onnx")},
            {"pixel_values": [1, 3, heldout_models.IMAGE, heldout_models.IMAGE]},
            "swin_calibration",
            heldout_data.swin_heldout,
            ("MatMul", "Gemm"),
            "sqnr",
            "swin_tuning",
        ),
        "decoder": Case(
            {"onnx": str(work / "decoder" / "decoder.onnx")},
            _decoder_inputs(),
            "decoder_calibration",
            heldout_data.decoder_heldout,
            ("MatMul", "Gemm"),
            "sqnr",
            "decoder_tuning",
        ),
    }


# The qtool rows: plain min-max (the baseline every preset must not fall below), every shipped
# preset as a user would take it (`base: NAME`), and two views of the transformer preset: its
# SmoothQuant scored on the MatMuls' own outputs, and its model without the comparison with
# plain min-max (what its algorithms alone make).
EXTRA_ROWS = {
    "int8-transformer+objective-layer": {
        "base": "int8-transformer",
        "quantization": {"algorithms": {"smoothquant": {"objective": "layer"}}},
    },
    "int8-transformer+no-comparison": {
        "base": "int8-transformer",
        "tuning": {"baseline": "none"},
    },
    # NNCF's transformer pattern: the attention context MatMul (softmax(scores) V) kept float,
    # found by its role in the graph (qtool/plan/attention.py), not by its name.
    "int8-transformer+context-float": {
        "base": "int8-transformer",
        "quantization": {"overrides": [{"roles": ["attention-context"], "precision": "float"}]},
    },
    # The tool's discipline with a tuning set of its own, from a third source (TUNING: the
    # case's `*_tuning` entry point), instead of a split of the calibration source.
    "int8-transformer+tuning-data": {
        "base": "int8-transformer",
        "tuning": {"data": "TUNING"},
    },
}


def cpu_presets() -> list[str]:
    """The shipped presets for ONNX Runtime on CPU (the TensorRT ones hold FP8 and FP16 types
    this CPU's sessions do not run, and are judged by benchmarks/float_types.py)."""
    kept = []
    for name in presets.names():
        raw = yaml.safe_load((presets.FOLDER / f"{name}.yaml").read_text()) or {}
        if (raw.get("quantization") or {}).get("target", "ort-cpu") == "ort-cpu":
            kept.append(name)
    return kept


def qtool_rows(case: Case) -> dict[str, dict]:
    plain = {
        "calibration": {"method": "minmax"},
        "quantization": {"op_types": list(case.op_types)},
    }
    rows = {"minmax": plain}
    rows.update({name: {"base": name} for name in cpu_presets()})
    rows.update(EXTRA_ROWS)
    return rows


# What a recipe's `python:` data source names: qtool puts the file's folder first on sys.path,
# and benchmarks/ holds modules (kernels.py) that would shadow packages torch and transformers
# import, so the entry points are re-exported from a file in the work folder.
ENTRY_POINTS = f"""import sys

sys.path.insert(0, {str(REPO)!r})
from benchmarks.heldout_data import *  # noqa: F403
"""


def entry_file(folder: Path) -> Path:
    path = folder / "heldout_entry_points.py"
    path.write_text(ENTRY_POINTS)
    return path


def recipe_text(case: Case, row: dict, out: Path, data: Path) -> str:
    """The recipe of one row: the row's settings over the case's model, inputs and data
    (`data`: the entry-point file)."""
    recipe: dict = {k: v for k, v in row.items() if k == "base"}
    recipe.update({"seed": 0, "model": case.model, "inputs": case.inputs})
    calibration = {"data": {"python": f"{data}:{case.calibration}"}, "batch_size": 32}
    calibration.update(row.get("calibration", {}))
    recipe["calibration"] = calibration
    for key in ("quantization", "tuning"):
        if key in row:
            recipe[key] = dict(row[key])
    if recipe.get("tuning", {}).get("data") == "TUNING":
        recipe["tuning"]["data"] = {"python": f"{data}:{case.tuning}"}
    recipe["output"] = {"dir": str(out)}
    return yaml.safe_dump(recipe, sort_keys=False)


def run_qtool(case: Case, label: str, row: dict, folder: Path, qtool_path: Path | None) -> dict:
    """`qtool quantize` of the row's recipe in a subprocess (qtool from `qtool_path` if given)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    recipe = folder / "recipe.yaml"
    recipe.write_text(recipe_text(case, row, folder / "out", entry_file(folder)))
    env = dict(os.environ)
    if qtool_path is not None:
        env["PYTHONPATH"] = str(qtool_path)
    command = [sys.executable, "-c", "from qtool.cli import app; app()"]
    command += ["quantize", str(recipe), "--no-progress"]
    started = time.perf_counter()
    with open(folder / "quantize.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    run = {"quantizer": "qtool", "label": label, "wall_s": time.perf_counter() - started}
    if done.returncode != 0:
        lines = (folder / "quantize.log").read_text().strip().splitlines() or ["(no output)"]
        run["status"] = f"failed: {lines[-1][:200]}"
        return run
    report = json.loads((folder / "out" / "report.json").read_text())
    model = Path(report["files"]["quantized_model"])
    run.update(
        status="ok",
        model=str(model),
        fp32=report["files"]["float_model"],
        method=report["method"],
        algorithms={
            name: entry.get("applied")
            for name, entry in (report.get("algorithms") or {}).items()
            if isinstance(entry, dict)
        },
        model_choice=report.get("model_choice"),
    )
    smoothing = (report.get("algorithms") or {}).get("smoothquant")
    if smoothing is None and report.get("model_choice"):
        smoothing = (report["model_choice"].get("rejected_algorithms") or {}).get("smoothquant")
    if smoothing is not None:
        run["smoothquant"] = {
            "smoothed": smoothing["smoothed"],
            "inputs": smoothing["inputs"],
            "alphas": [layer["alpha"] for layer in smoothing["layers"]],
        }
    return run


def calibration_batches(case: Case) -> list[Batch]:
    """What every tool calibrates on: the case's calibration entry point, through qtool's reader."""
    spec = DataSpec("calibration.data", python=f"{DATA}:{case.calibration}")
    inputs = []
    for name, value in case.inputs.items():
        shape = value["shape"] if isinstance(value, dict) else value
        dtype = value.get("dtype", "float32") if isinstance(value, dict) else "float32"
        inputs.append(InputSpec(name, tuple(shape), dtype))
    return list(iter_batches(spec, tuple(inputs), 32))


def run_ort_row(case: Case, fp32: Path, folder: Path) -> dict:
    run: dict = {"quantizer": "ort", "label": "ORT quantize_static minmax"}
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        model = run_ort(
            fp32,
            calibration_batches(case),
            "minmax",
            list(case.op_types),
            folder,
            skip_symbolic_shape=True,  # its symbolic pass fails on the Swin and opset-21 graphs
        )
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        (folder / "error.txt").write_text(traceback.format_exc())
        return run
    run.update(status="ok", model=str(model), wall_s=time.perf_counter() - started)
    return run


def run_nncf_row(case: Case, fp32: Path, folder: Path, peer_root: Path) -> dict:
    """NNCF's transformer recipe (model_type TRANSFORMER) in its own venv (benchmarks/peers.py)."""
    from benchmarks.peer_runners._handoff import save_batches
    from benchmarks.peers import PEERS, peer_python, run_runner

    run: dict = {"quantizer": "nncf", "label": "NNCF, ModelType.TRANSFORMER"}
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "calibration.npz"
    save_batches(data, [b.inputs for b in calibration_batches(case)])
    try:
        python = peer_python(PEERS["nncf"], peer_root, 1800)
        model, info, wall = run_runner(
            PEERS["nncf"], python, fp32, data, folder, "transformer", 3600
        )
    except RuntimeError as exc:
        run["status"] = f"failed: {exc}"[:300]
        return run
    run.update(status="ok", model=str(model), wall_s=wall, versions=info.get("versions"))
    return run


class Reference:
    """The float model's outputs on every held-out source, computed once per case."""

    def __init__(self, fp32: Path, sources: dict[str, dict[str, np.ndarray]]) -> None:
        self.sources = sources
        session = create_session(fp32)
        self.output = session.get_outputs()[0].name
        self.values = {
            name: [session.run([self.output], feed)[0] for feed in _chunks(arrays)]
            for name, arrays in sources.items()
        }


def _chunks(arrays: dict[str, np.ndarray], size: int = 32):
    count = len(next(iter(arrays.values())))
    for start in range(0, count, size):
        yield {k: v[start : start + size] for k, v in arrays.items()}


def score(run: dict, reference: Reference) -> None:
    """Cosine (mean over samples) and SQNR of the first output, per source and over all."""
    model = Path(run["model"])
    sessions = {
        "fused": create_session(model, optimize=True),
        "unfused": create_session(model, optimize=False),
    }
    scores: dict = {}
    for variant, session in sessions.items():
        total = SignalQuality(cosine="rows")
        per_source = {}
        for name, arrays in reference.sources.items():
            quality = SignalQuality(cosine="rows")
            for feed, ref in zip(_chunks(arrays), reference.values[name], strict=True):
                quality.update(ref, session.run([reference.output], feed)[0])
            per_source[name] = {
                "cosine": quality.cosine(),
                "sqnr_db": json_float(quality.sqnr_db()),
            }
            total.merge(quality)
        scores[variant] = {
            "cosine": total.cosine(),
            "sqnr_db": json_float(total.sqnr_db()),
            "sources": per_source,
        }
    run["scores"] = scores
    size = model.stat().st_size
    data = model.parent / (model.name + ".data")
    run["size_bytes"] = size + (data.stat().st_size if data.is_file() else 0)


def scored(run: dict, reference: Reference) -> None:
    """`score`, a model ONNX Runtime cannot load or run being a failed row, not a stopped run."""
    try:
        score(run, reference)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = f"failed to score: {type(exc).__name__}: {exc}"[:300]


def run_case(name: str, case: Case, args, work: Path, record: Callable[[dict], None]) -> None:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    if "onnx" in case.model:
        heldout_models.export(name, Path(case.model["onnx"]))
    sources = case.heldout()
    reference: Reference | None = None
    fp32: Path | None = None
    rows = qtool_rows(case)
    wanted = args.rows or list(case.default_rows or rows)
    for label in wanted:
        if label not in rows:
            raise SystemExit(f"unknown row {label!r}; rows: {', '.join(rows)}")
        run = run_qtool(case, label, rows[label], folder / _slug(label), args.qtool_path)
        run["case"] = name
        if run["status"] == "ok":
            if fp32 is None:
                fp32 = Path(run["fp32"])
                reference = Reference(fp32, sources)
            scored(run, reference)
        record(run)
    if fp32 is None:
        return
    extra = []
    if "ort" in args.peers:
        extra.append(run_ort_row(case, fp32, folder / "ort"))
    if "nncf" in args.peers:
        extra.append(run_nncf_row(case, fp32, folder / "nncf", args.peer_root))
    for run in extra:
        run["case"] = name
        if run["status"] == "ok":
            scored(run, reference)
        record(run)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


# --------------------------------------------------------------------------- output


def markdown(report: dict) -> str:
    """One table per case: fused | unfused over all held-out sources, per-source fused."""
    lines = [
        f"CPU: {report['machine'].get('cpu', '?')} (flags: {', '.join(report['cpu_flags'])})",
        "",
    ]
    for name in dict.fromkeys(r["case"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["case"] == name]
        sources = next((list(r["scores"]["fused"]["sources"]) for r in runs if "scores" in r), [])
        head = ["row", "cosine fused \\| unfused", "SQNR dB fused \\| unfused", "size MB"]
        head += [f"{s} (cos / dB)" for s in sources] + ["kept", "SmoothQuant"]
        lines += [f"#### {name}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "---|" * len(head))
        for run in runs:
            if "scores" not in run:
                lines.append(f"| {run['label']} | {run.get('status')} |" + " |" * (len(head) - 2))
                continue
            f, u = run["scores"]["fused"], run["scores"]["unfused"]
            cells = [
                run["label"],
                f"{f['cosine']:.5f} \\| {u['cosine']:.5f}",
                f"{_db(f['sqnr_db'])} \\| {_db(u['sqnr_db'])}",
                f"{run['size_bytes'] / 1e6:.2f}",
            ]
            cells += [
                f"{f['sources'][s]['cosine']:.4f} / {_db(f['sources'][s]['sqnr_db'])}"
                for s in sources
            ]
            choice = run.get("model_choice")
            cells.append(choice["kept"] if choice else "")
            sq = run.get("smoothquant")
            cells.append(f"{sq['smoothed']}/{sq['inputs']} smoothed" if sq else "")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _db(value) -> str:
    return value if isinstance(value, str) else f"{value:.1f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="minilm,swin,decoder", help="comma list")
    p.add_argument("--rows", default=None, help="comma list of qtool rows (default: all)")
    p.add_argument("--peers", default="ort", help="comma list from ort, nncf ('' for none)")
    p.add_argument("--peer-root", type=Path, default=REPO / "benchmarks" / ".peers")
    p.add_argument("--qtool-path", type=Path, default=None, help="a checkout to take qtool from")
    p.add_argument("--json", type=Path, default=RESULTS / "heldout.json")
    p.add_argument("--work", type=Path, default=RESULTS / "heldout")
    p.add_argument("--render", type=Path, nargs="*", default=None, help="print JSON as markdown")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.rows = [r for r in args.rows.split(",") if r] if args.rows else None
    args.peers = [p for p in args.peers.split(",") if p]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        for path in args.render:
            print(markdown(json.loads(path.read_text())))
        return 0
    from benchmarks.calibration import save_json

    work = args.work.resolve()
    all_cases = cases(work)
    info = versions()
    report = {
        "command": " ".join(["python -m benchmarks.heldout", *(argv or sys.argv[1:])]),
        "machine": info,
        "cpu_flags": cpu_flags(),
        "qtool_path": str(args.qtool_path or REPO),
        "runs": [],
    }

    def record(run: dict) -> None:
        report["runs"].append(run)
        save_json(report, args.json)
        scores = run.get("scores", {}).get("fused")
        shown = (
            f"cosine {scores['cosine']:.5f}  SQNR {_db(scores['sqnr_db'])} dB  "
            f"{run['size_bytes'] / 1e6:.2f} MB"
            if scores
            else run.get("status")
        )
        print(f"{run['case']:8s} {run['label']:40s} {shown}", flush=True)

    for name in args.cases:
        run_case(name, all_cases[name], args, work, record)
    print(markdown(report))
    return 0 if all(r.get("status") == "ok" for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
