"""Sensitivity analysis: which nodes lose accuracy when quantized, measured in ONNX Runtime.

`qtool analyze RECIPE` builds many variants of one plan (only node i quantized, everything but
node i quantized, and the full plan with every node's output exposed), each from the same
prepared model, statistics and cached quantized weights, and scores them with the metric that
`qtool evaluate` gates on. The mixed-precision search calls `sensitivity.analyze` and reads the
per-node, per-precision penalties of the returned `SensitivityResult`.

Submodules are imported where they are used: `qtool --help` must not load onnx.
"""
