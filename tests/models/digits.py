"""A small CNN for scikit-learn's 8x8 digits, trained deterministically in a few seconds on a CPU."""

from __future__ import annotations

from typing import Any

import numpy as np


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels): float32 NCHW in [0, 1], a fixed 75/25 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.75 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def make_digits_cnn() -> Any:
    import torch.nn as nn

    class DigitsCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 10))

        def forward(self, x: Any) -> Any:
            return self.classifier(self.features(x))

    return DigitsCNN()


def _train(make: Any, epochs: int, lr: float, batch_size: int) -> tuple[Any, float]:
    """Train ``make()`` on the digits, deterministically: the module (in eval mode) and its test accuracy."""
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    x_train, y_train, x_test, y_test = digits_split()
    model = make()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    xs, ys = torch.from_numpy(x_train), torch.from_numpy(y_train)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(xs), generator=generator).split(batch_size):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs[batch]), ys[batch])
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    return model, accuracy


def train_digits_cnn(epochs: int = 8) -> tuple[Any, float]:
    """The trained CNN (in eval mode) and its test accuracy."""
    return _train(make_digits_cnn, epochs, 3e-3, 64)


def make_digits_lstm() -> Any:
    """A bidirectional LSTM reading a digit's 8 rows as a sequence (the shape of a text-line recognizer's head)."""
    import torch.nn as nn

    class DigitsLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 32, bidirectional=True)
            self.classifier = nn.Linear(64, 10)

        def forward(self, x: Any) -> Any:
            rows = x[:, 0].permute(1, 0, 2)  # [N, 1, 8, 8] -> [8 rows, N, 8]
            out, _ = self.lstm(rows)
            return self.classifier(out[-1])

    return DigitsLSTM()


def train_digits_lstm(epochs: int = 40) -> tuple[Any, float]:
    """The trained LSTM (in eval mode) and its test accuracy."""
    return _train(make_digits_lstm, epochs, 1e-2, 128)
