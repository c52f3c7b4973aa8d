"""qtool on real decoder LLMs, side by side with FP32 and the peers, in one run (issue 19 item 8).

Every row quantizes the same FP32 export (benchmarks/llm_models.py: torch dynamo, opset 18, with
past_key_values inputs and present outputs) and is scored by benchmarks/llm_peers.score_models
on the same held-out windows. qtool's rows plug into llm_peers through `register_row`, so the
peers' rows (ORT quantize_dynamic, MatMulNBits RTN sym/asym and HQQ, NNCF) are the very code
of benchmarks/llm_peers.py, not a copy.

qtool's rows (ROWS below) are recipes; each runs `qtool quantize` in a process of its own,
measured like every peer (wall and CPU seconds, peak RSS):

* `qtool-int8`: the `int8-llm` preset (weight-only int8 per channel, int8 embedding table that
  the tied lm_head shares);
* `qtool-w8a8`: int8 weights and static int8 activations on every MatMul (min-max ranges);
* `qtool-w8a8-sq`: the `int8-transformer` preset on MatMul/Gather (static int8 activations after
  SmoothQuant, alpha searched on the tuning windows, kept only where it beats plain min-max there);
* `qtool-w8a8-sq-down`: the same with the gated MLPs' down projections (role `mlp-down`) weight
  only: their inputs, where a decoder's activation outliers are largest, stay float;
* `qtool-w8a8-dyn`: the `int8-dynamic` preset on MatMul/Gather: inputs quantized at run time,
  one range per tensor (ORT's DynamicQuantizeLinear);
* `qtool-w8a8-dyn-down`: the same with the `mlp-down` inputs float;
* `qtool-w8a8-token`: the `w8a8-llm` preset: inputs quantized at run time, one range per token;
* `qtool-int4-rtn`: 4-bit blocks of 32 (asymmetric), round to nearest, int8 embedding table;
* `qtool-int4-awq`: the same with AWQ (activation-aware input-channel scales);
* `qtool-int4-gptq`: the same with GPTQ (activation order), no AWQ;
* `qtool-int4`: the `int4-llm` preset: AWQ + scale estimation + GPTQ with activation order;
* `qtool-int4-mixed`: the `int4-mixed-llm` preset: `int4-llm` with the half of the 4-bit
  weights (by parameters) whose rounding costs the most output error per parameter kept at
  8 bits (quantization.algorithms.int8_fallback, ranked on the calibration Hessians) and the
  embedding table in int8 blocks of the whole row;
* `qtool-auto`: `qtool quantize --auto` on the `int4-llm` preset, candidates int4 / int8 / float
  per MatMul, under a perplexity budget (`--auto-budget`, percent over FP32) measured on the
  *tuning* windows (another part of the calibration source than calibration's own windows).

Data discipline: qtool calibrates on windows of the `python-docstrings` calibration part (128
windows of 512 tokens by default, `--qtool-calibration`), --auto
tunes on its `tuning` part, and every reported figure comes from the `fortunes` test part
(benchmarks/llm_text.py): another source, never seen by calibration or tuning. Held-out windows
come in draws (`--heldout-draw`): int4-mixed-llm's fallback share was chosen on draw 0's 16
windows and re-chosen on draws 0 and 1 pooled, so the default is draw 2 (llm_text.REPORT_DRAW),
16 windows neither holds.

    python -m benchmarks.llm --models smollm2-135m --heldout 8
    python -m benchmarks.llm --models smollm2-135m --rows fp32,ort-rtn-sym,qtool-int4 --heldout 4

NNCF's rows are off by default (its venv and its runs cost ~10 minutes per model on a 2-core
machine); `--rows ...,nncf-int4-sym,nncf-int8` runs them. Results: a table on stdout and
`benchmarks/results/llm.json`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks import llm_peers, llm_text
from benchmarks.llm_peers import REPO, RESULTS, Row, RowContext, register_row

# --------------------------------------------------------------------------- qtool's rows

# Row name -> (title, recipe keys beside model/inputs/calibration data/output, --auto?)
_INT4 = {"bits": 4, "block_size": 32, "symmetric": False}
_INT8_TABLE = [{"op_types": "Gather", "precision": "int8"}]
QTOOL_ROWS: dict[str, tuple[str, dict, bool]] = {
    "qtool-int8": ("qtool INT8 weight-only (int8-llm)", {"base": "int8-llm"}, False),
    "qtool-w8a8": (
        "qtool W8A8 (static)",
        {
            "calibration": {"method": "minmax", "batch_size": 1},
            "quantization": {"op_types": ["MatMul", "Gather"], "weights": {"bits": 8}},
        },
        False,
    ),
    "qtool-w8a8-sq": (
        "qtool W8A8 SmoothQuant (int8-transformer)",
        {
            "base": "int8-transformer",
            "calibration": {"batch_size": 1},
            "quantization": {"op_types": ["MatMul", "Gather"]},
        },
        False,
    ),
    "qtool-w8a8-sq-down": (
        "qtool W8A8 SmoothQuant, mlp-down inputs float",
        {
            "base": "int8-transformer",
            "calibration": {"batch_size": 1},
            "quantization": {
                "op_types": ["MatMul", "Gather"],
                "overrides": [{"roles": ["mlp-down"], "activations": "float"}],
            },
        },
        False,
    ),
    "qtool-w8a8-dyn": (
        "qtool W8A8, activations dynamic (int8-dynamic)",
        {
            "base": "int8-dynamic",
            "calibration": {"batch_size": 1},
            "quantization": {"op_types": ["MatMul", "Gather"]},
        },
        False,
    ),
    "qtool-w8a8-dyn-down": (
        "qtool W8A8, activations dynamic, mlp-down inputs float",
        {
            "base": "int8-dynamic",
            "calibration": {"batch_size": 1},
            "quantization": {
                "op_types": ["MatMul", "Gather"],
                "overrides": [{"roles": ["mlp-down"], "activations": "float"}],
            },
        },
        False,
    ),
    "qtool-w8a8-token": ("qtool W8A8, dynamic per token (w8a8-llm)", {"base": "w8a8-llm"}, False),
    "qtool-int4-rtn": (
        "qtool INT4 RTN",
        {
            "calibration": {"method": "minmax", "batch_size": 1},
            "quantization": {
                "op_types": ["MatMul", "Gather"],
                "weights": {**_INT4, "method": "minmax"},
                "overrides": _INT8_TABLE,
            },
        },
        False,
    ),
    "qtool-int4-awq": (
        "qtool INT4 AWQ",
        {
            "calibration": {"method": "minmax", "batch_size": 1},
            "quantization": {
                "op_types": ["MatMul", "Gather"],
                "weights": {**_INT4, "method": "minmax"},
                "overrides": _INT8_TABLE,
                "algorithms": {"awq": {"grid": 20}},
            },
        },
        False,
    ),
    "qtool-int4-gptq": (
        "qtool INT4 GPTQ (act order)",
        {
            "calibration": {"method": "minmax", "batch_size": 1},
            "quantization": {
                "op_types": ["MatMul", "Gather"],
                "weights": {**_INT4, "method": "gptq"},
                "overrides": _INT8_TABLE,
                "algorithms": {"gptq": {"act_order": True}},
            },
        },
        False,
    ),
    "qtool-int4": ("qtool INT4 AWQ+SE+GPTQ (int4-llm)", {"base": "int4-llm"}, False),
    "qtool-int4-mixed": (
        "qtool INT4 + INT8 fallback (int4-mixed-llm)",
        {"base": "int4-mixed-llm"},
        False,
    ),
    "qtool-auto": ("qtool --auto (int4-llm, perplexity budget)", {"base": "int4-llm"}, True),
}

# Rows whose recipe names `tuning.data`: the tuning windows (documents of the calibration source
# that calibration does not read), where SmoothQuant's alpha and the keep-only-if-better rule are
# scored, never the held-out fortunes.
TUNED_ROWS = {"qtool-w8a8-sq", "qtool-w8a8-sq-down"}


def _inputs(info: dict, window: int) -> dict:
    """The decoder's inputs for a prefill of `window` tokens from an empty KV cache."""
    inputs: dict = {
        "input_ids": {"shape": [1, window], "dtype": "int64"},
        "attention_mask": {"shape": [1, window], "dtype": "int64"},
        "position_ids": {"shape": [1, window], "dtype": "int64"},
    }
    past = [1, info["kv_heads"], 0, info["head_dim"]]
    for i in range(info["layers"]):
        for kv in ("key", "value"):
            inputs[f"past_key_values.{i}.{kv}"] = list(past)
    return inputs


def qtool_recipe(name: str, ctx: RowContext) -> Path:
    """Write the row's recipe (and its data) into the row folder; return its path."""
    _, keys, auto = QTOOL_ROWS[name]
    with np.load(ctx.calibration) as data:
        windows = data["windows"][: ctx.args.qtool_calibration]
    info = ctx.info
    calib = llm_peers.decoder_npz(windows, info, ctx.folder / "calibration.npz")
    recipe: dict = {
        **{k: v for k, v in keys.items() if k not in ("calibration", "quantization")},
        "model": {"onnx": str(ctx.fp32), "opset": 21},
        "inputs": _inputs(info, windows.shape[1]),
        "calibration": {**keys.get("calibration", {}), "data": {"npz": str(calib)}},
        "output": {"dir": str(ctx.folder / "out")},
    }
    if "quantization" in keys:
        recipe["quantization"] = keys["quantization"]
    if auto or name in TUNED_ROWS:
        with np.load(ctx.tuning) as data:
            tuning = data["windows"][: ctx.args.auto_windows]
        tuning_npz = llm_peers.decoder_npz(tuning, info, ctx.folder / "tuning.npz")
    if name in TUNED_ROWS:
        recipe["tuning"] = {"data": {"npz": str(tuning_npz)}}
    if auto:
        recipe["evaluation"] = {
            "data": {"npz": str(tuning_npz)},
            "batch_size": 1,
            "metric": "perplexity",
            "max_drop": ctx.args.auto_budget,
        }
        recipe["mixed_precision"] = {
            "objective": "size",
            "candidates": ["int4", "int8", "float"],
            "budget": {"metric": "perplexity", "max_drop": ctx.args.auto_budget},
        }
    path = ctx.folder / "recipe.yaml"
    import yaml  # lazy: llm_peers' evaluate child does not need it

    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _qtool_command(name: str):
    def command(ctx: RowContext) -> list[str]:
        recipe = qtool_recipe(name, ctx)
        cmd = [sys.executable, "-m", "benchmarks.llm", "quantize-qtool", "--recipe", str(recipe)]
        cmd += ["--out", str(ctx.out)]
        return [*cmd, "--auto"] if QTOOL_ROWS[name][2] else cmd

    return command


def _quantize_qtool(recipe: Path, out: Path, auto: bool) -> int:
    """Child: `qtool quantize` in this process, then the quantized model moved to `out` (the
    prepared FP32 copy qtool keeps for evaluate/analyze is deleted: it is not the row's output
    and each copy is as large as the user's file)."""
    from qtool.cli import app

    args = ["quantize", str(recipe), "--no-progress", *(["--auto"] if auto else [])]
    try:
        app(args, standalone_mode=True)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    folder = recipe.parent / "out"
    if code != 0:
        return code
    import onnx

    (written,) = [p for p in folder.glob("model.*.onnx") if p.name != "model.fp32.onnx"]
    external = [
        t.name
        for t in onnx.load(str(written), load_external_data=False).graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    if external:
        print(f"{written} keeps {len(external)} tensors in external data: not moved", flush=True)
        return 3
    shutil.copy2(folder / "report.json", out.parent / "qtool_report.json")
    os.replace(written, out)
    for stale in folder.glob("model.fp32.onnx*"):
        stale.unlink()
    return 0


for _name, (_title, _keys, _auto) in QTOOL_ROWS.items():
    register_row(Row(_name, _title, "qtool", _keys, _qtool_command(_name)))

DEFAULT_ROWS = [
    "fp32",
    "ort-dynamic",
    "ort-rtn-sym",
    "ort-rtn-asym",
    "ort-hqq",
    *[n for n in QTOOL_ROWS if n != "qtool-auto"],
]


# --------------------------------------------------------------------------- output


def table(report: dict) -> str:
    """Markdown: perplexity and % over FP32 (with its 90% interval over the windows,
    llm_peers.ratio_interval), agreement, KL, size (MB and x of the user's FP32 file), quantize
    wall (CPU) seconds, peak RSS, decode time per token as a ratio of FP32's (lower is faster:
    it was misread as a speed-up once)."""
    head = (
        "| model | row | perplexity | vs FP32 (90% over windows) | top-1 agree | KL | "
        "size MB (x FP32 file) | "
        "quantize s (CPU s) | peak RSS MB | decode time x FP32 |"
    )
    lines = [head, "|---" * 10 + "|"]
    for key, entry in report["models"].items():
        rows = entry.get("rows", {})
        fp32 = rows.get("fp32", {})
        base_ppl, base_size = fp32.get("perplexity"), fp32.get("size_bytes")
        for name, row in rows.items():
            title = row.get("title", name)
            if "perplexity" not in row:
                lines.append(f"| {key} | {title} | {str(row.get('status'))[:160]} |" + " |" * 7)
                continue
            over = f"{100 * (row['perplexity'] / base_ppl - 1):+.1f}%" if base_ppl else "-"
            if "vs_fp32_interval_90" in row:
                low, high = (100 * (r - 1) for r in row["vs_fp32_interval_90"])
                over += f" ({low:+.1f} to {high:+.1f})"
            ratio = f" ({row['size_bytes'] / base_size:.3f}x)" if base_size else ""
            quant = f"{row['wall_s']:.0f} ({row['cpu_s']:.0f})" if "wall_s" in row else "-"
            rss = f"{row['peak_rss_mb']:.0f}" if "peak_rss_mb" in row else "-"
            lat = f"{row['latency_vs_fp32']:.2f}x" if "latency_vs_fp32" in row else "-"
            lines.append(
                f"| {key} | {title} | {row['perplexity']:.3f} | {over} | "
                f"{row['top1_agreement']:.2%} | {row['kl']:.4f} | "
                f"{row['size_bytes'] / 1e6:.1f}{ratio} | {quant} | {rss} | {lat} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.llm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=llm_peers._csv(tuple(llm_peers.llm_models.MODELS)))
    p.add_argument("--rows", type=llm_peers._csv(tuple(llm_peers.ROWS)), default=DEFAULT_ROWS)
    p.add_argument(
        "--heldout",
        type=int,
        default=llm_text.HELDOUT_WINDOWS,
        help="held-out fortunes windows scored (int4-mixed-llm on SmolLM2 read +6.0%% on 4 "
        "windows and +9.3%% on 16: fewer are for quick looks, not for reporting)",
    )
    p.add_argument(
        "--heldout-draw",
        type=int,
        default=llm_text.REPORT_DRAW,
        help=f"which draw of held-out windows (default {llm_text.REPORT_DRAW}: windows no earlier "
        "draw holds; draws 0 and 1 informed int4-mixed-llm's fallback share, so they no longer "
        "report)",
    )
    p.add_argument(
        "--qtool-calibration",
        type=int,
        default=128,
        help="calibration windows (qtool's and NNCF's data-aware rows; 128 as in AWQ's and "
        "NNCF's defaults: on both models the 4-bit rows fit better on tuning text than with 16)",
    )
    p.add_argument("--auto-windows", type=int, default=4, help="--auto: tuning windows")
    p.add_argument("--auto-budget", type=float, default=3.0, help="--auto: percent over FP32")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per quantize run")
    p.add_argument("--rounds", type=int, default=1, help="latency: interleaved rounds")
    p.add_argument("--prompt", type=int, default=64, help="latency: prompt tokens")
    p.add_argument("--decode", type=int, default=16, help="latency: decoded tokens per round")
    p.add_argument("--json", type=Path, default=RESULTS / "llm.json")
    p.add_argument("--work", type=Path, default=RESULTS / "llm_rows")
    args, rest = p.parse_known_args(argv)
    # Everything else (cache, window, threads, exporters, ...) is llm_peers' own option.
    forwarded = [*rest, "--heldout", str(args.heldout), "--rounds", str(args.rounds)]
    forwarded += ["--heldout-draw", str(args.heldout_draw)]
    forwarded += ["--prompt", str(args.prompt), "--decode", str(args.decode)]
    forwarded += ["--timeout", str(args.timeout), "--exporters", "dynamo"]
    forwarded += ["--calibration", str(max(args.qtool_calibration, 1))]
    forwarded += ["--tuning", str(max(args.auto_windows, 1))]
    peers = llm_peers.parse_args(forwarded)
    for key, value in vars(args).items():
        if value is not None:
            setattr(peers, key, value)
    peers.models = args.models or ["smollm2-135m"]
    return peers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quantize-qtool"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.llm quantize-qtool")
        p.add_argument("--recipe", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--auto", action="store_true")
        a = p.parse_args(argv[1:])
        return _quantize_qtool(a.recipe, a.out, a.auto)
    return llm_peers.run_all(parse_args(argv), "python -m benchmarks.llm " + " ".join(argv), table)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
