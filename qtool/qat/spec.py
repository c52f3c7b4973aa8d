"""How `qtool qat` trains the fake-quantized model."""

from __future__ import annotations

from dataclasses import dataclass

from qtool.data.spec import DataSpec

QAT_OPTIMIZERS = ("sgd", "adam")

QAT_LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class QatSpec:
    """The `qat:` section: how `qtool qat` trains the fake-quantized model.

    `data` None: the calibration data. `loss` None (or data without labels): distillation, MSE
    between the fake-quant student's outputs and the FP32 teacher's. `loss` is cross_entropy,
    mse, or a resolved "file.py:function" taking (outputs, targets) and returning a scalar.
    """

    epochs: int = 3
    lr: float = 1e-4
    optimizer: str = "adam"
    batch_size: int = 32
    seed: int | None = None  # None: the recipe's seed
    data: DataSpec | None = None
    loss: str | None = None
    learn_scales: bool = False
