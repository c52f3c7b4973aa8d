"""NVIDIA ModelOpt's FP8 QDQ and its FP16 conversion (AutoCast), for benchmarks/float_types.py.

`--mode fp8`: `modelopt.onnx.quantization.quantize(quantize_mode="fp8")` with its defaults for
TensorRT (FP8 E4M3 Q/DQ on its FP8 op types, the rest converted to FP16: high_precision_dtype
"fp16") and `calibration_eps=["cpu"]` (no GPU here); the calibration method is the one named by
`--method` (ModelOpt's FP8 path calibrates as int8, then rescales by 448 / 127).
`--mode fp16`: `modelopt.onnx.autocast.convert_to_mixed_precision(low_precision_type="fp16")`
with its defaults and `keep_io_types=True` (qtool keeps graph inputs and outputs FP32 too), fed
the first AUTOCAST_SAMPLES calibration samples so its I/O-range rule sees real data (its
reference runner keeps every tensor of every sample: all of MiniLM's 256 passed 12 GB).

The rest of the contract is _handoff.main's (the same as run_modelopt.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402

MODES = ("fp8", "fp16")
AUTOCAST_SAMPLES = 16


def _mode_and_rest(argv: list[str]) -> tuple[str, str, list[str]]:
    """--mode and --method are this runner's; the rest go to _handoff.main."""
    mode, method, rest = "fp8", "max", []
    it = iter(argv)
    for arg in it:
        if arg == "--mode":
            mode = next(it)
        elif arg == "--method":
            method = next(it)
        else:
            rest.append(arg)
    if mode not in MODES:
        raise SystemExit(f"--mode must be one of {MODES}, got {mode!r}")
    return mode, method, rest


def _save_npz(batches: list, path: Path, samples: int) -> Path:
    import numpy as np

    names = batches[0].keys()
    arrays = {name: np.concatenate([b[name] for b in batches])[:samples] for name in names}
    np.savez(path, **arrays)
    return path


def make_quantizer(mode: str, method: str):
    def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
        if mode == "fp8":
            from modelopt.onnx.quantization import quantize as mo_quantize

            mo_quantize(
                str(fp32),
                quantize_mode="fp8",
                calibration_method=method,
                calibration_data_reader=_handoff.BatchReader(batches),
                calibration_eps=["cpu"],
                high_precision_dtype="fp16",
                output_path=str(out),
            )
            return {
                "api": "modelopt.onnx.quantization.quantize",
                "quantize_mode": "fp8",
                "calibration_method": method,
                "activations": "fp8 e4m3, per tensor",
                "weights": "fp8 e4m3, per channel",
                "high_precision_dtype": "fp16 (its default)",
                "calibration_eps": ["cpu"],
            }
        import onnx
        from modelopt.onnx.autocast import convert_to_mixed_precision

        data = _save_npz(batches, out.parent / "autocast_calibration.npz", AUTOCAST_SAMPLES)
        converted = convert_to_mixed_precision(
            onnx_path=str(fp32),
            low_precision_type="fp16",
            keep_io_types=True,
            calibration_data=str(data),
        )
        onnx.save(converted, str(out))
        return {
            "api": "modelopt.onnx.autocast.convert_to_mixed_precision",
            "low_precision_type": "fp16",
            "keep_io_types": True,
            "rules": "its defaults (data_max 512, init_max 65504)",
            "calibration_samples": AUTOCAST_SAMPLES,
        }

    return quantize


if __name__ == "__main__":
    chosen, calibration, remaining = _mode_and_rest(sys.argv[1:])
    packages = ("nvidia-modelopt", "onnx", "onnxruntime", "onnxruntime-gpu", "numpy")
    sys.exit(_handoff.main(make_quantizer(chosen, calibration), packages, remaining))
