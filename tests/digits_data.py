"""The 8x8 digits (scikit-learn's load_digits) as the tests' and benches' models see them:
images in [0, 1] with a channel axis, their labels, the same shuffle (seed 0) everywhere."""

from __future__ import annotations

import numpy as np


def images() -> np.ndarray:
    """Every image, (1797, 8, 8, 1) float32 in [0, 1], in the data set's order."""
    from sklearn.datasets import load_digits  # the dev extra (49 MB, with scipy)

    return (load_digits().images / 16.0).astype(np.float32)[..., None]


def labels() -> np.ndarray:
    """Every image's digit, int32, in the data set's order."""
    from sklearn.datasets import load_digits

    return load_digits().target.astype(np.int32)


def shuffled() -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) in one fixed random order."""
    x, y = images(), labels()
    perm = np.random.default_rng(0).permutation(len(x))
    return x[perm], y[perm]


def split(train: int = 1400) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """((training images, labels), (held-out images, labels)) of the shuffled set."""
    x, y = shuffled()
    return (x[:train], y[:train]), (x[train:], y[train:])
