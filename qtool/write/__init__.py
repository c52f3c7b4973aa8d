"""From Plan + statistics to bytes: activation and weight quantization parameters, the integer
weight formats each CPU needs, INT4 blocks, and the QDQ ONNX writer."""
