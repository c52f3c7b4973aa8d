"""Which activation granularity W8A8 needs on a real decoder LLM, before any algorithm.

A PyTorch simulation, not a qtool model: every nn.Linear of the model (the tied lm_head too)
gets int8 weights per output channel (symmetric, round to nearest) and its input fake-quantized
at run time with one range per tensor, or one per token (row of the last axis), symmetric int8
or asymmetric uint8; optionally one kind of layer (by module name) left float. Perplexity on the
same held-out windows `benchmarks/llm.py` scores (fortunes, the model's own tokenizer, 512
tokens). It is what chose qtool's `quantization.dynamic_ranges: per-token` (asymmetric uint8,
the `w8a8-llm` preset), whose real ONNX model `benchmarks/llm.py --rows qtool-w8a8-token`
measures.

    python -m benchmarks.w8a8_granularity --models smollm2-135m --heldout 4

Prints a table and writes JSON (`--json`, default benchmarks/results/w8a8_granularity.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks import llm_models, llm_text
from benchmarks.llm_peers import RESULTS

WINDOW = 512
# (label, activation quantizer name, module-name substring left float or None)
VARIANTS = (
    ("fp32", None, None),
    ("per tensor", "tensor", None),
    ("per token, symmetric int8", "token-sym", None),
    ("per token, asymmetric uint8", "token-asym", None),
    ("per token, asymmetric uint8, down_proj float", "token-asym", "down_proj"),
)


def int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel (rows of nn.Linear's [out, in] weight), dequantized."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
    return (weight / scale).round().clamp(-128, 127) * scale


def _uint8(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """x on the uint8 grid of [min(low, 0), max(high, 0)] (DynamicQuantizeLinear's), dequantized."""
    low, high = low.clamp_max(0), high.clamp_min(0)
    scale = ((high - low) / 255).clamp_min(1e-8)
    zero = (-low / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


def _token_symmetric(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
    return (x / scale).round().clamp(-128, 127) * scale


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tensor": lambda x: _uint8(x, x.min(), x.max()),
    "token-sym": _token_symmetric,
    "token-asym": lambda x: _uint8(x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)),
}


class Simulated:
    """Swaps every nn.Linear's forward for the fake-quantized one, and back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {
            name: (module, module.weight.detach().clone())
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }

    def set(self, activation: str | None, keep_float: str | None) -> None:
        for name, (module, weight) in self.linears.items():
            module.__dict__.pop("forward", None)  # the class's own forward
            if activation is None or (keep_float is not None and keep_float in name):
                continue
            quantized, quantize = int8_weight(weight), ACTIVATIONS[activation]

            def forward(x, module=module, quantized=quantized, quantize=quantize):
                return torch.nn.functional.linear(quantize(x), quantized, module.bias)

            module.forward = forward


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: np.ndarray) -> float:
    """exp(mean NLL of each next token) over the windows, float64 log-softmax."""
    nll, count = 0.0, 0
    for window in torch.from_numpy(windows).long():
        logits = model(window[None]).logits[0, :-1].double()
        log_probs = torch.log_softmax(logits, -1)
        nll -= log_probs.gather(1, window[1:, None]).sum().item()
        count += len(window) - 1
    return float(np.exp(nll / count))


def run(key: str, heldout: int) -> list[dict]:
    model, tokenizer = llm_models.load_model(key)
    sets = llm_text.window_sets(
        tokenizer, WINDOW, {"heldout": heldout}, llm_models.bos_for(tokenizer, key)
    )
    windows = sets["heldout"]["windows"]
    simulated = Simulated(model)
    rows, base = [], None
    for label, activation, keep_float in VARIANTS:
        started = time.perf_counter()
        simulated.set(activation, keep_float)
        value = perplexity(model, windows)
        base = base or value
        rows.append(
            {
                "model": key,
                "variant": label,
                "perplexity": value,
                "vs_fp32_percent": 100 * (value / base - 1),
                "seconds": time.perf_counter() - started,
            }
        )
        print(f"  {key} {label}: {value:.3f} ({rows[-1]['vs_fp32_percent']:+.2f}%)", flush=True)
    simulated.set(None, None)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=["smollm2-135m"])
    p.add_argument("--heldout", type=int, default=4, help="held-out fortunes windows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=RESULTS / "w8a8_granularity.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for key in args.models for row in run(key, args.heldout)]
    print("\n| model | W8A8 simulation | perplexity | vs FP32 |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['variant']} | {row['perplexity']:.3f} | "
            f"{row['vs_fp32_percent']:+.2f}% |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
