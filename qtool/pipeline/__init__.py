"""The stages every command composes, with typed inputs and outputs: the float model handle,
the plan, the statistics of one calibration pass, the quantized model built from them (with the
accuracy algorithms), and its verification and report. `qtool quantize`, `qtool qat`, analysis
variants, the mixed-precision search and SmoothQuant all call these; none reads a Recipe."""
