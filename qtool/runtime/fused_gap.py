"""Why the fused quantized model can differ from its own QDQ semantics, and what to try.

ORT_ENABLE_ALL (what deploys) runs QLinearConv, QGemm, MatMulNBits ... with the CPU's integer
kernels; ORT_DISABLE_ALL runs every QuantizeLinear/DequantizeLinear as written, the reference the
quantizer chose. They differ for two reasons, and the advice depends on which applies:

- x86 without VNNI: the uint8 x int8 kernels add each pair of products in a saturating 16-bit
  sum, which the QDQ graph never does. qtool avoids it when it knows the deployment CPU
  (`quantization.cpu`, and `quantization.saturation` for how).
- Everywhere else (VNNI, AMX, ARM): the kernels requantize with their own rounding (and 4-bit
  MatMulNBits may quantize activations per block), so outputs differ slightly even though nothing
  saturates: measured 22-28 dB between fused and unfused on MiniLM on a VNNI CPU. What deploys is
  the fused model, so that is the one to judge.

`quantize` (runtime/verify.py) and `evaluate` (metrics/) print these same words.
"""

from __future__ import annotations

from qtool.ort.cpu import CpuFeatures


def kernel_cause(cpu: CpuFeatures) -> str:
    """The likely reason fused and unfused differ on `cpu`, in one clause."""
    if cpu.u8s8_saturates:
        return (
            "this CPU has no VNNI and ONNX Runtime's uint8 x int8 kernels saturate 16-bit pair sums"
        )
    return (
        f"ONNX Runtime's fused integer kernels on this CPU ({cpu.describe()}) differ from the "
        "QDQ semantics: they requantize with their own rounding"
    )


def kernel_advice(cpu: CpuFeatures) -> str:
    """What to try, for a user whose fused model is farther from its QDQ semantics than wanted."""
    if cpu.u8s8_saturates:
        return (
            "quantize for the CPU that serves the model (recipe `quantization.cpu`; the default "
            "`quantization.saturation: auto` then writes weights whose pairs cannot overflow), "
            "and evaluate on that CPU"
        )
    return (
        "quantize with `quantization.cpu` set to the deployment CPU, and judge the fused model "
        "(what deploys; `qtool evaluate`'s gates do), not the QDQ semantics"
    )


def int8_compute_cause(nodes: int) -> str:
    """The cause for a weight-only model (no activation Q/DQ) whose fused outputs still differ:
    MatMulNBits at accuracy_level 4 quantizes its inputs to int8 per block inside the kernel,
    which the QDQ graph (float activations) never does."""
    return (
        f"the model quantizes weights only, but {nodes} MatMulNBits node(s) compute at "
        "accuracy_level 4: ORT quantizes their float inputs to int8 per block inside the kernel"
    )


def int8_compute_advice() -> str:
    """What to try when int8 compute inside MatMulNBits is the fused model's extra error."""
    return (
        "judge the fused model (what deploys; `qtool evaluate`'s gates do); "
        "`quantization.accuracy_level: 1` writes fp32-compute MatMulNBits (exact to the QDQ "
        "semantics, slower)"
    )
