"""The deployment targets the registry has entries for, and what each runtime is to qtool.

A target is where the quantized model runs. Each op rule has one entry per (target, precision)
(registry.py); what lives here is what holds for every op on a target: how the report words an
op qtool leaves without QDQ pairs, and which kernels of ONNX Runtime's CPU provider compute on
integers (qtool's verifier, runtime/fusion.py, runs every model there, whatever its target).

Adding a target: a `Target` here, in `TARGETS`, and an entry for it in every quantizable rule
(the registry refuses a rule that lacks one); qtool.plan.settings.TARGETS names the targets a
recipe may ask for and must list the same ones (tests/test_op_registry.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

# ORT CPU kernels that compute on integers: a planned node that ORT's optimizer turns into one of
# these (or into any other QLinear* op) runs quantized. Several come from ORT's own fusions
# (attention, embedding layer norm, dynamic quantization) rather than from qtool's QDQ forms.
ORT_CPU_INTEGER_KERNELS = frozenset(
    {
        "QLinearConv",
        "QLinearConvTranspose",
        "QGemm",
        "QLinearMatMul",
        "MatMulIntegerToFloat",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "MatMulNBits",
        "GatherBlockQuantized",
        "QAttention",
        "QLinearAdd",
        "QLinearMul",
        "QLinearConcat",
        "QLinearGlobalAveragePool",
        "QLinearAveragePool",
        "QLinearLeakyRelu",
        "QLinearSigmoid",
        "QLinearSoftmax",
        "QLinearWhere",
        "QLinearReduceMean",
        "QEmbedLayerNormalization",
        "DynamicQuantizeLSTM",
    }
)


@dataclass(frozen=True)
class Target:
    """One deployment target.

    `unplaced` and `unplaced_with_form` are the report's reason for a node of an op type qtool
    places no QDQ pair around ("{op}": the op type; "{form}": what the target's runtime could run
    it as on quantized data, from the op's rule). `integer_kernels`: the runtime kernels that
    compute on integers, where qtool reads the runtime's optimized graph (empty: it does not).
    `precisions`: the precision keys (registry.PRECISIONS) the target's runtime runs; a rule
    has an entry for each of them it supports, and none for the others.
    """

    name: str
    runtime: str
    unplaced: str
    unplaced_with_form: str
    precisions: tuple[str, ...]
    integer_kernels: frozenset[str] = frozenset()

    def unplaced_reason(self, op_type: str, form: str | None) -> str:
        """Why a node of `op_type` stays float when qtool has no QDQ form for it here."""
        if form is None:
            return self.unplaced.format(op=op_type)
        return self.unplaced_with_form.format(op=op_type, form=form)


ORT_CPU = Target(
    name="ort-cpu",
    runtime="ONNX Runtime, CPU execution provider",
    unplaced="ORT's CPU provider has no quantized kernel for {op}: stays float",
    unplaced_with_form=(
        "qtool does not quantize {op} yet (ORT's CPU provider has {form}): stays float"
    ),
    # No FP8 or BF16: ORT's CPU provider has no BF16 kernels for most ops, and its QDQ fusion
    # cannot load float8 Q/DQ around a MatMul (it builds MatMulIntegerToFloat on float8).
    # Dynamic int8 (DynamicQuantizeLinear + MatMulInteger) is ORT's own form; TensorRT has none.
    precisions=(
        "int8/int8",
        "int8/dynamic",
        "int8/dynamic-per-token",
        "int8/float",
        "int4/float",
        "int4/int8",
        "fp16/fp16",
    ),
    integer_kernels=ORT_CPU_INTEGER_KERNELS,
)

# TensorRT 11 builds strongly typed networks: an op qtool leaves alone runs in the type the file
# gives it (the float type of the typing pass, or FP32). qtool does not read an engine here (see
# runtime/tensorrt_engine.py), so the target has no kernel list.
_TENSORRT_UNPLACED = "qtool places no QDQ pair around {op}; it runs in the type the file gives it"

TENSORRT = Target(
    name="tensorrt",
    runtime="TensorRT",
    unplaced=_TENSORRT_UNPLACED,
    unplaced_with_form=_TENSORRT_UNPLACED,
    precisions=(
        "int8/int8",
        "int8/float",
        "int4/float",
        "int4/int8",
        "fp8/fp8",
        "fp16/fp16",
        "bf16/bf16",
    ),
)

TARGETS: dict[str, Target] = {target.name: target for target in (ORT_CPU, TENSORRT)}
