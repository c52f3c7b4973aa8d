"""Quantization-aware training: the PTQ plan fake-quantized in torch, exported by the PTQ writer.

fold.py folds BatchNorm into the preceding Conv; mapping.py ties the Layout's tensors and weights
to the torch module (and proves the tie numerically against ONNX Runtime); fake_quant.py holds the
straight-through and LSQ quantizers; train.py the deterministic loop with checkpoints; export.py
turns the trained module back into the writer's inputs; command.py runs `qtool qat`.
"""
