"""How close a quantized model is to its float model: the signal-quality accumulator, the
evaluation loop, latency, and the CI gates judged on the result."""
