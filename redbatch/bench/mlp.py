"""The W2 model (docs/benchmarks.md): Linear(64,1024)-ReLU-Linear(1024,1024)-
ReLU-Linear(1024,16), seed 0.  Imports only torch, so that the Ray Serve comparison
(``ray_app.py``, run by another Python) can load this file too."""

from typing import Any

W2_IN, W2_HIDDEN, W2_OUT = 64, 1024, 16


def build_mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(W2_IN, W2_HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(W2_HIDDEN, W2_HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(W2_HIDDEN, W2_OUT),
    )
