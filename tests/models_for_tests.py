"""Models for worker processes that tests spawn (``tests.models_for_tests:...``)."""

from __future__ import annotations

import dataclasses
import os
import time

from redbatch import batch
from redbatch.worker.model import Model


@batch(name="slow", max_batch_size=8, batch_wait_timeout_s=0.0)
def slow(xs: list[int]) -> list[int]:
    """Sleeps ``SLOW_FORWARD_S`` (default 2 s) per batch, then echoes."""
    time.sleep(float(os.environ.get("SLOW_FORWARD_S", "2")))
    return xs


@batch(name="slow_levels", max_batch_size=8, batch_wait_timeout_s=0.0, priority_levels=3,
       default_priority=2)
def slow_levels(xs: list[int]) -> list[int]:
    """``slow`` with three priority levels."""
    time.sleep(float(os.environ.get("SLOW_FORWARD_S", "2")))
    return xs


@batch(name="adder", max_batch_size=8, batch_wait_timeout_s=0.002)
def adder(xs: list[int]) -> list[int]:
    """Adds one."""
    return [x + 1 for x in xs]


def mlp_with_levels() -> list[Model]:
    """The demo's ``mlp`` (the model of deploy/k8s's autoscaling examples) with two
    priority levels, so that it has per-level series too (tests/test_prometheus.py)."""
    from redbatch.demo import models

    return [dataclasses.replace(m, priority_levels=2) for m in models() if m.name == "mlp"]


def two_primaries() -> list[Model]:
    """``adder`` as ``a1`` and ``b2``: on a cluster made by ``redis-cli --cluster
    create`` with 3 primaries, their slots (7785 and 15193, by CRC16 of the tag) are
    owned by two different primaries."""
    return [dataclasses.replace(adder, name=name) for name in ("a1", "b2")]


FACTORY_CALLS: list[int] = []  # ``counted_factory``'s calls in this process


def counted_factory() -> list[Model]:
    """``adder`` from a factory that counts its calls (the pool's own process must not
    call it: ``loader.check_target``)."""
    FACTORY_CALLS.append(1)
    return [adder]


not_models = [1, 2]  # (a target that names no model)
