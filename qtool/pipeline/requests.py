"""Every statistic one calibration pass must collect: the plan's, and each enabled
algorithm's (NNCF's algorithms declare their statistic points the same way, before any data is
read), so one pass serves them all."""

from __future__ import annotations

import onnx

from qtool.algorithms import smoothquant
from qtool.algorithms.spec import Algorithms
from qtool.calibration.requests import StatisticRequests, plan_requests
from qtool.calibration.spec import CalibrationSpec
from qtool.plan.layout import Layout


def requests_for(
    model: onnx.ModelProto,
    layout: Layout,
    algorithms: Algorithms,
    calibration: CalibrationSpec,
    where: str,
) -> StatisticRequests:
    """The plan's requests and those of every algorithm that reads the calibration pass."""
    requests = plan_requests(layout)
    params = algorithms.smoothquant
    if params is not None:
        smoothquant.check_method(calibration.method, where)
        requests = requests | smoothquant.requests(model, layout, params)
    return requests
