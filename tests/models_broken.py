"""A model whose build fails in every replica (``tests.models_broken:broken``)."""

from __future__ import annotations

from redbatch.worker.model import BatchFn, Model


def _build(device: str) -> BatchFn:
    raise FileNotFoundError(f"no weights at /models/missing.pt for {device}")


broken = Model("broken", loader=_build)
