"""The float model: loaded from ONNX or exported from PyTorch, prepared (opset, folds, shapes),
and held as one handle that every later stage reads."""
