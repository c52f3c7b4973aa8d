"""Every statistic one calibration pass must collect: the plan's, and each enabled
algorithm's (NNCF's algorithms declare their statistic points the same way, before any data is
read), so one pass serves them all."""

from __future__ import annotations

import onnx

from qtool.algorithms import awq, int8_fallback, smoothquant
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
    if algorithms.awq is not None:
        requests = requests | awq.requests(model, layout)
    if algorithms.int8_fallback is not None:
        requests = requests | int8_fallback.requests(model, layout)
    if algorithms.scale_estimation is not None:
        requests = requests | StatisticRequests(hessians=scale_search_inputs(layout))
    return requests


def scale_search_inputs(layout: Layout) -> tuple[str, ...]:
    """The layer inputs whose Hessians scale estimation weighs blocks by: those of the blocked
    MatMul/Gemm weights (LowBitOptions' rule, write/low_bit.py)."""
    plans = layout.plan.weight_plans()
    inputs = [
        layout.weight_inputs[name]
        for name, slot in layout.weights.items()
        if name in layout.weight_inputs
        and plans[name].block_size is not None
        and slot.reduction in ("k-rows", "k-cols")
    ]
    return tuple(dict.fromkeys(inputs))
