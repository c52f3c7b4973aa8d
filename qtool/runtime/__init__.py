"""What ONNX Runtime really runs: the deployment CPU (cpu.py) and the fused graph (fusion.py)."""
