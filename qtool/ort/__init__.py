"""Where models run: ONNX Runtime sessions made with qtool's settings, and the features of the
CPU that decide which integer kernels ORT takes. Every stage that runs a model goes through here."""
