"""Weight-rounding and float-model algorithms, one module each (GPTQ, ...).

Each module is backend-free numpy (no ONNX, no ORT): it takes weights and calibration statistics
and returns quantized weights, so the writer and the verifier stay the only places that know the
graph.
"""
