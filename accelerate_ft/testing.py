"""Test support: a small model and dataset for Accelerate loops that make exact resume hard (dropout, an
optional BatchNorm, random augmentation in ``__getitem__``, samples that carry their index), used by the
tests and the chaos benchmark, and usable for your own checks of a resume.

Example:
    >>> data = IndexedData(8)
    >>> x, y, index = data[3]
    >>> tuple(x.shape), tuple(y.shape), index, data.loaded
    ((8,), (1,), 3, 1)
    >>> [type(m).__name__ for m in toy_model(batchnorm=True)]
    ['Linear', 'BatchNorm1d', 'ReLU', 'Dropout', 'Linear']
"""

from __future__ import annotations

import random

import numpy as np
import torch


class IndexedData(torch.utils.data.Dataset):
    """``(x, y, index)`` samples that count how often they are loaded (in this process).

    With ``augment``, ``__getitem__`` draws random numbers like a random crop or masking does, from
    torch's, Python's and NumPy's global RNGs (in the main process, or in a worker).
    """

    def __init__(self, n: int, augment: bool = False, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.augment = augment
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.loaded += 1
        x = self.x[i]
        if self.augment:
            x = x * (torch.rand(8) > 0.2) + random.gauss(0, 0.1) + float(np.random.uniform(-0.1, 0.1))
        return x, self.y[i], i


def toy_model(batchnorm: bool = False) -> torch.nn.Sequential:
    """An MLP over :class:`IndexedData`'s 8 features with dropout (so the RNG matters) and, with ``batchnorm``,
    BatchNorm running statistics (buffers that differ per rank under DDP)."""
    layers = [torch.nn.Linear(8, 32), *([torch.nn.BatchNorm1d(32)] if batchnorm else []), torch.nn.ReLU(),
              torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)]
    return torch.nn.Sequential(*layers)
