"""MatMulNBits' compute type (its `accuracy_level`), as ONNX Runtime names and picks it: the
writer chooses one for the deployment CPU, evaluate can override it per session."""

# Session config key that picks MatMulNBits' compute type when ORT forms it from QDQ (ORT 1.31):
# 0 unset (= fp32), 1 fp32, 2 fp16, 3 bf16, 4 int8 activations inside the kernel (the default).
ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
ORT_DEFAULT_ACCURACY_LEVEL = 4
# The level whose kernels quantize their float inputs to int8 (per block) before the product.
INT8_COMPUTE_LEVEL = 4
ACCURACY_LEVELS = {
    0: "unset (fp32 compute)",
    1: "fp32 compute",
    2: "fp16 compute",
    3: "bf16 compute",
    4: "int8 compute (activations quantized per block inside the kernel)",
}
