"""qtool: post-training quantization of ONNX and PyTorch models to QDQ ONNX."""

__version__ = "0.1.0"
