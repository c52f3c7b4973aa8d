"""LLM decoders, side by side: FP32 and the peer weight quantizers on the models of
benchmarks/llm_models.py, scored on held-out text (benchmarks/llm_text.py).

Rows (ROWS; `--rows` picks some):

* `fp32`: the exported float decoder itself.
* `ort-dynamic`: onnxruntime.quantization.quantize_dynamic, its defaults (int8 weights per
  tensor, dynamic uint8 activations, MatMuls with constant B only).
* `ort-rtn-sym`, `ort-rtn-asym`: MatMulNBitsQuantizer with DefaultWeightOnlyQuantConfig
  (round-to-nearest), 4-bit, block 32.
* `ort-hqq`: MatMulNBitsQuantizer with HQQWeightOnlyQuantConfig, 4-bit, block 32.
* `nncf-int4-sym`, `nncf-int4-asym`, `nncf-int8`: nncf.compress_weights in NNCF's own venv
  (benchmarks/peer_runners/run_nncf_wc.py; the venv is benchmarks/peers.py's `nncf` one).
* `nncf-int4-awq`: NNCF's data-aware 4-bit (symmetric: its asymmetric files do not load in
  ONNX Runtime 1.31): AWQ and scale estimation on the windows qtool calibrates on, at
  `int4-mixed-llm`'s ratio (the rest INT8 per channel), ranked by NNCF's own sensitivity
  metric: the peer of qtool's `int4-mixed-llm`.

Every quantizer runs in its own process through benchmarks/_measure.run_measured: wall seconds,
CPU seconds (user + system, its threads and children) and peak RSS (the kernel's ru_maxrss of
that process) are the quantize columns. Then one evaluation process (`python -m
benchmarks.llm_peers evaluate`) loads FP32 and every quantized model in ONNX Runtime's CPU
provider and, window by window, runs them all on the same held-out windows:

* perplexity: exp(mean NLL of every predicted token: window positions 0..n-2 predict 1..n-1);
* top-1 agreement: how often the model's argmax is FP32's argmax (same positions);
* KL: mean over predicted tokens of KL(FP32 || model) of the next-token distributions;
* latency per token at batch 1: a prompt of `--prompt` tokens (prefill, timed too), then
  `--decode` one-token steps fed the previous present as past_key_values (teacher-forced on the
  held-out text, so every model decodes the same tokens), in interleaved rounds.

Extension point, for qtool's rows (or any other tool): `register_row(Row(...))` with a function
that, given a RowContext (FP32 path, output path, calibration windows .npz, ...), returns the
command that writes the quantized model; the command is measured and the model scored like every
other row. `score_models(fp32, {label: path}, heldout)` scores models that already exist (no
quantize columns) and returns the same row dicts.

    python -m benchmarks.llm_peers --models smollm2-135m,gemma3-270m
    python -m benchmarks.llm_peers --models smollm2-135m --rows fp32,ort-rtn-sym --heldout 8

Importable without any peer installed: torch, transformers, onnx and onnxruntime are imported
inside the functions that use them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import llm_models, llm_text
from benchmarks._measure import run_measured

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
RUNNERS = REPO / "benchmarks" / "peer_runners"
BLOCK = 32
WINDOW = 512


# --------------------------------------------------------------------------- the arithmetic


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis, in float64 (the NLL and KL sums are over ~1e5 tokens)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclasses.dataclass
class TokenStats:
    """Running sums over predicted tokens: NLL of the labels, argmax agreement with FP32, KL;
    and each window's NLL and token count (`end_window`), for the interval over windows."""

    tokens: int = 0
    nll: float = 0.0
    agree: int = 0
    kl: float = 0.0
    window_nll: list[float] = dataclasses.field(default_factory=list)
    window_tokens: list[int] = dataclasses.field(default_factory=list)

    def end_window(self) -> None:
        """Close the window whose positions were added since the last call."""
        self.window_nll.append(self.nll - sum(self.window_nll))
        self.window_tokens.append(self.tokens - sum(self.window_tokens))

    def add(
        self, logp: np.ndarray, labels: np.ndarray, reference: np.ndarray | None = None
    ) -> None:
        """`logp` [positions, vocab] (log_softmax of the logits that predict `labels`
        [positions]); `reference`: FP32's log-probabilities at the same positions (None for FP32
        itself: agreement 1, KL 0)."""
        self.tokens += len(labels)
        self.nll -= float(logp[np.arange(len(labels)), labels].sum())
        if reference is None:
            self.agree += len(labels)
            return
        self.agree += int((logp.argmax(-1) == reference.argmax(-1)).sum())
        self.kl += float((np.exp(reference) * (reference - logp)).sum())

    def row(self) -> dict:
        if not self.tokens:
            raise ValueError("no token was scored")
        mean = self.nll / self.tokens
        return {
            "tokens": self.tokens,
            "nll": mean,
            "perplexity": float(np.exp(mean)),
            "top1_agreement": self.agree / self.tokens,
            "kl": self.kl / self.tokens,
            "window_nll": list(self.window_nll),
            "window_tokens": list(self.window_tokens),
        }


def ratio_interval(
    model_nll: Sequence[float],
    fp32_nll: Sequence[float],
    tokens: Sequence[int],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """The `level` interval of perplexity(model) / perplexity(FP32) over the windows, by a
    paired bootstrap (windows drawn with replacement, the same draw for both models).

    Why: a figure on 16 windows moves with the windows drawn (SmolLM2's `int4-llm` +8.4% on one
    draw of 16 fortunes windows, +8.9% on another), and a target missed or met by half a point
    means nothing without that spread. Pairing matters: the windows that are hard for FP32 are
    hard for the quantized model too, so the ratio varies far less than either perplexity."""
    model, base, count = (np.asarray(v, np.float64) for v in (model_nll, fp32_nll, tokens))
    if not (len(model) == len(base) == len(count)) or len(model) == 0:
        raise ValueError("one NLL and one token count per window, for both models")
    picks = np.random.default_rng(seed).integers(0, len(model), (resamples, len(model)))
    ratios = np.exp((model[picks].sum(1) - base[picks].sum(1)) / count[picks].sum(1))
    tail = (1.0 - level) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def window_logits(session: Any, window: np.ndarray, info: dict) -> np.ndarray:
    """Logits [length, vocab] of one window (batch 1, empty past)."""
    feed = llm_models.decoder_feed(window[None], llm_models.empty_past(info), 0)
    return session.run(["logits"], feed)[0][0]


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass(frozen=True)
class RowContext:
    """What a row's quantize command may use."""

    model: str  # llm_models key
    fp32: Path
    out: Path  # the quantized model to write
    folder: Path  # the row's own work folder (logs, result JSON)
    calibration: Path  # .npz: "windows" int64 [n, length] (calibration set), model's tokenizer
    tuning: Path  # .npz: the tuning set, same layout
    args: argparse.Namespace
    info: dict = dataclasses.field(default_factory=dict)  # llm_models.model_info of the model


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: a label, its settings, and the command that writes its model (None: FP32)."""

    name: str
    title: str
    tool: str
    settings: dict
    command: Callable[[RowContext], list[str]] | None = None
    # reads the JSON the command wrote (versions, settings, own CPU s): path in the row folder
    result_json: str | None = None


def _ort_command(tool: str) -> Callable[[RowContext], list[str]]:
    def command(ctx: RowContext) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.llm_peers",
            "quantize-ort",
            "--tool",
            tool,
            "--model",
            str(ctx.fp32),
            "--out",
            str(ctx.out),
        ]

    return command


def decoder_npz(windows: np.ndarray, info: dict, path: Path) -> Path:
    """Token windows [n, length] as qtool's npz data: every decoder input (empty pasts) and
    `labels` (the next token; -100 where none), so perplexity can be scored on it."""
    n, length = windows.shape
    arrays: dict[str, np.ndarray] = {
        "input_ids": windows.astype(np.int64),
        "attention_mask": np.ones((n, length), np.int64),
        "position_ids": np.broadcast_to(np.arange(length, dtype=np.int64), (n, length)).copy(),
        "labels": np.concatenate([windows[:, 1:], np.full((n, 1), -100)], axis=1).astype(np.int64),
    }
    empty = np.zeros((n, info["kv_heads"], 0, info["head_dim"]), np.float32)
    for i in range(info["layers"]):
        for kv in ("key", "value"):
            arrays[f"past_key_values.{i}.{kv}"] = empty
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def _nncf_command(mode: str, data_aware: bool = False) -> Callable[[RowContext], list[str]]:
    def command(ctx: RowContext) -> list[str]:
        from benchmarks.peers import PEERS, peer_python  # lazy: imports qtool and rich

        python = peer_python(PEERS["nncf"], ctx.args.peer_root, ctx.args.install_timeout)
        data = []
        if data_aware:  # the windows qtool calibrates on, as the decoder's inputs
            with np.load(ctx.calibration) as found:
                windows = found["windows"][: ctx.args.qtool_calibration]
            npz = decoder_npz(windows, ctx.info, ctx.folder / "calibration.npz")
            data = ["--data", str(npz), "--ratio", str(NNCF_RATIO)]
        return [
            str(python),
            str(RUNNERS / "run_nncf_wc.py"),
            "--model",
            str(ctx.fp32),
            "--out",
            str(ctx.out),
            "--mode",
            mode,
            "--group-size",
            str(BLOCK),
            "--result",
            str(ctx.folder / "runner.json"),
            *data,
        ]

    return command


def _preset_ratio(preset: str = "int4-mixed-llm") -> float:
    """The share of the 4-bit weights a preset keeps at 4 bits (its int8_fallback.ratio)."""
    import yaml

    from qtool.config.presets import FOLDER

    recipe = yaml.safe_load((FOLDER / f"{preset}.yaml").read_text())
    return float(recipe["quantization"]["algorithms"]["int8_fallback"]["ratio"])


# NNCF's data-aware row: the share of the 4-bit layers kept at 4 bits (the rest INT8_ASYM per
# channel, its backup mode), read from qtool's `int4-mixed-llm` so the two rows spend the same
# share of their weights on 8 bits.
NNCF_RATIO = _preset_ratio()

ROWS: dict[str, Row] = {}


def register_row(row: Row) -> None:
    """Add a row (qtool's rows are added this way); a name may be registered once."""
    if row.name in ROWS:
        raise ValueError(f"row {row.name!r} is already registered")
    ROWS[row.name] = row


for _row in (
    Row("fp32", "FP32", "torch.onnx", {"weights": "float32"}),
    Row(
        "ort-dynamic",
        "ORT quantize_dynamic",
        "onnxruntime",
        {
            "api": "quantize_dynamic",
            "weights": "int8 per tensor (QInt8)",
            "activations": "uint8 dynamic per tensor",
            "options": "ORT defaults (MatMulConstBOnly)",
        },
        _ort_command("dynamic"),
    ),
    Row(
        "ort-rtn-sym",
        "ORT MatMulNBits RTN sym",
        "onnxruntime",
        {
            "api": "MatMulNBitsQuantizer + DefaultWeightOnlyQuantConfig",
            "bits": 4,
            "block": BLOCK,
            "symmetric": True,
            "op_types": "MatMul",
        },
        _ort_command("rtn-sym"),
    ),
    Row(
        "ort-rtn-asym",
        "ORT MatMulNBits RTN asym",
        "onnxruntime",
        {
            "api": "MatMulNBitsQuantizer + DefaultWeightOnlyQuantConfig",
            "bits": 4,
            "block": BLOCK,
            "symmetric": False,
            "op_types": "MatMul",
        },
        _ort_command("rtn-asym"),
    ),
    Row(
        "ort-hqq",
        "ORT MatMulNBits HQQ",
        "onnxruntime",
        {
            "api": "MatMulNBitsQuantizer + HQQWeightOnlyQuantConfig",
            "bits": 4,
            "block": BLOCK,
            "symmetric": False,
            "op_types": "MatMul",
        },
        _ort_command("hqq"),
    ),
    Row(
        "nncf-int4-sym",
        "NNCF INT4 sym",
        "nncf",
        {"mode": "INT4_SYM", "group": BLOCK},
        _nncf_command("int4_sym"),
        "runner.json",
    ),
    Row(
        "nncf-int4-asym",
        "NNCF INT4 asym",
        "nncf",
        {"mode": "INT4_ASYM", "group": BLOCK},
        _nncf_command("int4_asym"),
        "runner.json",
    ),
    Row(
        "nncf-int4-awq",
        f"NNCF INT4 sym, data-aware (AWQ + scale estimation, ratio {NNCF_RATIO:g})",
        "nncf",
        {"mode": "INT4_SYM", "group": BLOCK, "ratio": NNCF_RATIO, "awq": True, "se": True},
        # symmetric: NNCF 3.4's asymmetric MatMulNBits files do not load in ONNX Runtime 1.31
        # ("zero_points initializer shape {576,18} does not match": one zero point a byte)
        _nncf_command("int4_sym", data_aware=True),
        "runner.json",
    ),
    Row(
        "nncf-int8",
        "NNCF INT8 asym",
        "nncf",
        {"mode": "INT8_ASYM", "group": "per channel"},
        _nncf_command("int8_asym"),
        "runner.json",
    ),
):
    register_row(_row)


def _quantize_ort(args: argparse.Namespace) -> None:
    """Child: one ONNX Runtime quantizer on the FP32 decoder (imports onnxruntime only)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    out = Path(args.out)
    if args.tool == "dynamic":
        quantize_dynamic(args.model, str(out), weight_type=QuantType.QInt8)
        return
    if args.tool in ("rtn-sym", "rtn-asym"):
        symmetric = args.tool == "rtn-sym"
        config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=symmetric)
    elif args.tool == "hqq":
        symmetric = False
        config = HQQWeightOnlyQuantConfig(block_size=BLOCK)
    else:
        raise ValueError(f"unknown ORT tool {args.tool!r}")
    quantizer = MatMulNBitsQuantizer(
        args.model, block_size=BLOCK, is_symmetric=symmetric, algo_config=config
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)


# --------------------------------------------------------------------------- scoring


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _chunks(length: int, size: int = 128) -> list[slice]:
    return [slice(i, min(i + size, length)) for i in range(0, length, size)]


def latency(
    sessions: dict[str, Any],
    info: dict,
    tokens: np.ndarray,
    prompt: int,
    decode: int,
    rounds: int,
    warmup: int = 4,
) -> dict[str, dict]:
    """Batch-1 prefill of `prompt` tokens then `decode` one-token steps with the KV cache, for
    every session, in `rounds` interleaved rounds (load from other processes hits all alike):
    median ms per decoded token and median prefill ms per model."""
    if len(tokens) < prompt + decode:
        raise ValueError(f"latency needs {prompt + decode} tokens, the window has {len(tokens)}")
    layers = info["layers"]
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in sessions}

    def run(session: Any, record: dict[str, list[float]] | None, steps: int) -> None:
        feed = llm_models.decoder_feed(tokens[None, :prompt], llm_models.empty_past(info), 0)
        started = time.perf_counter()
        outputs = session.run(None, feed)
        if record is not None:
            record["prefill"].append((time.perf_counter() - started) * 1e3)
        for step in range(steps):
            past = llm_models.next_past(outputs, layers)
            position = prompt + step
            feed = llm_models.decoder_feed(tokens[None, position : position + 1], past, position)
            started = time.perf_counter()
            outputs = session.run(None, feed)
            if record is not None:
                record["decode"].append((time.perf_counter() - started) * 1e3)

    for session in sessions.values():
        run(session, None, warmup)
    for _ in range(rounds):
        for label, session in sessions.items():
            run(session, times[label], decode)
    return {
        label: {
            "decode_ms_per_token": float(np.median(t["decode"])),
            "decode_p90_ms": float(np.percentile(t["decode"], 90)),
            "prefill_ms": float(np.median(t["prefill"])),
            "prompt_tokens": prompt,
            "decode_tokens": decode,
            "rounds": rounds,
        }
        for label, t in times.items()
    }


def _model_bytes(path: Path) -> int:
    """The model file plus any external-data files next to it that it names."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    locations = {
        entry.value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    return path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations)


def _kernel_ops(path: Path) -> dict[str, int]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    counted = (
        "MatMul",
        "MatMulNBits",
        "MatMulInteger",
        "DynamicQuantizeLinear",
        "DequantizeLinear",
        "Gather",
        "GatherBlockQuantized",
        "Gemm",
    )
    ops: dict[str, int] = {}
    for node in proto.graph.node:
        if node.op_type in counted:
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def score_models(
    fp32: Path,
    models: dict[str, Path],
    heldout: np.ndarray,
    info: dict,
    threads: int = 2,
    prompt: int = 128,
    decode: int = 32,
    rounds: int = 3,
    log: Callable[[str], None] = print,
    scratch: Path | None = None,
) -> dict[str, dict]:
    """Score FP32 and `models` ({label: path}) on the held-out windows [n, length]: one dict per
    label (perplexity, nll, tokens, top1_agreement and kl against FP32, size_bytes, kernel ops,
    latency). A model that fails to load or run gets `status: failed: ...`; the others go on.

    Memory: FP32's logits of every window are written once to `scratch` (float32 .npy files, a
    temporary folder by default) and read back while each model runs, one model session at a
    time next to FP32's. Holding every session and every model's logits at once (the first
    design) took 13 GB on Gemma 3 270M (262k-token vocabulary) and was killed by the kernel.
    Latency: each model is timed in rounds interleaved with FP32 (`latency_vs_fp32` is the
    ratio of those same rounds, robust to load that changes from one model to the next); FP32's
    own latency is the median over all its rounds."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=scratch, prefix="llm-fp32-logits-") as tmp:
        folder = Path(tmp)
        reference_session = _session(fp32, threads)
        rows: dict[str, dict] = {"fp32": {"status": "ok"}}
        stats = TokenStats()
        started = time.perf_counter()
        for w, window in enumerate(heldout):
            logits = window_logits(reference_session, window, info)[:-1]
            np.save(folder / f"{w}.npy", logits)
            for part in _chunks(len(logits)):
                stats.add(log_softmax(logits[part]), window[1:][part])
            stats.end_window()
        rows["fp32"].update(stats.row())
        log(f"  FP32: {len(heldout)} windows in {time.perf_counter() - started:.0f} s")
        fp32_times: list[dict] = []
        for label, path in models.items():
            rows[label] = _score_one(
                label,
                path,
                reference_session,
                folder,
                heldout,
                info,
                threads,
                (prompt, decode, rounds),
                fp32_times,
            )
            log(f"  {label}: {rows[label]['status']} ({time.perf_counter() - started:.0f} s)")
        if not fp32_times:  # no model to pair with: FP32 alone
            fp32_times.append(
                latency({"fp32": reference_session}, info, heldout[0], prompt, decode, rounds)[
                    "fp32"
                ]
            )
        rows["fp32"]["latency"] = {
            "decode_ms_per_token": float(np.median([t["decode_ms_per_token"] for t in fp32_times])),
            "prefill_ms": float(np.median([t["prefill_ms"] for t in fp32_times])),
            "prompt_tokens": prompt,
            "decode_tokens": decode,
            "rounds": rounds * len(fp32_times),
        }
    for label in models:
        if "window_nll" in rows[label]:
            rows[label]["vs_fp32_interval_90"] = ratio_interval(
                rows[label]["window_nll"], rows["fp32"]["window_nll"], rows["fp32"]["window_tokens"]
            )
    for label, path in {"fp32": fp32, **models}.items():
        if Path(path).is_file():
            rows[label]["size_bytes"] = _model_bytes(Path(path))
            rows[label]["kernel_ops"] = _kernel_ops(Path(path))
    rows["fp32"]["evaluation_s"] = time.perf_counter() - started
    return rows


def _score_one(
    label: str,
    path: Path,
    reference_session: Any,
    folder: Path,
    heldout: np.ndarray,
    info: dict,
    threads: int,
    timing: tuple[int, int, int],
    fp32_times: list[dict],
) -> dict:
    """One model against FP32's saved logits, then its latency interleaved with FP32's."""
    try:
        session = _session(path, threads)
        stats = TokenStats()
        for w, window in enumerate(heldout):
            logits = window_logits(session, window, info)[:-1]
            reference_logits = np.load(folder / f"{w}.npy", mmap_mode="r")
            for part in _chunks(len(logits)):
                reference = log_softmax(reference_logits[part])
                stats.add(log_softmax(logits[part]), window[1:][part], reference)
            stats.end_window()
        row = {"status": "ok", **stats.row()}
        prompt, decode, rounds = timing
        pair = latency(
            {"fp32": reference_session, label: session}, info, heldout[0], prompt, decode, rounds
        )
    except Exception as exc:  # noqa: BLE001 - reported in its row
        return {"status": f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    fp32_times.append(pair["fp32"])
    row["latency"] = pair[label]
    row["latency_vs_fp32"] = (
        pair[label]["decode_ms_per_token"] / pair["fp32"]["decode_ms_per_token"]
    )
    return row


def _evaluate(args: argparse.Namespace) -> None:
    """Child: score_models from a spec JSON, result to --json (a process of its own, so that the
    exporting process's torch memory is not in the way and sessions start clean)."""
    spec = json.loads(Path(args.spec).read_text())
    with np.load(spec["heldout"]) as data:
        heldout = data["windows"]
    rows = score_models(
        Path(spec["fp32"]),
        {k: Path(v) for k, v in spec["models"].items()},
        heldout,
        spec["info"],
        spec["threads"],
        spec["prompt"],
        spec["decode"],
        spec["rounds"],
        log=lambda line: print(line, flush=True),
    )
    Path(args.json).write_text(json.dumps(rows, indent=2))


def _latency_only(args: argparse.Namespace) -> None:
    """Child: latency alone for the models of an evaluate spec (FP32 first), e.g. again on a
    quieter machine than the scoring run had; result to --json ({label: latency dict})."""
    spec = json.loads(Path(args.spec).read_text())
    with np.load(spec["heldout"]) as data:
        window = data["windows"][0]
    paths = {"fp32": spec["fp32"], **spec["models"]}
    sessions = {label: _session(Path(path), spec["threads"]) for label, path in paths.items()}
    timing = latency(sessions, spec["info"], window, spec["prompt"], spec["decode"], args.rounds)
    timing["load_average"] = os.getloadavg()  # type: ignore[assignment]
    Path(args.json).write_text(json.dumps(timing, indent=2))


# --------------------------------------------------------------------------- one model


def _save_windows(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({k: v for k, v in entry.items() if k != "windows"})
    with open(path, "wb") as f:
        np.savez(f, windows=entry["windows"], meta=np.array(meta))


def prepare(key: str, work: Path, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Export the FP32 decoder (both exporters, cached by export.json) and save the windows:
    {"fp32": path of the exporter the rows use, "exports": {exporter: info + graph summary},
    "windows": {set: meta}, "info": model_info}."""
    model, tokenizer = llm_models.load_model(key, args.cache)
    info = llm_models.model_info(model)
    exports: dict[str, dict] = {}
    for exporter in args.exporters:
        folder = args.cache / "models" / key / exporter
        path, meta = folder / "model.onnx", folder / "export.json"
        if meta.is_file() and path.is_file() and not args.reexport:
            # the cached entry's path, wherever the cache was written from (a moved checkout)
            exports[exporter] = {**json.loads(meta.read_text()), "path": str(path)}
            log(f"{key}: {exporter} export cached at {path}")
            continue
        log(f"{key}: exporting with {exporter} ...")
        done = llm_models.export_decoder(model, path, exporter)
        done["check"] = llm_models.check_export(model, path)
        done["graph"] = llm_models.graph_summary(path)
        meta.write_text(json.dumps(done, indent=2))
        exports[exporter] = done
        log(
            f"{key}: {exporter} {done['size_bytes'] / 1e6:.1f} MB in {done['export_s']:.0f} s, "
            f"max |ORT - torch| logits {done['check']['max_abs_logits']:.2e}"
        )
    bos = llm_models.bos_for(tokenizer, key)
    counts = {"calibration": args.calibration, "tuning": args.tuning, "heldout": args.heldout}
    draws = {"heldout": args.heldout_draw}
    sets = llm_text.window_sets(tokenizer, args.window, counts, bos, draws=draws)
    windows = {}
    for name, entry in sets.items():
        _save_windows(work / f"{name}.npz", entry)
        windows[name] = {k: v for k, v in entry.items() if k != "windows"}
        windows[name]["count"] = len(entry["windows"])
        windows[name]["path"] = str(work / f"{name}.npz")
    del model
    return {
        "fp32": exports[args.exporters[0]]["path"],
        "exporter": args.exporters[0],
        "exports": exports,
        "windows": windows,
        "info": info,
        "bos": bos,
    }


def quantize_row(row: Row, ctx: RowContext, timeout: float) -> dict:
    """Run one row's command, measured: status, wall_s, cpu_s, peak_rss_mb, and what its result
    JSON reports (settings, versions)."""
    ctx.folder.mkdir(parents=True, exist_ok=True)
    ctx.out.unlink(missing_ok=True)
    result: dict = {"settings": row.settings}
    try:
        command = row.command(ctx) if row.command else None
    except Exception as exc:  # noqa: BLE001 - e.g. the peer's venv failed to install
        return {**result, "status": f"install failed: {exc}"[:300]}
    if command is None:
        raise ValueError(f"row {row.name} has no command")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(REPO)
    measured = _run_with_env(command, ctx.folder / "quantize.log", timeout, env)
    result.update(
        status=measured.status,
        wall_s=measured.wall_s,
        cpu_s=measured.cpu_s,
        peak_rss_mb=measured.peak_mb,
        command=command,
    )
    if row.result_json and (ctx.folder / row.result_json).is_file():
        reported = json.loads((ctx.folder / row.result_json).read_text())
        result["settings"] = reported.get("settings") or row.settings
        result["versions"] = reported.get("versions")
        if reported.get("status", "ok") != "ok":
            result["status"] = reported["status"]
    if result["status"] == "ok" and not ctx.out.is_file():
        result["status"] = f"failed: exited 0 but wrote no {ctx.out.name}"
    return result


def _run_with_env(command: list[str], log: Path, timeout: float, env: dict) -> Any:
    """run_measured with `env` (it inherits this process's environment)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return run_measured(command, log, timeout, cwd=REPO)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_model(key: str, args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Prepare, quantize every selected row, score them all: the model's report entry."""
    work = args.work / key
    prepared = prepare(key, work, args, log)
    fp32 = Path(prepared["fp32"])
    rows: dict[str, dict] = {}
    models: dict[str, Path] = {}
    for name in args.rows:
        row = ROWS[name]
        if row.command is None:
            continue
        folder = work / name
        ctx = RowContext(
            key,
            fp32,
            folder / "model.onnx",
            folder,
            work / "calibration.npz",
            work / "tuning.npz",
            args,
            prepared["info"],
        )
        log(f"{key}: {row.title} ...")
        rows[name] = quantize_row(row, ctx, args.timeout)
        log(
            f"{key}: {row.title}: {rows[name]['status']}"
            + (f" ({rows[name]['wall_s']:.0f} s)" if rows[name].get("wall_s") else "")
        )
        if rows[name]["status"] == "ok":
            models[name] = ctx.out
    spec = {
        "fp32": str(fp32),
        "models": {k: str(v) for k, v in models.items()},
        "heldout": str(work / "heldout.npz"),
        "info": prepared["info"],
        "threads": args.threads,
        "prompt": args.prompt,
        "decode": args.decode,
        "rounds": args.rounds,
    }
    (work / "evaluate.json").write_text(json.dumps(spec, indent=2))
    log(
        f"{key}: scoring FP32 + {len(models)} models on {prepared['windows']['heldout']['count']} "
        f"held-out windows of {args.window} tokens ..."
    )
    command = [
        sys.executable,
        "-m",
        "benchmarks.llm_peers",
        "evaluate",
        "--spec",
        str(work / "evaluate.json"),
        "--json",
        str(work / "scores.json"),
    ]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(f"evaluation of {key} failed (exit {done.returncode})")
    scores = json.loads((work / "scores.json").read_text())
    for name in args.rows:
        entry = rows.setdefault(name, {"settings": ROWS[name].settings, "status": "ok"})
        if name in scores:
            entry.update({k: v for k, v in scores[name].items() if k != "status"})
            if scores[name]["status"] != "ok":
                entry["status"] = scores[name]["status"]
        entry.update(title=ROWS[name].title, tool=ROWS[name].tool)
    return {**prepared, "rows": rows}


# --------------------------------------------------------------------------- output


def table(report: dict) -> str:
    """The results as a markdown table, one line per model x row."""
    head = (
        "| model | row | perplexity | top-1 agree | KL | size MB | quantize s (CPU s) | "
        "peak RSS MB | decode ms/token (x FP32) | prefill ms |"
    )
    lines = [head, "|---" * 10 + "|"]
    for key, entry in report["models"].items():
        rows = sorted(entry.get("rows", {}).items(), key=lambda item: item[0] != "fp32")
        for name, row in rows:
            if "perplexity" not in row:
                status = str(row.get("status"))[:160]
                lines.append(f"| {key} | {row.get('title', name)} | {status} | | | | | | | |")
                continue
            quant = f"{row['wall_s']:.1f} ({row['cpu_s']:.1f})" if "wall_s" in row else "-"
            rss = f"{row['peak_rss_mb']:.0f}" if "peak_rss_mb" in row else "-"
            lat = row["latency"]
            ratio = f" ({row['latency_vs_fp32']:.2f}x)" if "latency_vs_fp32" in row else ""
            lines.append(
                f"| {key} | {row['title']} | {row['perplexity']:.3f} | "
                f"{row['top1_agreement']:.2%} | {row['kl']:.4f} | {row['size_bytes'] / 1e6:.1f} | "
                f"{quant} | {rss} | {lat['decode_ms_per_token']:.1f}{ratio} | "
                f"{lat['prefill_ms']:.0f} |"
            )
    return "\n".join(lines)


def machine() -> dict:
    """CPU model and flags that matter for int8/int4 kernels, load average, versions."""
    flags: set[str] = set()
    name = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("flags"):
                flags |= {
                    f
                    for f in line.split(":", 1)[1].split()
                    if f in ("avx2", "avx512_vnni", "avx512f", "avx_vnni", "fma")
                }
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    versions = {}
    for package in ("onnxruntime", "onnxruntime-gpu", "onnx", "torch", "transformers", "numpy"):
        versions[package] = llm_models._version(package)
    return {
        "cpu": name,
        "flags": sorted(flags),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "versions": {k: v for k, v in versions.items() if v},
    }


def _csv(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(choices)}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.llm_peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=_csv(tuple(llm_models.MODELS)), default=["smollm2-135m"])
    p.add_argument("--rows", type=_csv(tuple(ROWS)), default=list(ROWS))
    p.add_argument(
        "--exporters",
        type=_csv(llm_models.EXPORTERS),
        default=["dynamo", "torchscript"],
        help="the first is the FP32 every row starts from; the others are exported, "
        "checked and summarized for the report",
    )
    p.add_argument("--window", type=int, default=WINDOW, help="tokens per window")
    p.add_argument("--calibration", type=int, default=128, help="calibration windows saved")
    p.add_argument("--tuning", type=int, default=32, help="tuning windows saved")
    p.add_argument(
        "--heldout",
        type=int,
        default=llm_text.HELDOUT_WINDOWS,
        help="held-out windows scored (draws are disjoint only among picks of one count)",
    )
    p.add_argument(
        "--heldout-draw",
        type=int,
        default=llm_text.REPORT_DRAW,
        help="which draw of held-out windows (k > 0: windows none of draws 0..k-1 holds; "
        "llm_text.pick_windows)",
    )
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (scoring)")
    p.add_argument("--prompt", type=int, default=128, help="latency: prompt tokens (prefill)")
    p.add_argument("--decode", type=int, default=32, help="latency: decoded tokens per round")
    p.add_argument("--rounds", type=int, default=3, help="latency: interleaved rounds")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per quantize run")
    p.add_argument("--install-timeout", type=float, default=1800.0, help="seconds per pip step")
    p.add_argument("--peer-root", type=Path, default=REPO / "benchmarks" / ".peers")
    p.add_argument("--cache", type=Path, default=llm_models.CACHE, help="models and exports")
    p.add_argument("--reexport", action="store_true", help="export again even if cached")
    p.add_argument("--json", type=Path, default=RESULTS / "llm_peers.json")
    p.add_argument("--work", type=Path, default=RESULTS / "llm_peers", help="models, windows, logs")
    return p.parse_args(argv)


def run_all(args: argparse.Namespace, command: str, render: Callable[[dict], str]) -> int:
    """Every model of `args` in turn (one model's failure is its entry; the others run), the
    JSON rewritten after each, then the table `render` makes of it. Shared by llm_peers.py and
    llm.py, whose rows differ but whose run is the same. Exit 1 when a model failed."""
    if "fp32" not in args.rows:
        args.rows = ["fp32", *args.rows]

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    report: dict = {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "models": {},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    for key in args.models:
        try:
            report["models"][key] = run_model(key, args, log)
        except Exception as exc:  # noqa: BLE001 - one model's failure is its entry; others run
            report["models"][key] = {"status": f"failed: {type(exc).__name__}: {exc}"[:300]}
            log(f"{key}: {report['models'][key]['status']}")
            failed = True
        args.json.write_text(json.dumps(report, indent=2, default=str))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report["machine"]["load_average_end"] = os.getloadavg()
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))
    print(f"JSON: {args.json}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quantize-ort"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.llm_peers quantize-ort")
        p.add_argument("--tool", choices=("dynamic", "rtn-sym", "rtn-asym", "hqq"), required=True)
        p.add_argument("--model", required=True)
        p.add_argument("--out", required=True)
        _quantize_ort(p.parse_args(argv[1:]))
        return 0
    if argv[:1] == ["evaluate"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.llm_peers evaluate")
        p.add_argument("--spec", required=True)
        p.add_argument("--json", required=True)
        _evaluate(p.parse_args(argv[1:]))
        return 0
    if argv[:1] == ["latency"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.llm_peers latency")
        p.add_argument("--spec", required=True, help="a model's evaluate.json (work folder)")
        p.add_argument("--json", required=True)
        p.add_argument("--rounds", type=int, default=3)
        _latency_only(p.parse_args(argv[1:]))
        return 0
    return run_all(parse_args(argv), "python -m benchmarks.llm_peers " + " ".join(argv), table)


if __name__ == "__main__":
    sys.exit(main())
