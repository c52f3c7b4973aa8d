"""Regenerate the tiny decoder exports the LLM tests read (seconds to load, where exporting them
with torch's dynamo exporter takes 15-60 s on a busy machine):

    python tests/data/make_llm_fixtures.py

- `tiny_gpt2_dynamo.onnx`: a GPT-2-style decoder (learned positions, LayerNorm, GELU MLP, tied
  embeddings: the lm_head is F.linear(h, wte.weight)), torch.onnx.export(dynamo=True) at opset
  18. Its vocabulary (512 x 32) is large enough that the exporter's own optimizer keeps the
  lm_head's weight as Transpose(wte.weight) rather than folding a copy: the graph of issue 19,
  where qtool's constant folding used to store the table twice.
- `tiny_llama_dynamo.onnx`: a random-weight Llama (2 layers, GQA 4 query / 2 KV heads, RoPE,
  RMSNorm, SwiGLU, tied embeddings) with past_key_values inputs and present outputs, exported by
  benchmarks/llm_models.export_decoder (dynamo, opset 18) as the LLM benchmark exports
  SmolLM2 and Gemma 3.

Both are seeded: the same torch and transformers give the same weights (the graphs may differ
between exporter versions; the tests check behaviour, not bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

GPT2_VOCAB, GPT2_WIDTH, GPT2_CONTEXT = 512, 32, 16


def tiny_gpt2():
    """The GPT-2-style module (torch imported here: the tests read the files only)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class TinyGPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(GPT2_VOCAB, GPT2_WIDTH)
            self.wpe = nn.Embedding(GPT2_CONTEXT, GPT2_WIDTH)
            self.blocks = nn.ModuleList([Block(GPT2_WIDTH, 4) for _ in range(2)])
            self.ln = nn.LayerNorm(GPT2_WIDTH)

        def forward(self, input_ids):
            x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln(x), self.wte.weight)  # tied lm_head

    torch.manual_seed(0)
    return TinyGPT2().eval()


def tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def main() -> None:
    import torch

    from benchmarks import llm_models

    dynamic = torch.export.Dim.DYNAMIC
    program = torch.onnx.export(
        tiny_gpt2(),
        (torch.randint(0, GPT2_VOCAB, (1, 8)),),
        dynamo=True,
        opset_version=18,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes=({0: dynamic, 1: dynamic},),
        optimize=True,
    )
    program.save(str(HERE / "tiny_gpt2_dynamo.onnx"))
    llm_models.export_decoder(tiny_llama(), HERE / "tiny_llama_dynamo.onnx", "dynamo")
    for name in ("tiny_gpt2_dynamo.onnx", "tiny_llama_dynamo.onnx"):
        _strip_metadata(HERE / name)


def _strip_metadata(path: Path) -> None:
    """Drop the exporter's per-node metadata (source locations, stack traces: half the file)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.save(model, str(path))


if __name__ == "__main__":
    main()
