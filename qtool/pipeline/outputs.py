"""The files one output folder holds, by role: a command decides the folder, the stages name
the files in it the same way whoever calls them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qtool.calibration.channels import channels_path


@dataclass(frozen=True)
class OutputFiles:
    folder: Path

    @property
    def float_model(self) -> Path:
        return self.folder / "model.fp32.onnx"

    def quantized_model(self, tag: str) -> Path:
        """model.{tag}.onnx: int8, int4 when the plan stores any weight in 4 bits, fp8 with FP8
        Q/DQ (QuantizationSpec.model_tag)."""
        return self.folder / f"model.{tag}.onnx"

    @property
    def stats(self) -> Path:
        return self.folder / "stats.npz"

    @property
    def hessians(self) -> Path:
        """GPTQ's XᵀX per layer input, written by the calibration run beside the stats file."""
        return self.folder / "hessians.npz"

    @property
    def channels(self) -> Path:
        """SmoothQuant's per-channel statistics, beside the stats file."""
        return channels_path(self.stats)

    @property
    def report(self) -> Path:
        return self.folder / "report.json"
