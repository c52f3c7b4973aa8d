"""The op registry (qtool/plan/ops/): one rule per op type, entries per (target, precision).

What must hold: every quantizable op type has entries for every target; a lookup the registry
cannot answer fails with a message, never a default; the layout and the verifier read the same
rule objects; docs/op-registry.md shows the registered rules; and adding a rule in one place is
enough for the recipe, the layout, the writer and the verifier to handle a new op (the tests
that register Sub and a quantizable Sigmoid run the real pipeline and ORT).
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.model.prepare import tensor_types
from qtool.plan import settings
from qtool.plan.layout import plan_layout
from qtool.plan.ops import (
    RegistryError,
    find_rule,
    precision_key,
    quantizable_op_types,
    register,
    rule,
    rules,
    unregister,
)
from qtool.plan.ops.elementwise import binary_op_rule
from qtool.plan.ops.forms import activation_entries
from qtool.plan.ops.registry import (
    BF16,
    FP8,
    FP16,
    INT4_WEIGHT_ONLY,
    INT8,
    INT8_DYNAMIC,
    INT8_DYNAMIC_TOKEN,
    INT8_WEIGHT_ONLY,
    PRECISIONS,
    Entry,
    OpRule,
    OrtFusion,
)
from qtool.plan.ops.table import BEGIN, END, markdown_tables
from qtool.plan.ops.targets import ORT_CPU, TARGETS
from qtool.plan.settings import QuantizationSpec
from qtool.runtime.fusion import fusion_truth

ROOT = Path(__file__).resolve().parents[1]

# The two dynamic int8 forms: one range per tensor, one per token.
DYNAMIC = {INT8_DYNAMIC, INT8_DYNAMIC_TOKEN}


@pytest.fixture
def registry():
    """Leaves the registry as it found it: rules a test added go, rules it replaced come back."""
    before = rules()
    yield
    kept = {r.op_type for r in before}
    for added in [r for r in rules() if r.op_type not in kept]:
        unregister(added.op_type)
    for original in before:
        if rule(original.op_type) is not original:
            register(original, replace=True)
    assert rules() == before


# Coverage: every quantizable op type, every target


def test_every_quantizable_op_type_has_entries_for_every_target() -> None:
    assert set(TARGETS) == set(settings.TARGETS)
    assert quantizable_op_types() == (
        "Conv",
        "Gemm",
        "MatMul",
        "Add",
        "Mul",
        "Concat",
        "GlobalAveragePool",
        "AveragePool",
        "Gather",
    )
    for op_type in quantizable_op_types():
        found = rule(op_type)
        precisions = {target: set(found.precisions(target)) for target in TARGETS}
        # the same precisions on every target, as far as the target offers them (FP8 and BF16
        # are TensorRT's)
        shared = set(ORT_CPU.precisions) & set(TARGETS["tensorrt"].precisions)
        assert precisions["ort-cpu"] & shared == precisions["tensorrt"] & shared
        # dynamic int8 is ORT's alone (DynamicQuantizeLinear + MatMulInteger), in its
        # per-tensor and per-token forms
        assert precisions["ort-cpu"] - shared <= DYNAMIC, op_type
        assert precisions["ort-cpu"]
        assert precisions["ort-cpu"] <= set(ORT_CPU.precisions), op_type
        for (target, precision), entry in found.entries.items():
            assert precision in PRECISIONS and entry.op_types and entry.written, (op_type, target)
            if precision.endswith("/float"):  # weight-only: the verifier says why it runs float
                assert entry.not_fused_reason(None), (op_type, target, precision)


def test_the_registry_knows_what_the_layout_can_plan() -> None:
    """Weighted ops at every weight precision with and without int8 activations, weightless ops
    at int8 only, embeddings weight-only only."""
    for op_type in ("Conv", "Gemm", "MatMul"):
        # dynamic int8: ORT's dynamic kernels take MatMul/Gemm (ConvInteger is not planned)
        dynamic = DYNAMIC if op_type != "Conv" else set()
        assert (
            set(rule(op_type).precisions("ort-cpu")) == set(ORT_CPU.precisions) - DYNAMIC | dynamic
        )
        assert set(rule(op_type).precisions("tensorrt")) == set(PRECISIONS) - DYNAMIC
    for op_type in ("Add", "Mul", "Concat", "GlobalAveragePool", "AveragePool"):
        # quantized at int8 only (no FP8 form: no FP8 kernel to feed); typed FP16/BF16 as any op
        assert set(rule(op_type).precisions("tensorrt")) == {INT8, FP16, BF16}
    assert set(rule("Gather").precisions("ort-cpu")) == {INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY, FP16}


def test_ort_kernels_of_every_rule_are_integer_kernels() -> None:
    """What a rule says ORT fuses into is what the verifier counts as running quantized."""
    for found in rules():
        assert set(found.ort.kernels) <= ORT_CPU.integer_kernels, found.op_type
        for entry in found.entries.values():
            assert set(entry.fuses_into) <= ORT_CPU.integer_kernels, found.op_type


# Lookups the registry cannot answer


def test_unknown_lookups_fail_clearly() -> None:
    with pytest.raises(RegistryError, match="no op rule for 'Softplus'"):
        rule("Softplus")
    assert find_rule("Softplus") is None  # graph walks meet any op type
    with pytest.raises(RegistryError, match="unknown target 'ort-cuda'"):
        rule("Conv").entry("ort-cuda", INT8)
    with pytest.raises(RegistryError, match=r"Add \(elementwise\) has no entry .*'int4/float'"):
        rule("Add").entry("ort-cpu", INT4_WEIGHT_ONLY)
    with pytest.raises(RegistryError, match="Relu .* is not quantized by qtool"):
        rule("Relu").entry("ort-cpu", INT8)
    with pytest.raises(RegistryError, match="no precision 'fp4/fp4'"):
        precision_key("fp4", "fp4")
    with pytest.raises(RegistryError, match="has no reason for running in float"):
        rule("Add").entry("ort-cpu", INT8).not_fused_reason(None)


def test_incomplete_rules_are_refused(registry) -> None:
    entry = Entry("DQ -> Sub -> Q", ("Sub",))
    only_one_target = OpRule("Sub", "test", quantizable=True, entries={("ort-cpu", INT8): entry})
    with pytest.raises(RegistryError, match="same precisions on every target"):
        register(only_one_target)
    unknown_precision = OpRule(
        "Sub",
        "test",
        quantizable=True,
        entries={("ort-cpu", "fp4/fp4"): entry, ("tensorrt", "fp4/fp4"): entry},
    )
    with pytest.raises(RegistryError, match="'fp4/fp4' is not one of"):
        register(unknown_precision)
    not_offered = OpRule(
        "Sub",
        "test",
        quantizable=True,
        entries={("ort-cpu", FP8): entry, ("tensorrt", FP8): entry},
    )
    with pytest.raises(RegistryError, match="target ort-cpu does not offer fp8/fp8"):
        register(not_offered)
    with pytest.raises(RegistryError, match="Conv already has a rule"):
        register(rule("Conv"))
    with pytest.raises(RegistryError, match="no rule to remove"):
        unregister("Sub")
    assert find_rule("Sub") is None


# The layout and the verifier read the same rule objects


def _save(tmp_path: Path, nodes: list, inputs: list, outputs: list, inits: list) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return path


def _recipe(tmp_path: Path, model: Path, inputs: str, op_types: list[str]) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            model: {{onnx: {model.name}}}
            inputs: {inputs}
            calibration: {{data: {{synthetic: true, samples: 8}}, batch_size: 8, method: minmax}}
            quantization: {{op_types: [{", ".join(op_types)}]}}
            output: {{dir: out}}
            """
        )
    )
    return path


def _conv_sigmoid(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "b")
    return _save(
        tmp_path,
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])],
        [weight, bias],
    )


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """The float tensors of `model`, as the pipeline finds them (after shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return {name for name, (elem, _) in tensor_types(inferred).items() if elem == TensorProto.FLOAT}


def test_layout_and_fusion_truth_read_the_same_rule(tmp_path: Path, registry) -> None:
    """One field of the Conv rule, `output_quantized`, decides both whether the layout places a
    QuantizeLinear after the Conv and whether the verifier blames its absence for no fusion."""
    model_path = _conv_sigmoid(tmp_path)
    model = onnx.load(model_path)
    spec = QuantizationSpec(op_types=("Conv",))
    assert "c" in plan_layout(model, spec, _float_tensors(model)).activations

    conv = rule("Conv")
    register(dataclasses.replace(conv, output_quantized=False), replace=True)
    assert "c" not in plan_layout(model, spec, _float_tensors(model)).activations
    result = quantize(load_recipe(_recipe(tmp_path, model_path, "{x: [1, 3, 8, 8]}", ["Conv"])))
    written = result.model_path.read_bytes()
    nodes = onnx.load_from_string(written).graph.node
    assert not [n for n in nodes if n.op_type == "QuantizeLinear" and "c" in n.input]
    assert "no QuantizeLinear" not in (fusion_truth(written, {"conv": "Conv"})["conv"].reason or "")

    register(conv, replace=True)  # the real rule: ORT forms QLinearConv only from DQ -> Conv -> Q
    truth = fusion_truth(written, {"conv": "Conv"})["conv"]
    assert truth.status == "float"
    assert truth.reason == (
        "its output has no QuantizeLinear, and ORT forms QLinearConv only from DQ -> Conv -> Q"
    )


def test_layout_and_verifier_name_no_op_type_themselves() -> None:
    """The per-op knowledge lives in the registry: these modules hold no op-type table."""
    op_types = {r.op_type for r in rules()} | {"MatMulNBits", "GatherBlockQuantized"}
    for module in ("plan/layout.py", "runtime/verify.py"):
        tree = ast.parse((ROOT / "qtool" / module).read_text())
        named = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        assert not named & op_types, (module, named & op_types)
    fusion = (ROOT / "qtool" / "runtime" / "fusion.py").read_text()
    for table in ("QLINEAR_FORMS", "INTEGER_OPS", "DATA_MOVEMENT_OPS", "_OUTPUT_Q_OPTIONAL"):
        assert table not in fusion
    assert not hasattr(settings, "SUPPORTED_OP_TYPES")


# Adding a rule is enough


def _sub_sigmoid(tmp_path: Path) -> Path:
    return _save(
        tmp_path,
        [
            helper.make_node("Sub", ["a", "b"], ["s"], name="sub"),
            helper.make_node("Sigmoid", ["s"], ["y"], name="sigmoid"),
        ],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 16]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])],
        [],
    )


def test_registering_an_element_wise_rule_is_all_a_new_op_needs(tmp_path: Path, registry) -> None:
    """Sub, registered the way elementwise.py registers Add: the recipe accepts it, the layout
    quantizes its inputs and output, the writer writes DQ -> Sub -> Q, and the verifier reports
    what ORT's CPU provider does with it (it has no QLinearSub: float, and says so)."""
    model = _sub_sigmoid(tmp_path)
    recipe = _recipe(tmp_path, model, "{a: [1, 16], b: [1, 16]}", ["Sub"])
    with pytest.raises(RecipeError, match=r"quantization.op_types\[0\]: must be one of"):
        load_recipe(recipe)

    register(binary_op_rule("Sub", kernel=None))
    assert quantizable_op_types()[-1] == "Sub"
    result = quantize(load_recipe(recipe))

    sub = next(n for n in result.report["nodes"] if n["name"] == "sub")
    assert (sub["precision"], sub["source"], sub["activations"]) == ("int8", "default", "int8")
    assert sub["runtime"]["status"] == "float"
    assert sub["runtime"]["reason"] == "ORT has no quantized kernel for Sub on the CPU"
    written = onnx.load(result.model_path)
    producers = {out: n for n in written.graph.node for out in n.output}
    node = next(n for n in written.graph.node if n.name == "sub")
    assert [producers[i].op_type for i in node.input] == ["DequantizeLinear"] * 2
    assert [n.op_type for n in written.graph.node if node.output[0] in n.input] == [
        "QuantizeLinear"
    ]
    sigmoid = next(n for n in result.report["nodes"] if n["name"] == "sigmoid")
    assert sigmoid["reason"] == (
        "qtool does not quantize Sigmoid yet (ORT's CPU provider has QLinearSigmoid): stays float"
    )


def _sigmoid_matmul(tmp_path: Path) -> Path:
    weight = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    return _save(
        tmp_path,
        [
            helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"),
            helper.make_node("MatMul", ["s", "w"], ["y"], name="matmul"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(weight, "w")],
    )


def test_a_rule_with_an_ort_kernel_fuses_end_to_end(tmp_path: Path, registry) -> None:
    """Sigmoid made quantizable by a rule alone: ORT fuses what the writer emits into
    QLinearSigmoid and the verifier finds it fused, in the report and in the rule's words."""
    sigmoid = OpRule(
        op_type="Sigmoid",
        family="activation",
        quantizable=True,
        output_quantized=True,
        ort=OrtFusion(kernels=("QLinearSigmoid",)),
        entries=activation_entries("Sigmoid", ("QLinearSigmoid",)),
    )
    register(sigmoid, replace=True)
    model = _sigmoid_matmul(tmp_path)
    result = quantize(load_recipe(_recipe(tmp_path, model, "{x: [1, 16]}", ["Sigmoid", "MatMul"])))
    runtime = {n["name"]: n["runtime"] for n in result.report["nodes"] if n.get("runtime")}
    assert runtime["sigmoid"]["status"] == "fused"
    assert runtime["sigmoid"]["runs_as"] in rule("Sigmoid").entry("ort-cpu", INT8).fuses_into
    assert runtime["matmul"]["status"] == "fused"


# The document


def test_the_document_shows_the_registered_rules() -> None:
    text = (ROOT / "docs" / "op-registry.md").read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == markdown_tables(), (
        "docs/op-registry.md is out of date: paste the output of `python -m qtool.plan.ops.table`"
    )
