"""House-price regression behind the HTTP gateway, ported from a Keras tutorial.

The tutorial trains a small Keras regressor on the California housing data (8
features per district: median income, house age, rooms, ...) and serves it with
batching configured as::

    {"max_batch_size": 32, "timeout_s": 0.1, "allow_small_batch": True}

Here a torch MLP (8 -> 32 -> 1) stands in for the Keras model.  With no downloads
allowed, it is trained for a few steps on synthetic, standardized features made
with a fixed seed, so every worker replica (and a test) builds the same weights.
``torch_model`` builds it inside each worker process, on that worker's device.

How to run it (from the repository root)::

    redis-server --port 6379 --save '' &
    export REDIS_URL=redis://127.0.0.1:6379/0
    python -m redbatch worker examples.house_price:house_price --device cpu --threads 1 &
    python -m redbatch gateway --port 8000 &
    curl -s localhost:8000/v1/models/house_price/predict -H 'content-type: application/json' \\
         -d '{"features": [0.5, -1.0, 0.2, 0.0, 1.3, -0.4, 0.9, -0.7]}'
    # -> {"price":2.20...}   (in units of $100,000, as in the California data)
    python -m examples.house_price   # the same through the Python client

A ``features`` list that is not 8 numbers long is refused with a 422 and a JSON
error body, before it reaches the model.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from redbatch import BatchPolicy, Client, TensorSpec, torch_model

MODEL = "house_price"
N_FEATURES = 8
HIDDEN = 32
SEED = 0
TRAIN_SAMPLES = 512
TRAIN_STEPS = 100
LEARNING_RATE = 0.01

# The tutorial's batching config, in its own spelling ("timeout_s").
BATCHING = {"max_batch_size": 32, "timeout_s": 0.1, "allow_small_batch": True}


def synthetic_data(samples: int = TRAIN_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardized features and prices (in $100k, capped to 0.15..5 as in the
    California data) with a known, slightly non-linear relation.  A private
    generator keeps the global RNG untouched."""
    gen = torch.Generator().manual_seed(SEED)
    features = torch.randn(samples, N_FEATURES, generator=gen)
    weights = torch.linspace(-0.5, 0.8, N_FEATURES)
    noise = 0.1 * torch.randn(samples, generator=gen)
    prices = 2.0 + features @ weights + 0.3 * torch.tanh(features[:, 0]) + noise
    return features, prices.clamp(0.15, 5.0)


def train(model: torch.nn.Module, steps: int = TRAIN_STEPS) -> None:
    """A few full-batch Adam steps on mean squared error (Keras' ``fit``)."""
    features, prices = synthetic_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features), prices)
        loss.backward()
        optimizer.step()


def build_model() -> torch.nn.Module:
    """The regressor: Linear(8, 32) - ReLU - Linear(32, 1) - Softplus (a price is
    positive), one price per row."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1), torch.nn.Softplus(),
        torch.nn.Flatten(0),  # (batch, 1) -> (batch,): each reply is a plain number
    )
    train(model)
    return model


# Each request is {"features": [8 floats]}; the reply is {"price": float}.
house_price = torch_model(
    MODEL, build_model, TensorSpec("float32", (N_FEATURES,)),
    BatchPolicy.from_mapping(BATCHING), input_name="features", output_name="price")


async def predict_prices(rows: list[list[float]], url: str | None = None,
                         timeout_s: float = 10.0) -> list[float]:
    """Ask the worker for the price of each row, all rows in parallel."""
    async with Client(url, default_timeout_s=timeout_s) as client:
        arrays = [np.asarray(row, dtype=np.float32) for row in rows]
        return list(await asyncio.gather(*(client.predict(MODEL, a) for a in arrays)))


def main(url: str | None = None) -> None:
    """Price three synthetic districts through the worker at ``url`` ($REDIS_URL)."""
    rows = synthetic_data(3)[0].tolist()
    for row, price in zip(rows, asyncio.run(predict_prices(rows, url)), strict=True):
        print(f"features={[round(x, 2) for x in row]} -> price={price:.3f} x $100k")


if __name__ == "__main__":
    main()
