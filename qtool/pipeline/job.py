"""One quantization run's settings as the composed stages read them: typed, with no file
format behind them. The orchestrators (qtool/app) build a Job from a recipe; the mixed-precision
search and the sensitivity analysis read it to build and score variants of the plan."""

from __future__ import annotations

from dataclasses import dataclass

from qtool.data.source import BatchSource
from qtool.metrics.spec import EvaluationSpec
from qtool.pipeline.build import BuildSettings
from qtool.pipeline.outputs import OutputFiles


@dataclass(frozen=True)
class Job:
    build: BuildSettings
    outputs: OutputFiles
    # SHA-256 of the settings as resolved (presets merged), stamped into every quantized model
    settings_sha256: str
    evaluation: EvaluationSpec | None = None
    evaluation_data: BatchSource | None = None  # the evaluation set, in its batch size

    @property
    def where(self) -> str:
        return self.build.where
