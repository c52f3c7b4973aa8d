"""Benchmark models, written in plain torch and exported to ONNX.

torchvision and transformers are not installed, and nothing may download weights, so the two
architectures are written here with random weights from a fixed seed. Random weights are enough
for a speed/memory comparison: calibration cost depends on the graph's shapes, not on its values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

OPSET = 17
VOCAB = 30522


class BasicBlock(nn.Module):
    """ResNet v1 basic block: two 3x3 convs with a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 (BasicBlocks [2, 2, 2, 2], 64..512 channels), the torchvision layout."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers = []
        cin = 64
        for i, cout in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(image))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # Global average pooling as AveragePool over the (static) spatial size rather than
        # AdaptiveAvgPool2d: the latter exports as an opset-18 ReduceMean that the exporter's
        # down-conversion to opset 17 cannot handle. Same math.
        x = nn.functional.avg_pool2d(x, kernel_size=(x.shape[-2], x.shape[-1]))
        return self.fc(torch.flatten(x, 1))


class EncoderLayer(nn.Module):
    """Post-LN BERT layer written with explicit MatMuls so the exported graph has the usual
    Q/K/V/out/FFN MatMul nodes that both quantizers target."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, ffn)
        self.ff2 = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.o(ctx))
        return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


class BertLikeEncoder(nn.Module):
    """A 6-layer BERT-small-shaped encoder with int64 token ids and an attention mask."""

    def __init__(
        self,
        layers: int = 6,
        hidden: int = 384,
        heads: int = 12,
        ffn: int = 1536,
        max_len: int = 512,
        vocab: int = VOCAB,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.ln(self.tok(input_ids) + self.pos(pos))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return x


@dataclass(frozen=True)
class BenchModel:
    """An exported model and the per-sample input shapes/dtypes the recipe and data need."""

    name: str
    onnx_path: Path
    inputs: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape with batch 1, dtype)


def _export(module: nn.Module, args: tuple, names: list[str], path: Path) -> None:
    """Export with a dynamic batch dim, as one self-contained file.

    torch 2.13's default dynamo exporter (onnxscript installed) is used: its graph is clean
    (BatchNorm folded into Conv, no Shape/Gather chains around each Reshape), which is what a
    user would feed either quantizer. The example batch is 2 because torch.export specialises a
    dimension whose example size is 1. The exporter writes weights as external data; they are
    folded back into the .onnx so the benchmark passes one file to each tool.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = path.parent / f".{path.stem}.export"
    tmp_dir.mkdir(exist_ok=True)
    batch = torch.export.Dim("batch")
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(tmp_dir / "model.onnx"),
            input_names=names,
            output_names=["output"],
            dynamic_shapes=tuple({0: batch} for _ in names),
            opset_version=OPSET,
            dynamo=True,
            verbose=False,
        )
    proto = onnx.load(str(tmp_dir / "model.onnx"))  # pulls the external data in
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if opset != OPSET:
        raise RuntimeError(f"{path.name}: exporter wrote opset {opset}, expected {OPSET}")
    tmp = path.with_suffix(".tmp")
    onnx.save(proto, str(tmp), save_as_external_data=False)
    tmp.replace(path)
    for f in tmp_dir.iterdir():
        f.unlink()
    tmp_dir.rmdir()


def build_cnn(out_dir: Path, small: bool, seed: int = 0) -> BenchModel:
    """ResNet-18 at 224x224 (112x112 with --small, to keep runs short)."""
    size = 112 if small else 224
    path = out_dir / f"resnet18_{size}.onnx"
    shape = (1, 3, size, size)
    if not path.exists():
        torch.manual_seed(seed)
        model = ResNet18().eval()
        _export(model, (torch.randn(2, *shape[1:]),), ["image"], path)
    return BenchModel("cnn", path, {"image": (shape, "float32")})


def build_bert(out_dir: Path, small: bool, seed: int = 0, seq: int = 128) -> BenchModel:
    """The encoder at sequence 128; --small does not change it (its cost is the calibration
    sample count, which the caller already controls)."""
    path = out_dir / f"bert6_s{seq}.onnx"
    shape = (1, seq)
    if not path.exists():
        torch.manual_seed(seed)
        model = BertLikeEncoder().eval()
        ids = torch.randint(0, VOCAB, (2, seq), dtype=torch.int64)
        mask = torch.ones((2, seq), dtype=torch.int64)
        _export(model, (ids, mask), ["input_ids", "attention_mask"], path)
    return BenchModel(
        "bert", path, {"input_ids": (shape, "int64"), "attention_mask": (shape, "int64")}
    )


BUILDERS = {"cnn": build_cnn, "bert": build_bert}


def calibration_inputs(model: BenchModel, samples: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs, identical for both tools: images ~ N(0, 1) (normalised-image statistics);
    token ids uniform over the vocab with a per-sample length in [seq/4, seq] and the padding
    masked out, as a tokenizer batch would be."""
    rng = np.random.default_rng(seed)
    if model.name == "cnn":
        ((shape, _),) = model.inputs.values()
        return {"image": rng.standard_normal((samples, *shape[1:]), dtype=np.float32)}
    seq = model.inputs["input_ids"][0][1]
    lengths = rng.integers(seq // 4, seq + 1, size=samples)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1000, VOCAB, size=(samples, seq), dtype=np.int64)
    ids[:, 0] = 101  # [CLS]
    ids[np.arange(samples), lengths - 1] = 102  # [SEP]
    ids = np.where(mask == 1, ids, 0)  # [PAD]
    return {"input_ids": ids, "attention_mask": mask}
