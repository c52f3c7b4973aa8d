"""Sensitivity analysis and mixed precision: measure what each node's precision costs, then
choose the Plan that meets the budget. Returns Plans, never recipes.

Submodules are imported where they are used: `qtool --help` must not load onnx.
"""
