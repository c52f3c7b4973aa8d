"""The LLM benchmark's groundwork without any LLM wheel: imports (a broken one fails CI), the
window splitter, the document split, the NLL / perplexity / agreement / KL arithmetic on a
hand-built ONNX bigram LM, tied-weight de-duplication, and the KV-cache export of a tiny
random-weight Llama (GQA, RoPE, RMSNorm, tied embeddings) checked against torch in ORT."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from benchmarks import llm_models, llm_peers, llm_text

OPSET = helper.make_opsetid("", 18)
IR = 8  # onnx may write an IR newer than this onnxruntime reads


def test_split_windows_plain_and_with_bos():
    ids = np.arange(23)
    w = llm_models.split_windows(ids, 5)
    assert w.shape == (4, 5) and w.dtype == np.int64
    assert w[1].tolist() == [5, 6, 7, 8, 9]  # non-overlapping, tail (20..22) dropped
    b = llm_models.split_windows(ids, 5, bos=99, limit=2)
    assert b.tolist() == [[99, 0, 1, 2, 3], [99, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        llm_models.split_windows(ids, 1)


def test_split_documents_is_disjoint_and_seeded():
    docs = [f"doc {i}" for i in range(101)]
    parts = llm_text.split_documents(docs, seed=3)
    assert [len(parts[p]) for p in llm_text.PARTS] == [61, 20, 20]
    assert sorted(sum(parts.values(), [])) == sorted(docs)  # each document exactly once
    assert parts == llm_text.split_documents(docs, seed=3)
    assert parts != llm_text.split_documents(docs, seed=4)
    windows = np.arange(40).reshape(10, 4)
    picked = llm_text.pick_windows(windows, 3, seed=1)
    assert len(picked) == 3 and np.all(np.diff(picked[:, 0]) > 0)  # kept in stream order


def test_later_draws_of_windows_are_disjoint_and_leave_draw_0_unchanged():
    windows = np.arange(200).reshape(50, 4)
    first = llm_text.pick_windows(windows, 8, seed=5)
    # draw 0 is the pick every earlier run made: a plain seeded choice among all the windows
    plain = np.sort(np.random.default_rng(5).choice(50, 8, replace=False))
    assert first[:, 0].tolist() == (plain * 4).tolist()
    second = llm_text.pick_windows(windows, 8, seed=5, draw=1)
    third = llm_text.pick_windows(windows, 8, seed=5, draw=2)
    starts = [set(d[:, 0].tolist()) for d in (first, second, third)]
    assert all(len(s) == 8 for s in starts)
    assert not (starts[0] & starts[1] or starts[0] & starts[2] or starts[1] & starts[2])
    assert np.array_equal(second, llm_text.pick_windows(windows, 8, seed=5, draw=1))
    with pytest.raises(ValueError, match="draw 6 needs 8 windows"):
        llm_text.pick_windows(windows, 8, seed=5, draw=6)


def _bigram(path: Path, table: np.ndarray) -> Path:
    """An ONNX 'LM' with the decoder's inputs: logits[b, s] = table[input_ids[b, s]] (+ 0 x the
    mask and positions, so every input is used)."""
    vocab = table.shape[0]
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["raw"]),
        helper.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["attention_mask"], ["mask_sum"], keepdims=0),
        helper.make_node("Cast", ["mask_sum"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["pos_f", "zero"], ["pos0"]),
        helper.make_node("Mul", ["mask_f", "zero"], ["mask0"]),
        helper.make_node("Add", ["pos0", "mask0"], ["nothing"]),
        helper.make_node("Unsqueeze", ["nothing", "last"], ["nothing3"]),
        helper.make_node("Add", ["raw", "nothing3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bigram",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        [
            numpy_helper.from_array(table.astype(np.float32), "table"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[OPSET], ir_version=IR), path)
    return path


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_perplexity_agreement_and_kl_on_a_bigram_lm(tmp_path):
    rng = np.random.default_rng(0)
    vocab = 11
    table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    other = table + rng.normal(scale=0.5, size=table.shape).astype(np.float32)
    fp32 = _bigram(tmp_path / "fp32.onnx", table)
    noisy = _bigram(tmp_path / "noisy.onnx", other)
    heldout = rng.integers(0, vocab, (3, 9))
    info = {"layers": 0, "kv_heads": 1, "head_dim": 1, "vocab": vocab}
    rows = llm_peers.score_models(
        fp32,
        {"noisy": noisy},
        heldout,
        info,
        threads=1,
        prompt=4,
        decode=2,
        rounds=1,
        log=lambda _: None,
    )
    # by hand: window positions 0..7 predict 1..8
    inputs, labels = heldout[:, :-1].ravel(), heldout[:, 1:].ravel()
    ref, got = _log_softmax(table)[inputs], _log_softmax(other)[inputs]
    nll = -ref[np.arange(len(labels)), labels].mean()
    assert rows["fp32"]["tokens"] == 24
    assert rows["fp32"]["perplexity"] == pytest.approx(np.exp(nll), rel=1e-6)
    assert rows["fp32"]["top1_agreement"] == 1.0 and rows["fp32"]["kl"] == 0.0
    noisy_nll = -got[np.arange(len(labels)), labels].mean()
    assert rows["noisy"]["perplexity"] == pytest.approx(np.exp(noisy_nll), rel=1e-6)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert rows["noisy"]["top1_agreement"] == pytest.approx(agree)
    kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
    assert rows["noisy"]["kl"] == pytest.approx(kl, rel=1e-6)
    assert rows["noisy"]["size_bytes"] == noisy.stat().st_size
    assert rows["noisy"]["latency"]["decode_tokens"] == 2
    # per window: the sums that the interval resamples add up to the totals
    window_nll = -np.array(
        [ref[8 * w + np.arange(8), labels[8 * w : 8 * w + 8]].sum() for w in range(3)]
    )
    assert rows["fp32"]["window_nll"] == pytest.approx(window_nll.tolist(), rel=1e-6)
    assert rows["noisy"]["window_tokens"] == [8, 8, 8]
    low, high = rows["noisy"]["vs_fp32_interval_90"]
    assert low <= rows["noisy"]["perplexity"] / rows["fp32"]["perplexity"] <= high


def test_ratio_interval_is_paired_and_narrows_with_agreeing_windows():
    rng = np.random.default_rng(2)
    tokens = np.full(16, 100)
    base = rng.uniform(200, 600, 16)  # windows of very different difficulty
    # the same model: the ratio is exactly 1 in every resample
    assert llm_peers.ratio_interval(base, base, tokens) == (1.0, 1.0)
    # a model worse by 0.05 nats a token on every window: paired, every resample says exp(0.05)
    low, high = llm_peers.ratio_interval(base + 5.0, base, tokens)
    assert low == pytest.approx(np.exp(0.05)) and high == pytest.approx(np.exp(0.05))
    # the same mean loss, spread unevenly over the windows: an interval around it, not a point
    uneven = base + rng.uniform(0.0, 10.0, 16)
    low, high = llm_peers.ratio_interval(uneven, base, tokens)
    point = np.exp((uneven.sum() - base.sum()) / tokens.sum())
    assert low < point < high and high - low > 0.005
    with pytest.raises(ValueError, match="one NLL and one token count per window"):
        llm_peers.ratio_interval(base[:3], base, tokens)


def test_store_tied_once_replaces_a_transposed_copy():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(512, 128)).astype(np.float32)  # 65536 elements: checked
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["h"]),
        helper.make_node("MatMul", ["h", "embed_t"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["s", 512])],
        [numpy_helper.from_array(w, "embed"), numpy_helper.from_array(w.T.copy(), "embed_t")],
    )
    model = helper.make_model(graph, opset_imports=[OPSET], ir_version=IR)
    replaced = llm_models.store_tied_once(model)
    assert replaced == [
        {"kept": "embed", "replaced": "embed_t", "as": "Transpose", "shape": [512, 128]}
    ]
    assert [t.name for t in model.graph.initializer] == ["embed"]
    onnx.checker.check_model(model)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([3, 7], np.int64)
    np.testing.assert_allclose(session.run(None, {"ids": ids})[0], w[ids] @ w.T, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


SLOW = pytest.mark.skipif(
    os.environ.get("QTOOL_SLOW_TESTS") != "1",
    reason="dynamo export of even a tiny decoder takes 15-60 s here; QTOOL_SLOW_TESTS=1 runs it",
)


@pytest.mark.parametrize("exporter", [pytest.param("dynamo", marks=SLOW), "torchscript"])
def test_kv_cache_export_matches_torch(tiny_llama, tmp_path, exporter):
    path = tmp_path / f"{exporter}.onnx"
    done = llm_models.export_decoder(tiny_llama, path, exporter)
    assert done["opset"] == 18 and not done["external_data"]
    # the tied embedding stored once: weights are parameters x 4 bytes (+ a few small constants),
    # not + vocab x hidden x 4 for a folded transposed copy, which store_tied_once replaced
    assert done["weight_bytes"] < done["parameters"] * 4 + 96 * 32 * 4 // 2
    assert [r["as"] for r in done["tied_copies_replaced"]] == ["Transpose"]
    check = llm_models.check_export(tiny_llama, path, prompt=5, steps=2)
    assert check["max_abs_logits"] < 1e-4 and check["max_abs_present"] < 1e-4
    summary = llm_models.graph_summary(path)
    inputs, outputs = llm_models.io_names(2)
    assert list(summary["inputs"]) == inputs and list(summary["outputs"]) == outputs
    assert summary["inputs"]["past_key_values.1.value"][1] == 2  # KV heads
    assert summary["outputs"]["present.0.key"][3] == 8  # head size
    assert summary["lm_head"]["tied_to_embedding_gather"]
    assert summary["constant_weight_matmuls"] == 2 * 7 + 1  # q k v o gate up down, lm_head


def test_nncf_data_aware_row_spends_the_same_share_on_8_bits_as_the_preset():
    from qtool.config import presets

    preset = yaml.safe_load((presets.FOLDER / "int4-mixed-llm.yaml").read_text())
    ratio = preset["quantization"]["algorithms"]["int8_fallback"]["ratio"]
    row = llm_peers.ROWS["nncf-int4-awq"]
    assert row.settings["ratio"] == ratio and f"ratio {ratio:g}" in row.title
