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

    def quantized_model(self, uses_int4: bool) -> Path:
        """model.int8.onnx, or model.int4.onnx when the plan stores any weight in 4 bits."""
        return self.folder / f"model.{'int4' if uses_int4 else 'int8'}.onnx"

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
