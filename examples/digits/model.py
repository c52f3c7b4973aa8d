"""Small CNN for the 8x8 scikit-learn digits, the bundled quantization example.

Layers are named attributes (not an anonymous Sequential) so the exported ONNX node names read
`/conv1/Conv`, `/fc1/Gemm`, ... and recipe overrides can name layers by their module path.
"""

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Three convolutions and two linear layers: Conv, Gemm and a pooling op to quantize."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.relu3 = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64 * 4 * 4, 64)
        self.relu4 = nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Map a [B, 1, 8, 8] batch of images scaled to [0, 1] to [B, 10] class logits."""
        x = self.relu1(self.conv1(image))
        x = self.pool(self.relu2(self.conv2(x)))
        x = self.relu3(self.conv3(x))
        x = self.relu4(self.fc1(self.flatten(x)))
        return self.fc2(x)


def make_model() -> nn.Module:
    """Entry point named in recipe.yaml (`model.py:make_model`); weights come from weights.pt."""
    return DigitsCNN()
