"""Train the digits CNN and write weights.pt (a state_dict); run from anywhere:

    python examples/digits/train.py

Deterministic: fixed seeds, one thread, mini-batch order from a seeded generator, so a rerun
reproduces weights.pt bit for bit on the same torch build.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data import load_split  # noqa: E402
from model import make_model  # noqa: E402

SEED = 0
EPOCHS = 40
BATCH_SIZE = 64
LEARNING_RATE = 1e-3


def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in eval mode."""
    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(images)).argmax(dim=1).numpy()
    return float((predictions == labels).mean())


def train() -> nn.Module:
    """Adam with cross-entropy over shuffled mini-batches of the train split."""
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    x_train, x_test, y_train, y_test = load_split()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss()
    images, labels = torch.from_numpy(x_train), torch.from_numpy(y_train)
    generator = torch.Generator().manual_seed(SEED)
    for epoch in range(EPOCHS):
        model.train()
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), BATCH_SIZE):
            batch = order[start : start + BATCH_SIZE]
            optimizer.zero_grad()
            loss = loss_fn(model(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
        if (epoch + 1) % 10 == 0:
            print(
                f"epoch {epoch + 1:3d}  loss {loss.item():.4f}  "
                f"train {accuracy(model, x_train, y_train):.4f}  "
                f"test {accuracy(model, x_test, y_test):.4f}"
            )
    print(
        f"final: train accuracy {accuracy(model, x_train, y_train):.4f}, "
        f"held-out accuracy {accuracy(model, x_test, y_test):.4f} ({len(y_test)} images)"
    )
    return model


if __name__ == "__main__":
    trained = train()
    torch.save(trained.state_dict(), HERE / "weights.pt")
    print(f"wrote {HERE / 'weights.pt'}")
