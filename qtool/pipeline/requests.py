"""Every statistic one calibration pass must collect: the plan's, and each enabled
algorithm's (NNCF's algorithms declare their statistic points the same way, before any data is
read), so one pass serves them all."""

from __future__ import annotations

import onnx

from qtool.algorithms import smoothquant
from qtool.calibration.requests import StatisticRequests, plan_requests
from qtool.calibration.spec import CalibrationSpec
from qtool.plan.layout import Layout
from qtool.plan.settings import QuantizationSpec


def requests_for(
    model: onnx.ModelProto,
    layout: Layout,
    quantization: QuantizationSpec,
    calibration: CalibrationSpec,
    where: str,
) -> StatisticRequests:
    """The plan's requests and those of every algorithm that reads the calibration pass."""
    requests = plan_requests(layout)
    params = quantization.algorithm("smoothquant")
    if params is not None:
        smoothquant.check_method(calibration.method, where)
        requests = requests | smoothquant.requests(model, layout, params)
    return requests
