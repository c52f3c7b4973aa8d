"""Perplexity on a real decoder: a tiny random-weight Llama (2 layers, GQA, RoPE, a KV cache)
exported to ONNX by examples/smollm/export.py, calibrated and evaluated on a `text:` source.

The numbers are checked against a hand computation in numpy on the models' own logits: FP32's
perplexity, the quantized model's, its top-1 next-token agreement and KL to FP32; then the gate
(passing and failing, JSON and JUnit), `qtool analyze --metric perplexity` and a
mixed-precision budget in perplexity.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from qtool.app.evaluate import EvaluateOptions  # noqa: E402
from qtool.app.evaluate import run as run_evaluation  # noqa: E402
from qtool.config.recipe import load_recipe  # noqa: E402
from qtool.data.batches import iter_batches  # noqa: E402
from qtool.data.text import IGNORE_LABEL  # noqa: E402
from qtool.errors import DataError  # noqa: E402
from qtool.metrics.gates import Gates, judge_gates  # noqa: E402
from qtool.metrics.tokens import ExactSum, TokenQuality, labelled_rows  # noqa: E402
from qtool.model.load import load_entry_point  # noqa: E402
from qtool.ort.sessions import create_session  # noqa: E402

EXPORT = Path(__file__).resolve().parent.parent / "examples" / "smollm" / "export.py"
WINDOW = 8
LAYERS = 2
WORDS = [f"w{i}" for i in range(60)]


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _text(path: Path, words: int, seed: int) -> Path:
    """Words drawn from a skewed distribution, so a model has something to be sure about."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(WORDS) + 1)
    picks = rng.choice(len(WORDS), size=words, p=weights / weights.sum())
    path.write_text(" ".join(WORDS[i] for i in picks))
    return path


def _model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS) + 1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,  # logits far from uniform: agreement and KL have work to do
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    export = load_entry_point(f"{EXPORT}:export_decoder", "examples/smollm/export.py")
    info = export(model, path)
    assert info == {"layers": LAYERS, "kv_heads": 2, "head_dim": 8, "vocab": len(WORDS) + 1}
    # The export fed an empty past (what the text source feeds) gives torch's own logits.
    windows = np.arange(2 * WINDOW).reshape(2, WINDOW) % (len(WORDS) + 1)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(windows)).logits.numpy()
    np.testing.assert_allclose(_logits(path, windows, optimize=False), want, atol=1e-5)


RECIPE = """
model: {{onnx: model.onnx}}
inputs:
  input_ids: {{shape: [1, {window}], dtype: int64}}
  attention_mask: {{shape: [1, {window}], dtype: int64}}
  position_ids: {{shape: [1, {window}], dtype: int64}}
{past}
calibration:
  data: {{text: {{files: calibration.txt, tokenizer: tok, max_windows: 16}}}}
  method: minmax
quantization:
  op_types: [MatMul]
  per_channel: false
evaluation:
  data: {{text: {{files: heldout.txt, tokenizer: tok, max_windows: 10}}}}
  batch_size: 4
{extra}
"""


def _recipe(folder: Path, extra: str = "", name: str = "recipe.yaml") -> Path:
    past = "\n".join(
        f"  past_key_values.{i}.{kv}: [1, 2, 0, 8]"
        for i in range(LAYERS)
        for kv in ("key", "value")
    )
    path = folder / name
    path.write_text(RECIPE.format(window=WINDOW, past=past, extra=extra))
    return path


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, cli):
    """The tiny decoder exported, its text and tokenizer, and `qtool quantize` run once."""
    folder = tmp_path_factory.mktemp("decoder")
    _model(folder / "model.onnx")
    _tokenizer(folder / "tok")
    _text(folder / "calibration.txt", 400, seed=1)
    _text(folder / "heldout.txt", 200, seed=2)
    result = cli("quantize", _recipe(folder), "--no-progress")
    assert result.exit_code == 0, result.output
    return folder


def _windows(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The held-out windows and labels, cut by hand from the tokenizer's ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tok" / "tokenizer.json"))
    ids = tokenizer.encode((folder / "heldout.txt").read_text(), add_special_tokens=False).ids
    windows = np.asarray(ids[: 10 * WINDOW], np.int64).reshape(10, WINDOW)
    labels = np.concatenate([windows[:, 1:], np.full((10, 1), IGNORE_LABEL)], axis=1)
    return windows, labels


def _logits(model: Path, windows: np.ndarray, optimize: bool) -> np.ndarray:
    session = create_session(model, optimize=optimize)
    count = len(windows)
    feed = {
        "input_ids": windows,
        "attention_mask": np.ones_like(windows),
        "position_ids": np.broadcast_to(np.arange(WINDOW), windows.shape).copy(),
    }
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((count, 2, 0, 8), np.float32)
    return session.run(["logits"], feed)[0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _evaluate(folder: Path, recipe: Path | None = None, **options):
    options.setdefault("latency_runs", 2)
    options.setdefault("progress", False)
    return run_evaluation(EvaluateOptions(**options), recipe or folder / "recipe.yaml")


def test_the_source_feeds_the_windows_cut_by_hand(decoder):
    recipe = load_recipe(decoder / "recipe.yaml")
    batches = list(iter_batches(recipe.evaluation.data, recipe.inputs, 4))
    assert [len(b) for b in batches] == [4, 4, 2]
    windows, labels = _windows(decoder)
    np.testing.assert_array_equal(np.concatenate([b.inputs["input_ids"] for b in batches]), windows)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), labels)
    assert batches[0].inputs["past_key_values.1.value"].shape == (4, 2, 0, 8)


def test_perplexity_agreement_and_kl_match_a_hand_computation(decoder):
    evaluation = _evaluate(decoder)
    out = evaluation.result.gated()
    windows, _ = _windows(decoder)
    fp32 = _log_softmax(_logits(decoder / "out" / "model.fp32.onnx", windows, True))[:, :-1]
    targets = windows[:, 1:]
    rows = np.arange(len(windows))[:, None], np.arange(WINDOW - 1)[None, :], targets
    hand_fp32 = math.exp(-fp32[rows].mean())
    assert out.tokens == 10 * (WINDOW - 1)
    assert out.fp32_perplexity == pytest.approx(hand_fp32, rel=1e-9)
    for variant, optimize in (("fused", True), ("unfused", False)):
        quant = _logits(decoder / "out" / "model.int8.onnx", windows, optimize)
        logp = _log_softmax(quant)[:, :-1]
        measured = out.variant(variant)
        assert measured.perplexity == pytest.approx(math.exp(-logp[rows].mean()), rel=1e-9)
        agree = np.mean(logp.argmax(-1) == fp32.argmax(-1))
        assert measured.agreement == pytest.approx(agree, abs=1e-12)
        kl = np.mean(np.sum(np.exp(fp32) * (fp32 - logp), axis=-1))
        assert measured.kl == pytest.approx(kl, rel=1e-6)
    # the quantization did something measurable: the checks above are not 0 == 0
    assert out.fused.kl > 1e-5 and out.fused.perplexity != out.fp32_perplexity
    assert out.rows == ("perplexity", "top1", "kl", "sqnr", "cosine")
    assert evaluation.result.default_metric() == "perplexity"


def test_gate_passes_and_fails_on_the_relative_rise(decoder, tmp_path):
    evaluation = _evaluate(decoder)
    out = evaluation.result.gated()
    rise = (out.fused.perplexity / out.fp32_perplexity - 1) * 100
    assert rise > 0.01  # the failing case below needs a rise to fail on
    passed = _evaluate(decoder, max_drop=rise * 1.01, json_path=tmp_path / "r.json")
    failed = _evaluate(decoder, max_drop=rise * 0.99, junit_path=tmp_path / "r.xml")
    assert passed.passed and not failed.passed
    gate = failed.gates[0]
    assert (gate.metric, gate.gate) == ("perplexity", "max_drop")
    assert gate.value == pytest.approx(rise)
    assert gate.title == f"logits: perplexity rise <= {rise * 0.99:g}%"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["gates"][0]["metric"] == "perplexity" and report["passed"]
    logits = report["outputs"][0]
    assert logits["fp32_perplexity"] == pytest.approx(out.fp32_perplexity)
    assert logits["fused"]["perplexity"] == pytest.approx(out.fused.perplexity)
    assert logits["fused"]["kl"] == pytest.approx(out.fused.kl)
    assert logits["tokens"] == 70
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert float(properties["logits.fp32.perplexity"]) == pytest.approx(out.fp32_perplexity)
    assert float(properties["logits.unfused.perplexity"]) == pytest.approx(out.unfused.perplexity)
    assert suite.find("testcase/failure") is not None


def test_cli_gate_from_the_recipe_exits_1(decoder, cli):
    recipe = _recipe(decoder, "  max_drop: 0\n  metric: perplexity\n", "recipe-gate.yaml")
    result = cli("evaluate", recipe, "--no-progress", "--latency-runs", "2")
    assert result.exit_code == 1, result.output
    assert "FAIL: output 'logits': perplexity +" in result.output
    assert "logits   │ perplexity" in result.output or "perplexity" in result.output
    passed = cli("evaluate", recipe, "--no-progress", "--latency-runs", "2", "--max-drop", "50")
    assert passed.exit_code == 0, passed.output
    assert "PASS: output 'logits': perplexity" in passed.output


def test_perplexity_needs_next_token_labels(decoder, cli):
    """--metric perplexity on data without labels is refused (exit 2), not scored as nothing."""
    recipe = load_recipe(decoder / "recipe.yaml")
    batches = iter_batches(recipe.evaluation.data, recipe.inputs, 4)
    arrays = {}
    for batch in batches:
        for name, value in batch.inputs.items():
            arrays.setdefault(name, []).append(value)
    np.savez(decoder / "nolabels.npz", **{k: np.concatenate(v) for k, v in arrays.items()})
    out = decoder / "out"
    result = cli(
        "evaluate",
        "--fp32",
        out / "model.fp32.onnx",
        "--quant",
        out / "model.int8.onnx",
        "--data",
        decoder / "nolabels.npz",
        "--metric",
        "perplexity",
        "--max-drop",
        "5",
        "--no-progress",
    )
    assert result.exit_code == 2, result.output
    assert "--metric perplexity needs labels, but the evaluation data has none" in result.output
    files = ("--fp32", out / "model.fp32.onnx", "--quant", out / "model.int8.onnx")
    rows = cli("evaluate", *files, "--data", decoder / "nolabels.npz", "--rows", "kl,sqnr")
    assert rows.exit_code == 2, rows.output
    assert "--rows kl needs labels" in rows.output


def test_analyze_and_mixed_precision_score_perplexity(decoder, cli):
    result = cli(
        "analyze",
        decoder / "recipe.yaml",
        "--metric",
        "perplexity",
        "--mode",
        "one-at-a-time",
        "--samples",
        "6",
        "--no-progress",
        "--no-cache",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((decoder / "out" / "sensitivity.json").read_text())
    assert report["metric"]["name"] == "perplexity"
    assert report["metric"]["penalty"] == "percent of perplexity gained over float"
    float_ppl = report["float"]["metric"]
    assert float_ppl > 1
    full = report["full_plan"]
    assert full["penalty"] == pytest.approx((full["metric"] / float_ppl - 1) * 100)

    budget = "mixed_precision: {budget: {metric: perplexity, max_drop: 0.5}, samples: 6}\n"
    recipe = _recipe(decoder, budget, "recipe-mixed.yaml")
    quantized = cli("quantize", recipe, "--no-progress", "-o", decoder / "out-mixed")
    assert quantized.exit_code in (0, 1), quantized.output
    mixed = json.loads((decoder / "out-mixed" / "report.json").read_text())["mixed_precision"]
    assert mixed["budget"]["metric"] == "perplexity"
    assert mixed["budget"]["limit"] == 0.5
    assert mixed["metric"]["name"] == "perplexity"
    measured = mixed["measured"]["metric"]
    # exit 0 exactly when the chosen plan keeps perplexity within 0.5% of float's on the subset
    within = measured <= mixed["metric"]["float"] * 1.005
    assert mixed["passed"] == within == (quantized.exit_code == 0)


def test_token_quality_sums_are_exact_and_skip_ignored_labels():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 5, 11)).astype(np.float32) * 3
    reference = logits + rng.standard_normal(logits.shape).astype(np.float32) * 0.3
    labels = rng.integers(0, 11, (6, 5))
    labels[:, -1] = IGNORE_LABEL
    whole = TokenQuality()
    whole.update(logits, labels, reference)
    parts = [TokenQuality() for _ in range(3)]
    for k, part in enumerate(parts):
        part.update(
            logits[2 * k : 2 * k + 2], labels[2 * k : 2 * k + 2], reference[2 * k : 2 * k + 2]
        )
    merged = parts[2].merge(parts[0]).merge(parts[1])  # any order
    assert merged.perplexity() == whole.perplexity()  # bit for bit
    assert merged.mean_kl() == whole.mean_kl()
    assert merged.agreement() == whole.agreement()
    assert whole.tokens == 24
    logp = _log_softmax(logits)[:, :-1]
    expected = math.exp(-np.mean(np.take_along_axis(logp, labels[:, :-1, None], -1)))
    assert whole.perplexity() == pytest.approx(expected, rel=1e-12)
    total = ExactSum()
    total.add(np.array([1e16, 1.0, -1e16]))
    assert total.value() == 1.0  # a float sum would give 0.0 or 2.0
    labels[0, 0] = 11
    with pytest.raises(DataError, match="label 11 .* outside the 11 logits"):
        list(labelled_rows(labels, 11))


def test_judge_gates_on_perplexity_is_relative():
    from qtool.metrics.results import (
        EvalResult,
        ModelMetrics,
        OutputResult,
        VariantMetrics,
    )

    def result(fused: float) -> EvalResult:
        variant = VariantMetrics(30.0, 0.999, 0.9, None, perplexity=fused, kl=0.01)
        output = OutputResult(
            "logits", variant, variant, fp32_perplexity=40.0, tokens=100, rows=("perplexity",)
        )
        metrics = ModelMetrics(None, 1.0, 1.0, 10)
        return EvalResult(metrics, metrics, 4, [output], "logits")

    gates = Gates(max_drop=2.0)  # metric None: perplexity, as the output has next-token labels
    assert judge_gates(result(40.79), gates)[0].passed  # +1.975%
    assert not judge_gates(result(40.81), gates)[0].passed  # +2.025%
    assert judge_gates(result(39.0), gates)[0].value == pytest.approx(-2.5)  # better: passes
