"""The random-weight transformers of benchmarks/heldout.py, built from transformers' configs with
a fixed seed (nothing is downloaded), and their ONNX exports.

- `swin`: a small Swin image classifier (SwinConfig: 64 x 64 inputs, patches of 4, windows of 4,
  three stages of 2 blocks, embed 48, 3/6/12 heads, 100 classes): 27 MatMul/Gemm inputs
  SmoothQuant may smooth (Q/K/V, attention output, MLP in and out per block, 2 patch mergings,
  the classifier), shifted windows with their attention mask, relative position biases.
- `decoder`: a small Llama-style decoder (LlamaConfig: 2 layers, hidden 64, 4 query / 2 KV
  heads, SwiGLU 172, RMSNorm, RoPE, vocab 256 so that bytes are its tokens, untied head),
  exported with past_key_values inputs and present outputs, the layout ONNX Runtime GenAI and
  Optimum use (the idea of the `llm` branch's benchmarks/llm_models.py, written anew here):
  inputs input_ids [1, NEW], attention_mask [1, PAST + NEW], position_ids [1, NEW],
  past_key_values.{i}.key|value [1, 2, PAST, 16]; outputs logits and present.{i}.key|value.

Both export with the TorchScript exporter (dynamo=False) at opset 17, the batch dimension
dynamic, every other dimension fixed by the recipe's `inputs:`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

SEED = 0
IMAGE = 64
PAST, NEW = 16, 16
DECODER_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def swin_model() -> Any:
    """SwinForImageClassification with seeded random weights, eval mode."""
    import torch
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(
        image_size=IMAGE,
        patch_size=4,
        num_channels=3,
        embed_dim=48,
        depths=[2, 2, 2],
        num_heads=[3, 6, 12],
        window_size=4,
        mlp_ratio=4.0,
        num_labels=100,
    )
    torch.manual_seed(SEED)
    return SwinForImageClassification(config).eval()


def decoder_model() -> Any:
    """LlamaForCausalLM with seeded random weights, eager attention, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=DECODER_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).eval()


def decoder_io() -> tuple[list[str], list[str]]:
    """(input names, output names) of the exported decoder."""
    past = [f"past_key_values.{i}.{kv}" for i in range(DECODER_LAYERS) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(DECODER_LAYERS) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


class _DecoderWithPast:
    """A torch module taking the cache as flat tensors, returning (logits, *present)."""

    @staticmethod
    def wrap(model: Any) -> Any:
        import torch
        from transformers import DynamicCache

        class DecoderWithPast(torch.nn.Module):
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask, position_ids, *past):
                pairs = list(zip(past[0::2], past[1::2], strict=True))
                out = self.inner(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=DynamicCache(ddp_cache_data=pairs),
                    use_cache=True,
                    return_dict=True,
                )
                present = []
                for layer in out.past_key_values.layers:
                    present += [layer.keys, layer.values]
                return (out.logits, *present)

        return DecoderWithPast(model).eval()


def decoder_past(model: Any, prefix: Any) -> list[Any]:
    """The present keys/values of `model` after reading `prefix` [batch, PAST] (torch ints):
    the past a decode step of NEW tokens is fed."""
    import torch

    with torch.no_grad():
        out = model(input_ids=prefix, use_cache=True, return_dict=True)
    cache = []
    for layer in out.past_key_values.layers:
        cache += [layer.keys, layer.values]
    return cache


def export(kind: str, path: Path) -> Path:
    """Export `kind` ("swin" or "decoder") to `path` (ONNX, opset 17)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "swin":
        module = swin_model()
        args: tuple = (torch.zeros(1, 3, IMAGE, IMAGE),)
        inputs, outputs = ["pixel_values"], ["logits"]
        axes = {"pixel_values": {0: "batch"}, "logits": {0: "batch"}}
    elif kind == "decoder":
        model = decoder_model()
        module = _DecoderWithPast.wrap(model)
        ids = torch.zeros(1, NEW, dtype=torch.int64)
        mask = torch.ones(1, PAST + NEW, dtype=torch.int64)
        positions = torch.arange(PAST, PAST + NEW, dtype=torch.int64)[None]
        past = decoder_past(model, torch.zeros(1, PAST, dtype=torch.int64))
        args = (ids, mask, positions, *past)
        inputs, outputs = decoder_io()
        axes = {name: {0: "batch"} for name in [*inputs, *outputs]}
    else:
        raise ValueError(f"unknown model {kind!r}")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            do_constant_folding=True,
        )
    return path
