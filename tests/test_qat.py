"""qtool qat: fake quantizers against ONNX Runtime, STE/LSQ gradients, BN folding, the mapping
of the plan to modules, and the exported model against the fake-quant model it was trained as.

End-to-end runs use a tiny CNN (with BatchNorm) written into a temporary folder and 160 real
scikit-learn digits, one or two epochs: seconds each.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from qtool.app.qat import run_qat
from qtool.config.recipe import load_recipe
from qtool.errors import ModelError, RecipeError
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.qat.fake_quant import (
    ActivationQuantizer,
    BlockInt8Input,
    LearnedWeightQuantizer,
    StoredWeightQuantizer,
    dequantized_weight,
)
from qtool.qat.fold import fold_batchnorm
from qtool.runtime.fusion import FUSED, fusion_truth
from qtool.write.int4 import BlockwiseWeight, dequantize
from qtool.write.low_bit import quantize_low_bit
from qtool.write.matmul_nbits import matmul_nbits_node, nbits_initializers
from qtool.write.params import activation_params

MODEL_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu1 = nn.ReLU()
            self.pool = nn.MaxPool2d(2)
            self.flatten = nn.Flatten()
            self.fc1 = nn.Linear(8 * 4 * 4, 32)
            self.relu2 = nn.ReLU()
            self.fc2 = nn.Linear(32, 10)

        def forward(self, image):
            x = self.pool(self.relu1(self.bn1(self.conv1(image))))
            return self.fc2(self.relu2(self.fc1(self.flatten(x))))

    class Functional(Net):
        def forward(self, image):
            x = self.pool(torch.relu(self.conv1(image)))
            return self.fc2(self.relu2(self.fc1(self.flatten(x))))

    class Rows(nn.Module):
        # A Linear on a 3-D input (exported as MatMul with the weight's transpose as a
        # constant) and a layer forward never calls (dropped by the exporter).

        def __init__(self):
            super().__init__()
            self.rows = nn.Flatten(1, 2)
            self.proj = nn.Linear(8, 16)
            self.relu = nn.ReLU()
            self.flatten = nn.Flatten()
            self.head = nn.Linear(8 * 16, 10)
            self.unused = nn.Linear(4, 4)

        def forward(self, image):
            return self.head(self.flatten(self.relu(self.proj(self.rows(image)))))

    def make_rows():
        torch.manual_seed(0)
        return Rows()

    def make_model():
        torch.manual_seed(0)
        model = Net()
        model.bn1.running_mean.uniform_(-0.2, 0.2)
        model.bn1.running_var.uniform_(0.5, 1.5)
        return model

    def make_functional():
        torch.manual_seed(0)
        return Functional()
    """
)

DATA_SOURCE = textwrap.dedent(
    """
    import numpy as np
    from sklearn.datasets import load_digits

    def _split(start, stop):
        digits = load_digits()
        x = (digits.images.astype(np.float32) / 16.0)[start:stop, None]
        return x, digits.target[start:stop].astype(np.int64)

    def calibration():
        x, _ = _split(0, 64)
        yield {"image": x}

    def training():
        x, y = _split(0, 160)
        for i in range(0, len(x), 40):
            yield {"image": x[i : i + 40]}, y[i : i + 40]

    def evaluation():
        x, y = _split(1000, 1200)
        yield {"image": x}, y

    def loss(outputs, labels):
        return (outputs.logsumexp(1) - outputs.gather(1, labels[:, None])[:, 0]).mean()
    """
)


def _case(folder: Path, qat: str, quantization: str = "", factory: str = "make_model") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_SOURCE)
    (folder / "data.py").write_text(DATA_SOURCE)
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            seed: 0
            model: {{pytorch: model.py:{factory}}}
            inputs: {{image: [1, 1, 8, 8]}}
            calibration: {{data: {{python: data.py:calibration}}, batch_size: 32, method: minmax}}
            quantization: {{target: ort-cpu, op_types: [Conv, Gemm]{quantization}}}
            evaluation: {{data: {{python: data.py:evaluation}}}}
            output: {{dir: out}}
            """
        )
        + textwrap.dedent(qat)
    )
    return recipe


TRAIN = """
qat:
  epochs: 2
  lr: 0.001
  batch_size: 16
  loss: cross_entropy
  data: {python: data.py:training}
"""


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    recipe = load_recipe(_case(tmp_path_factory.mktemp("qat8"), TRAIN))
    return recipe, run_qat(recipe, progress=False)


# --- fake quantizers -------------------------------------------------------------------------


def _ort_qdq(x: np.ndarray, scale: np.float32, zero: np.ndarray) -> np.ndarray:
    elem = TensorProto.UINT8 if zero.dtype == np.uint8 else TensorProto.INT8
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
        initializer=[
            numpy_helper.from_array(np.asarray(scale, np.float32), "s"),
            helper.make_tensor("z", elem, [], [int(zero)]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("symmetric", [False, True])
def test_activation_fake_quant_equals_ort_qdq(symmetric):
    rng = np.random.default_rng(0)
    params = activation_params(-1.3, 2.9, symmetric)
    # random values, values beyond the range, and exact halfway points (round half to even)
    ties = (np.arange(-20, 20, dtype=np.float32) + 0.5) * params.scale
    x = np.concatenate([rng.uniform(-4, 5, 4000).astype(np.float32), ties])
    ours = ActivationQuantizer(params)(torch.from_numpy(x)).numpy()
    theirs = _ort_qdq(x, params.scale, np.asarray(params.zero_point))
    np.testing.assert_array_equal(ours, theirs)


def test_ste_gradient_passes_inside_the_range_only():
    params = activation_params(0.0, 1.0, False)  # uint8, zero point 0: clamps below 0, above 1
    x = torch.tensor([-0.5, 0.1, 0.37, 0.99, 1.5], requires_grad=True)
    ActivationQuantizer(params)(x).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_lsq_scale_gradient_matches_its_closed_form():
    params = activation_params(-1.0, 3.0, False)
    quantizer = ActivationQuantizer(params, learn=True)
    x = torch.tensor([-2.0, -0.3, 0.123, 1.7, 2.9, 5.0])
    quantizer(x).sum().backward()
    s, z = float(params.scale), int(params.zero_point)
    expected = 0.0
    for value in x.tolist():
        q = round(value / s) + z  # Python rounds half to even too
        if q < 0:
            expected += 0 - z
        elif q > 255:
            expected += 255 - z
        else:
            expected += (q - z) - value / s
    expected /= math.sqrt(x.numel() * 255)
    assert quantizer.scale.grad.item() == pytest.approx(expected, rel=1e-4)


def test_int8_compute_input_is_what_matmulnbits_level_4_computes():
    """At accuracy level 4 ORT quantizes MatMulNBits' input per row and block to int8: the fake
    quantizer in front of the Linear reproduces it (K = 72: a partial last block of 8), while
    the plain float product is measurably off."""
    rng = np.random.default_rng(3)
    k, n, block = 72, 24, 16
    blocks = -(-k // block)
    bw = BlockwiseWeight(
        rng.integers(-8, 8, size=(k, n)).astype(np.int8),
        rng.uniform(0.01, 0.05, size=(blocks, n)).astype(np.float32),
        None,
        4,
        0,
        block,
    )
    matmul = helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")
    graph = helper.make_graph(
        [matmul_nbits_node(matmul, "w", bw, None, 4)],
        "level4",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        nbits_initializers("w", bw),
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    a = rng.normal(size=(32, k)).astype(np.float32)
    a[:, 5] *= 20.0  # an outlier channel: its block's other values get coarse steps
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (ort_level4,) = session.run(None, {"a": a})
    weight = torch.from_numpy(dequantize(bw))
    emulated = (BlockInt8Input(block)(torch.from_numpy(a)) @ weight).numpy()
    plain = (torch.from_numpy(a) @ weight).numpy()
    error = np.abs(emulated - ort_level4).max()
    assert error < 1e-4 * np.abs(ort_level4).max()
    assert np.abs(plain - ort_level4).max() > 20 * error
    x = torch.from_numpy(a).requires_grad_(True)
    BlockInt8Input(block)(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight through


def test_weight_fake_quant_is_the_writers_int4_weight_with_a_straight_through_gradient():
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(8, 32)).astype(np.float32)  # a Linear [N, K], blocks along K
    slot = WeightSlot("w", 0, "k-rows", block_size=16, transposed=True)
    plan = WeightPlan("w", 4, "block", 0, "s4", "", block_size=16, method="mse")
    quantizer = StoredWeightQuantizer(lambda w: quantize_low_bit(w, slot, plan), True)
    w = torch.from_numpy(weight.copy()).requires_grad_(True)
    out = quantizer(w)
    stored = dequantize(quantize_low_bit(weight, slot, plan))  # [K, N] as written
    np.testing.assert_array_equal(out.detach().numpy(), stored.T)
    assert not np.array_equal(out.detach().numpy(), weight)
    (out * 3.0).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full_like(weight, 3.0))
    np.testing.assert_array_equal(
        dequantized_weight(quantize_low_bit(weight, slot, plan), True), stored.T
    )


def test_learned_weight_scales_start_at_the_writers_weight_and_export_what_they_compute():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(6, 40)).astype(np.float32)  # K = 40: a short last block
    slot = WeightSlot("w", 0, "k-rows", block_size=16, transposed=True)
    plan = WeightPlan("w", 4, "block", 0, "u4", "", block_size=16, symmetric=False)
    initial = quantize_low_bit(weight, slot, plan)
    quantizer = LearnedWeightQuantizer(initial, transposed=True)
    w = torch.from_numpy(weight.copy()).requires_grad_(True)
    np.testing.assert_allclose(quantizer(w).detach().numpy(), dequantize(initial).T, atol=1e-6)
    quantizer(w).square().sum().backward()
    assert quantizer.scale.grad is not None and quantizer.scale.grad.abs().sum() > 0
    with torch.no_grad():
        quantizer.scale.mul_(1.1)
    stored = quantizer.stored_form(w.detach())
    np.testing.assert_allclose(dequantize(stored).T, quantizer(w).detach().numpy(), atol=1e-6)


# --- BatchNorm folding and mapping ------------------------------------------------------------


def test_batchnorm_folds_into_the_conv_without_changing_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 6, 6)
    before = model(x)
    assert fold_batchnorm(model) == [("0", "1")]
    assert isinstance(model[1], nn.Identity)
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_batchnorm_without_a_conv_before_it_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ModelError, match="BatchNorm '1' does not follow a Conv"):
        fold_batchnorm(model)


def test_a_functional_activation_cannot_be_mapped_and_says_which_tensor(tmp_path):
    recipe = load_recipe(_case(tmp_path, TRAIN, factory="make_functional"))
    with pytest.raises(ModelError, match=r"'/Relu_output_0'.*no module scope|/Relu"):
        run_qat(recipe, progress=False)


# --- recipe -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qat", "message"),
    [
        ("qat: {optimizer: rmsprop}", "qat.optimizer: must be one of sgd, adam"),
        ("qat: {lr: -1}", "qat.lr: must be a finite number > 0"),
        ("qat: {epochs: 0}", "qat.epochs: must be >= 1"),
        ("qat: {loss: hinge}", "qat.loss: must be one of cross_entropy, mse or 'file.py"),
        ("qat: {loss: 'nope.py:f'}", "qat.loss: file not found"),
        ("qat: {momentum: 0.9}", "qat.momentum: unknown key"),
        ("qat: {learn_scales: 1}", "qat.learn_scales: must be true or false"),
    ],
)
def test_bad_qat_settings_name_the_key(tmp_path, qat, message):
    with pytest.raises(RecipeError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_recipe(_case(tmp_path, qat))


def test_an_onnx_source_is_refused_with_exit_2(tmp_path, int8_run, cli):
    recipe, _ = int8_run
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "data.py").write_text(DATA_SOURCE)
    (folder / "recipe.yaml").write_text(
        f"model: {{onnx: {recipe.float_model_path}}}\ninputs: {{image: [1, 1, 8, 8]}}\n"
        "calibration: {data: {python: data.py:calibration}}\n"
    )
    result = cli("qat", folder / "recipe.yaml", "--no-progress")
    assert result.exit_code == 2
    assert "qtool qat trains PyTorch models" in result.output


# --- end to end ------------------------------------------------------------------------------


def test_int8_qat_exports_what_trained_and_ort_fuses_every_planned_node(int8_run):
    recipe, result = int8_run
    block = result.report["qat"]
    assert block["batchnorm_folded"] == [{"conv": "conv1", "batchnorm": "bn1"}]
    assert block["epochs"] == 2 and len(block["epoch_losses"]) == 2
    assert block["fake_quant_tensors"] == 4  # image, relu1 (folded), pool, relu2
    same = block["equivalence"]
    # ORT (unfused QDQ semantics and fused kernels) vs torch fake quant: within one step
    assert same["max_abs_diff_unfused"] <= same["output_step"]
    assert same["max_abs_diff_fused"] <= same["output_step"]
    truth = fusion_truth(
        recipe.quant_model_path.read_bytes(),
        {"/conv1/Conv": "Conv", "/fc1/Gemm": "Gemm", "/fc2/Gemm": "Gemm"},
    )
    assert {name: t.status for name, t in truth.items()} == dict.fromkeys(truth, FUSED)
    assert result.report["runtime"]["fused"] == result.report["runtime"]["planned"] == 3
    written = json.loads(recipe.report_path.read_text())
    assert written["qat"]["accuracy"]["exported_fused"] == block["accuracy"]["exported_fused"]
    assert (recipe.output_dir / "qat" / "epoch-002.pt").is_file()


def test_exported_weights_are_the_trained_ones(int8_run):
    recipe, _ = int8_run
    fp32 = {
        t.name: numpy_helper.to_array(t)
        for t in onnx.load(recipe.float_model_path).graph.initializer
    }
    quant = {t.name: t for t in onnx.load(recipe.quant_model_path).graph.initializer}
    state = torch.load(recipe.output_dir / "qat" / "epoch-002.pt", weights_only=True)["model"]
    trained = state["net.fc2.parametrizations.weight.original"].numpy()
    assert not np.array_equal(trained, fp32["fc2.weight"])  # training moved it
    values = numpy_helper.to_array(quant["fc2.weight_quantized"]).astype(np.float32)
    scale = numpy_helper.to_array(quant["fc2.weight_scale"])[:, None]
    np.testing.assert_allclose(values * scale, trained, atol=float(scale.max()) / 2 + 1e-7)


def test_resume_gives_the_same_model_bytes_as_one_uninterrupted_run(tmp_path):
    one = """
    qat: {epochs: 1, lr: 0.001, batch_size: 16, loss: 'data.py:loss',
          data: {python: data.py:training}}
    """
    recipe_path = _case(tmp_path / "case", one)
    run_qat(load_recipe(recipe_path, tmp_path / "resumed"), progress=False)
    recipe_path.write_text(recipe_path.read_text().replace("epochs: 1", "epochs: 2"))
    straight = load_recipe(recipe_path, tmp_path / "straight")
    resumed = load_recipe(recipe_path, tmp_path / "resumed")
    a = run_qat(straight, progress=False)
    b = run_qat(resumed, resume=True, progress=False)
    assert b.report["qat"]["resumed_after_epoch"] == 1
    assert a.report["qat"]["epoch_losses"] == b.report["qat"]["epoch_losses"]
    assert straight.quant_model_path.read_bytes() == resumed.quant_model_path.read_bytes()


def test_distillation_with_learned_scales_and_int4_blocked_weights(tmp_path):
    """No labels, no loss: the student matches the FP32 teacher on the calibration data."""
    recipe = load_recipe(
        _case(
            tmp_path,
            "qat: {epochs: 1, lr: 0.0005, batch_size: 16, learn_scales: true}",
            ", activations: int8, weights: {bits: 4, block_size: 16}",
        )
    )
    result = run_qat(recipe, progress=False)
    block = result.report["qat"]
    assert block["loss"].startswith("distillation")
    assert block["training_samples"] == 64
    assert block["activation_scales_changed"] > 0  # LSQ moved the scales, and they were exported
    same = block["equivalence"]
    assert same["max_abs_diff_fused"] <= same["output_step"]
    assert same["max_abs_diff_unfused"] <= same["output_step"]
    assert block["learned_weight_scales"] == ["conv1.weight", "fc1.weight", "fc2.weight"]
    nodes = {n["name"]: n for n in result.report["nodes"]}
    assert "scales learned by QAT" in nodes["/fc1/Gemm"]["weight"]["reason"]
    assert nodes["/fc1/Gemm"]["weight"]["block_size"] == 16


def test_a_linear_on_3d_input_trains_through_its_transposed_constant(tmp_path):
    """The exporter writes such a Linear as MatMul(x, onnx::MatMul_N = weight.T): QAT ties the
    constant to the parameter, trains it, and writes it back transposed; the never-called
    layer is frozen instead of breaking the export."""
    path = _case(
        tmp_path,
        "qat: {epochs: 1, lr: 0.001, batch_size: 16, learn_scales: true}",
        ", activations: int8, weights: {bits: 4, block_size: 16}",
        factory="make_rows",
    )
    path.write_text(path.read_text().replace("[Conv, Gemm]", "[MatMul, Gemm]"))
    recipe = load_recipe(path)
    block = run_qat(recipe, progress=False).report["qat"]
    assert block["frozen_unused_parameters"] == ["unused.weight", "unused.bias"]
    constants = [n for n in block["learned_weight_scales"] if n.startswith("onnx::MatMul_")]
    assert len(constants) == 1 and "head.weight" in block["learned_weight_scales"]
    assert block["equivalence"]["max_abs_diff_fused"] <= block["equivalence"]["output_step"]
    assert block["equivalence"]["max_abs_diff_unfused"] <= block["equivalence"]["output_step"]
    # ORT on the export agrees with the trained fake-quant model (above), and training moved
    # the weight: so the file holds the trained weight, transposed back into the constant.
    name = constants[0]
    trained = torch.load(recipe.output_dir / "qat" / "epoch-001.pt", weights_only=True)["model"]
    weight = trained["net.proj.parametrizations.weight.original"].numpy()  # [16, 8]
    fp32 = next(
        numpy_helper.to_array(t)
        for t in onnx.load(recipe.float_model_path).graph.initializer
        if t.name == name
    )
    assert fp32.shape == weight.T.shape == (8, 16)  # [K, N], as the MatMul reads it
    assert np.abs(weight.T - fp32).max() > 1e-4
