"""SmoothQuant on a small exported transformer block with planted outlier channels.

The block has the three places SmoothQuant meets in real models: a LayerNorm read only by the
Q/K/V Linears (folded into the LayerNorm), a LayerNorm whose output also feeds a residual Add
(an explicit Mul in front of the FFN), and a GELU feeding a Linear (an explicit Mul). A few
residual channels are 30x larger than the rest and the LayerNorm scales keep them large, as in
BERT-style models; everything runs through the real pipeline and real ORT sessions.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from qtool.algorithms.smoothquant import (
    Choice,
    Member,
    SmoothGroup,
    candidate_alphas,
    choose_alpha,
    smooth_model,
    smoothing_groups,
    twin,
)
from qtool.algorithms.smoothquant_blocks import find_blocks
from qtool.algorithms.smoothquant_probe import score_groups
from qtool.algorithms.spec import BiasCorrectionParams, SmoothQuantParams
from qtool.app.common import prepare
from qtool.app.quantize import quantize
from qtool.calibration.channels import (
    ChannelObserver,
    channel_file_bytes,
    load_channels,
)
from qtool.calibration.collect import collect
from qtool.config.recipe import load_recipe
from qtool.data.batches import Batch
from qtool.errors import CalibrationError, RecipeError

D, SEQ, OUTLIERS = 32, 6, (3, 17, 29)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)  # read by q, k, v only: 1/s folds into its scale and bias
        a = self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)
        r = self.norm2(a + x)  # also read by the residual Add below: an explicit Mul
        return r + self.fc2(nn.functional.gelu(self.fc1(r)))  # GELU -> fc2: explicit Mul


def _block() -> nn.Module:
    torch.manual_seed(0)
    block = Block().eval()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):  # LayerNorm scales that keep outliers large
            norm.weight[list(OUTLIERS)] = 25.0
            norm.bias[list(OUTLIERS)] = 3.0
    return block


def _inputs(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, SEQ, D)).astype(np.float32)
    x[..., list(OUTLIERS)] *= 30.0
    return x


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """An ONNX export of the block, calibration/evaluation data, and recipes using it."""
    root = tmp_path_factory.mktemp("smoothquant")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _block(),
            (torch.zeros(1, SEQ, D),),
            buffer,
            opset_version=17,
            dynamo=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    (root / "block.onnx").write_bytes(buffer.getvalue())
    np.savez(root / "calib.npz", x=_inputs(96, 1))
    np.savez(root / "eval.npz", x=_inputs(64, 2))
    return root


def _write_recipe(folder: Path, name: str, quantization: str, method: str = "minmax") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        "model: {onnx: block.onnx}\n"
        f"inputs: {{x: [1, {SEQ}, {D}]}}\n"
        f"calibration: {{data: {{npz: calib.npz}}, batch_size: 16, method: {method}}}\n"
        "evaluation: {data: {npz: eval.npz}}\n"
        f"output: {{dir: out-{name}}}\n"
        "quantization:\n"
        "  op_types: [MatMul, Gemm]\n" + quantization
    )
    return path


def _run(model: onnx.ModelProto | Path, x: np.ndarray, optimize: bool = True) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _sqnr(reference: np.ndarray, other: np.ndarray) -> float:
    noise = np.sum((reference.astype(np.float64) - other) ** 2)
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / noise))


@pytest.fixture(scope="module")
def runs(folder):
    """The same block quantized without and with SmoothQuant (alpha searched)."""
    plain = load_recipe(_write_recipe(folder, "plain", ""))
    smooth = load_recipe(_write_recipe(folder, "smooth", "  algorithms: [smoothquant]\n"))
    return {
        "plain": (plain, quantize(plain, progress=False)),
        "smooth": (smooth, quantize(smooth, progress=False)),
    }


def test_groups_fold_into_the_layer_norm_only_where_the_matmuls_are_its_only_readers(folder):
    recipe = load_recipe(_write_recipe(folder, "groups", "  algorithms: [smoothquant]\n"))
    prepared = prepare(recipe)
    groups = smoothing_groups(prepared.model.model, prepared.layout)
    assert [len(g.members) for g in groups] == [3, 1, 1]  # q/k/v share one s; fc1; fc2
    producer = {o: n for n in prepared.model.model.graph.node for o in n.output}
    assert groups[0].layer_norm == producer[groups[0].input].name  # norm1: q, k, v only
    assert producer[groups[1].input].op_type == "LayerNormalization"
    assert groups[1].layer_norm is None  # norm2 also feeds the residual Add
    assert groups[2].layer_norm is None  # the GELU's output


def test_smoothing_keeps_the_float_function(folder):
    recipe = load_recipe(_write_recipe(folder, "function", "  algorithms: [smoothquant]\n"))
    prepared = prepare(recipe)
    groups = smoothing_groups(prepared.model.model, prepared.layout)
    # Every group smoothed at a strong alpha, so a wrong fold or transpose would show.
    rng = np.random.default_rng(3)
    choices = {}
    for group in groups:
        scale = rng.uniform(0.05, 20.0, size=D if group is not groups[2] else 4 * D)
        choices[group.input] = Choice(0.5, scale.astype(np.float32), {}, {}, "test")
    smoothed, reads, _ = smooth_model(prepared.model.model, groups, choices)
    onnx.checker.check_model(smoothed)
    ops = [n.op_type for n in smoothed.graph.node]
    assert ops.count("Mul") == [n.op_type for n in prepared.model.model.graph.node].count("Mul") + 2
    assert reads[groups[0].input] == groups[0].input  # folded: the tensor keeps its name
    x = np.load(folder / "eval.npz")["x"]
    before, after = _run(prepared.model.model, x), _run(smoothed, x)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())


def test_smoothing_lowers_the_layer_and_model_error_on_outlier_inputs(folder, runs):
    _, plain = runs["plain"]
    recipe, smooth = runs["smooth"]
    entry = smooth.report["algorithms"]["smoothquant"]
    for layer in entry["layers"]:
        assert layer["output_error_after"] <= layer["output_error_before"], layer
        if layer["applied"]:
            assert layer["output_error_after"] < layer["output_error_before"]
            assert layer["input_outlier_ratio_after"] < layer["input_outlier_ratio_before"]
            assert layer["divided_by"]["node"]
    first = entry["layers"][0]  # norm1 -> q, k, v with 25x LayerNorm scales
    assert first["applied"] and first["output_sqnr_db_after"] > first["output_sqnr_db_before"] + 3
    assert first["divided_by"]["how"] == "LayerNormalization scale and bias"
    # End to end, on held-out data, as ORT runs the quantized models.
    x = np.load(folder / "eval.npz")["x"]
    reference = _run(recipe.float_model_path, x)
    assert _sqnr(reference, _run(smooth.model_path, x)) > _sqnr(
        reference, _run(plain.model_path, x)
    )
    # The model-level rule compared it with plain min-max on the tuning rows, and kept it.
    choice = smooth.report["model_choice"]
    assert choice["kept"] == "recipe" and choice["recipe_model"]["algorithms"] == ["smoothquant"]
    assert choice["scores"]["recipe"]["sqnr_db"] > choice["scores"]["minmax"]["sqnr_db"]
    # Every quantized MatMul still fuses with the inserted Muls in front of them.
    summary = smooth.report["runtime"]
    assert summary["fused"] == summary["planned"] and not summary["unfused"], summary
    # The float model written beside the quantized one is the unsmoothed prepared model.
    written = onnx.load(str(recipe.float_model_path))
    assert not any("SmoothQuant" in n.name for n in written.graph.node)
    quantized = onnx.load(str(smooth.model_path))
    assert sum("SmoothQuant" in n.name for n in quantized.graph.node) == sum(
        1
        for layer in entry["layers"]
        if layer["applied"] and layer["divided_by"]["how"] != ("LayerNormalization scale and bias")
    )


def _one_matmul(w: np.ndarray) -> onnx.ModelProto:
    """x [N, K] -> MatMul(w) -> y: one smoothing group without a block."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], "node")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", w.shape[0]])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", w.shape[1]])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _scored_choice(x_cal, x_tune, w, alpha):
    """SmoothQuant's choice for one MatMul: ranges from `x_cal`, scored on `x_tune`."""
    model = _one_matmul(w)
    observer = ChannelObserver("x", 0)
    observer.update(x_cal)
    stats = observer.result()
    group = SmoothGroup("x", (Member("node", "w", False, True),), None)
    scores = {}
    for a in candidate_alphas(alpha):
        probe = [twin(group, [w], stats, a, symmetric=False)]
        scores[a] = score_groups(model, probe, {}, lambda: iter([{"x": x_tune}]))["x"]
    absmax_w = np.abs(w).max(axis=1)
    return choose_alpha(scores, "block", alpha, stats.absmax, absmax_w)


def test_alpha_zero_is_kept_where_smoothing_would_raise_the_error():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2048, 64)).astype(np.float32)
    w = rng.normal(0, 0.1, (64, 32)).astype(np.float32)
    x[:, 3] *= 30.0  # the outlier channel meets an outlier weight row: alpha 1 doubles it up
    w[3] *= 20.0
    choice = _scored_choice(x[:1024], x[1024:], w, 1.0)
    assert choice.errors[1.0] > 2 * choice.errors[0.0]  # the premise: alpha 1 hurts this layer
    assert choice.alpha == 0.0 and not choice.applied
    assert "kept unsmoothed" in choice.reason and choice.objective == "layer"  # no block here
    assert np.all(choice.scale == 1.0)
    searched = _scored_choice(x[:1024], x[1024:], w, "auto")
    assert searched.errors[searched.alpha] <= searched.errors[0.0]
    assert searched.alpha != 1.0


def test_alpha_is_scored_on_rows_the_ranges_did_not_see():
    """A channel that is tiny on the calibration rows and larger on new rows: alpha 1 scales it
    up to fill the grid the calibration rows reached, so on new rows it clips by its whole
    amplification. Scored on the calibration rows themselves a strong alpha wins; on tuning
    rows no smoothing does, and the strong alpha is over 100x worse there."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.1, (32, 16)).astype(np.float32)
    x_cal = rng.normal(0, 1, (512, 32)).astype(np.float32)
    x_cal[:, 5] *= 0.01
    x_new = rng.normal(0, 1, (512, 32)).astype(np.float32)
    in_sample = _scored_choice(x_cal, x_cal, w, "auto")
    held_out = _scored_choice(x_cal, x_new, w, "auto")
    assert in_sample.alpha >= 0.8
    assert held_out.alpha == 0.0 and not held_out.applied
    assert held_out.errors[in_sample.alpha] > 100 * held_out.errors[0.0]


def test_the_block_output_choice_differs_from_the_layers_where_they_disagree():
    """Two MatMuls read x: A's output leaves the block (a second graph output), B's goes
    through the residual Add y = x + x @ wb. A's weight rows are alike, so smoothing x's outlier
    channel costs A nothing and its large output dominates the layers' error: the layer
    objective smooths strongly. B's outlier weight row meets the outlier channel, so smoothing
    doubles it up there: at the block's output a mild alpha wins."""
    k, m = 64, 32
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (4096, k)).astype(np.float32)
    x[:, 3] *= 30.0
    wa = rng.normal(0, 1.0, (k, m)).astype(np.float32)
    wb = rng.normal(0, 0.01, (k, k)).astype(np.float32)
    wb[3] *= 20.0
    helper, tensor = onnx.helper, onnx.TensorProto
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "wa"], ["ya"], "A"),
            helper.make_node("MatMul", ["x", "wb"], ["b"], "B"),
            helper.make_node("Add", ["b", "x"], ["y"], "residual"),
        ],
        "g",
        [helper.make_tensor_value_info("x", tensor.FLOAT, ["n", k])],
        [
            helper.make_tensor_value_info("y", tensor.FLOAT, ["n", k]),
            helper.make_tensor_value_info("ya", tensor.FLOAT, ["n", m]),
        ],
        [onnx.numpy_helper.from_array(wa, "wa"), onnx.numpy_helper.from_array(wb, "wb")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    blocks = find_blocks(model, {"x": ["A", "B"]})
    assert blocks["x"].output == "y"
    observer = ChannelObserver("x", 0)
    observer.update(x[:2048])  # calibration rows; the other half are the tuning rows
    group = SmoothGroup("x", (Member("A", "wa", False, True), Member("B", "wb", False, True)), None)
    scores = {}
    for alpha in candidate_alphas("auto"):
        probe = [twin(group, [wa, wb], observer.result(), alpha, symmetric=False)]
        scores[alpha] = score_groups(model, probe, blocks, lambda: iter([{"x": x[2048:]}]))["x"]
    absmax_w = np.maximum(np.abs(wa).max(axis=1), np.abs(wb).max(axis=1))
    block = choose_alpha(scores, "block", "auto", observer.result().absmax, absmax_w)
    layer = choose_alpha(scores, "layer", "auto", observer.result().absmax, absmax_w)
    assert block.objective == "block" and layer.objective == "layer"
    assert layer.alpha >= 0.5 and block.alpha <= 0.2  # they disagree, each on its own error
    assert block.layer_choice == layer.alpha
    assert block.block_errors[block.alpha] < block.block_errors[layer.alpha]
    assert layer.errors[layer.alpha] < layer.errors[block.alpha]


def test_blocks_end_at_the_residual_add(folder):
    recipe = load_recipe(_write_recipe(folder, "blocks", "  algorithms: [smoothquant]\n"))
    prepared = prepare(recipe)
    model = prepared.model.model
    groups = smoothing_groups(model, prepared.layout)
    blocks = find_blocks(model, {g.input: g.nodes for g in groups})
    producer = {o: n for n in model.graph.node for o in n.output}
    attention = producer[blocks[groups[0].input].output]  # norm2(a + x): the Add a + x
    assert attention.op_type == "Add" and "x" in attention.input
    for group in groups[1:]:  # fc1 and fc2: y = r + fc2(gelu(fc1(r)))
        assert blocks[group.input].output == "y"
    assert set(groups[0].nodes) <= set(blocks[groups[0].input].nodes)
    assert not find_blocks(_one_matmul(np.ones((4, 2), np.float32)), {"x": ["node"]})


def test_a_kept_layer_is_reported_and_left_alone(folder):
    recipe = load_recipe(
        _write_recipe(folder, "fixed", "  algorithms: {smoothquant: {alpha: 1.0}}\n")
    )
    result = quantize(recipe, progress=False)
    entry = result.report["algorithms"]["smoothquant"]
    assert entry["alpha"] == 1.0 and entry["objective"] == "block"
    for layer in entry["layers"]:
        assert set(layer["sqnr_db_by_alpha"]) == {"0", "1"}
        if not layer["applied"]:
            assert layer["alpha"] == 0.0 and "kept unsmoothed" in layer["reason"]
            assert layer["divided_by"] is None
            assert layer["output_error_after"] == layer["output_error_before"]


def test_channel_statistics_are_exact_and_batch_size_independent(folder):
    recipe = load_recipe(_write_recipe(folder, "channels", "  algorithms: [smoothquant]\n"))
    prepared = prepare(recipe)
    groups = smoothing_groups(prepared.model.model, prepared.layout)
    x = np.load(folder / "calib.npz")["x"]
    results = []
    for batch in (7, 32):
        observers = [ChannelObserver(g.input, 50) for g in groups]
        batches = (Batch({"x": x[i : i + batch]}, None) for i in range(0, len(x), batch))
        collect(
            prepared.model.model, [], batches, bins=256, progress=False, channel_observers=observers
        )
        results.append({o.name: o.result() for o in observers})
    a, b = results
    assert channel_file_bytes(a, "f" * 64) == channel_file_bytes(b, "f" * 64)
    # Against the tensors themselves, fetched from ORT over all rows at once.
    names = [g.input for g in groups]
    model = onnx.ModelProto()
    model.CopyFrom(prepared.model.model)
    typed = {vi.name: vi for vi in model.graph.value_info}
    model.graph.output.extend(typed[n] for n in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name, value in zip(names, session.run(names, {"x": x}), strict=True):
        flat = value.reshape(-1, value.shape[-1])
        np.testing.assert_array_equal(a[name].minimum, flat.min(axis=0))
        np.testing.assert_array_equal(a[name].maximum, flat.max(axis=0))
        assert a[name].rows == flat.shape[0] and a[name].sample.shape == (50, flat.shape[1])
        np.testing.assert_array_equal(a[name].sample, flat[a[name].sample_index])
        assert a[name].sample_index[-1] > flat.shape[0] // 2  # spread, not the first 50 rows


def test_channel_file_round_trip_and_refusals(tmp_path):
    observer = ChannelObserver("t", 8)
    observer.update(np.arange(60, dtype=np.float32).reshape(20, 3))
    stats = {"t": observer.result()}
    path = tmp_path / "channels.npz"
    path.write_bytes(channel_file_bytes(stats, "a" * 64, "d" * 64))
    loaded = load_channels(path, "a" * 64, "d" * 64)
    np.testing.assert_array_equal(loaded["t"].sample, stats["t"].sample)
    with pytest.raises(CalibrationError, match="different model"):
        load_channels(path, "b" * 64)
    with pytest.raises(CalibrationError, match="other calibration data"):
        load_channels(path, "a" * 64, "e" * 64)
    # A tampered member: min above max.
    broken = tmp_path / "broken.npz"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(broken, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("_min.npy"):
                buffer = io.BytesIO()
                np.save(buffer, np.full(3, 1e6, np.float32))
                data = buffer.getvalue()
            target.writestr(info, data)
    with pytest.raises(CalibrationError, match="broken.npz: tensor 't'"):
        load_channels(broken, "a" * 64)
    with pytest.raises(CalibrationError, match="not found"):
        load_channels(tmp_path / "missing.npz", "a" * 64)


def test_quantize_with_a_stats_file_reuses_the_channel_file(folder, cli, runs):
    recipe_path = _write_recipe(folder, "twostep", "  algorithms: [smoothquant]\n")
    assert cli("calibrate", recipe_path, "--no-progress").exit_code == 0
    out = folder / "out-twostep"
    assert (out / "channels.npz").is_file()
    result = cli("quantize", recipe_path, "--stats", out / "stats.npz", "--no-progress")
    assert result.exit_code == 0, result.output
    _, direct = runs["smooth"]
    again = json.loads((out / "report.json").read_text())["algorithms"]["smoothquant"]
    assert again["layers"] == direct.report["algorithms"]["smoothquant"]["layers"]
    graph = onnx.load(str(out / "model.int8.onnx")).graph  # the metadata names another recipe
    assert graph.SerializeToString() == onnx.load(str(direct.model_path)).graph.SerializeToString()
    (out / "channels.npz").unlink()
    result = cli("quantize", recipe_path, "--stats", out / "stats.npz", "--no-progress")
    assert result.exit_code == 2 and "channels.npz" in result.output


@pytest.mark.parametrize(
    ("algorithms", "message"),
    [
        ("{smoothquant: {alpha: 1.5}}", "quantization.algorithms.smoothquant.alpha: must be in"),
        ("{smoothquant: {alpha: high}}", "smoothquant.alpha: must be auto or a number"),
        ("{smoothquant: {alpha: true}}", "smoothquant.alpha: must be auto or a number"),
        ("{smoothquant: {rows: 512}}", "smoothquant.rows: no longer used: alpha is scored on"),
        ("{smoothquant: {objective: model}}", "smoothquant.objective: must be one of block, layer"),
        ("{smoothquant: {beta: 1}}", "quantization.algorithms.smoothquant.beta: unknown key"),
        ("{smoothquant: 0.5}", "quantization.algorithms.smoothquant: must be a mapping"),
    ],
)
def test_recipe_errors_name_the_key(folder, algorithms, message):
    path = _write_recipe(folder, "bad", f"  algorithms: {algorithms}\n")
    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        load_recipe(path)


def test_smoothquant_refuses_histogram_methods_before_calibrating(folder):
    recipe = load_recipe(
        _write_recipe(folder, "entropy", "  algorithms: [smoothquant]\n", method="entropy")
    )
    with pytest.raises(RecipeError, match="smoothquant: needs calibration.method minmax"):
        quantize(recipe, progress=False)


def test_sharded_calibration_is_refused_not_merged_wrongly(folder, cli):
    """Per-channel min/max would merge, but the row sample is keyed by the row's position in
    the whole stream, which a shard does not know: a clear error, no channels.npz."""
    recipe_path = _write_recipe(folder, "sharded", "  algorithms: [smoothquant]\n")
    result = cli("calibrate", recipe_path, "--shard", "0/2", "--no-progress")
    assert result.exit_code == 2, result.output
    assert "smoothquant needs one calibration process" in result.output
    assert not (folder / "out-sharded" / "channels.npz").exists()


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class Embedder(nn.Module):
    """Token embedding -> LayerNorm with outlier channels -> Linear: the transformer preset's
    three parts (an int8 table, a smoothed MatMul input folded into the LayerNorm)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table, self.norm, self.fc = nn.Embedding(64, D), nn.LayerNorm(D), nn.Linear(D, D)
        with torch.no_grad():
            self.norm.weight[list(OUTLIERS)] = 25.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.table(ids)))


def test_transformer_preset_quantizes_tables_and_smooths_at_the_recipes_opset(tmp_path):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Embedder().eval(),
            (torch.zeros(1, SEQ, dtype=torch.int64),),
            buffer,
            opset_version=17,  # blocked tables need opset 21: preparation must upgrade it
            dynamo=False,
            input_names=["ids"],
            output_names=["y"],
            dynamic_axes={"ids": {0: "batch"}, "y": {0: "batch"}},
        )
    (tmp_path / "embedder.onnx").write_bytes(buffer.getvalue())
    ids = np.random.default_rng(4).integers(0, 64, size=(48, SEQ)).astype(np.int64)
    np.savez(tmp_path / "calib.npz", ids=ids)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"base: {CONFIGS / 'int8-transformer.yaml'}\n"
        "model: {onnx: embedder.onnx}\n"
        f"inputs: {{ids: {{shape: [1, {SEQ}], dtype: int64}}}}\n"
        "calibration: {data: {npz: calib.npz}, batch_size: 16}\n"
        "output: {dir: out}\n"
    )
    recipe = load_recipe(path)
    assert recipe.algorithms.smoothquant == SmoothQuantParams(alpha="auto", objective="block")
    result = quantize(recipe, progress=False)
    smoothing = result.report["algorithms"]["smoothquant"]
    assert smoothing["smoothed"] == 1
    assert smoothing["layers"][0]["divided_by"]["how"] == "LayerNormalization scale and bias"
    model = onnx.load(str(result.model_path))
    assert "GatherBlockQuantized" in [n.op_type for n in model.graph.node]
    outputs = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(
            None, {"ids": ids[:8]}
        )[0]
        for p in (recipe.float_model_path, result.model_path)
    ]
    assert _sqnr(*outputs) > 25.0


def test_cnn_preset_turns_on_bias_correction(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")  # loading a recipe checks only that the file exists
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"base: {CONFIGS / 'int8-cnn.yaml'}\n"
        "model: {onnx: m.onnx}\ninputs: {x: [1, 3, 8, 8]}\n"
        "calibration: {data: {synthetic: true, samples: 8}}\n"
    )
    recipe = load_recipe(path)
    assert recipe.algorithms.bias_correction == BiasCorrectionParams(samples=256)
    assert recipe.algorithms.smoothquant is None
    assert recipe.quantization.per_channel and recipe.calibration.method == "mse"
