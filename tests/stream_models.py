"""Streaming models for the streaming tests (``tests.stream_models:...`` in spawned
workers too).  Input ``{"n": chunks, "tag": text}``; chunk i is ``f"{tag}{i}"``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from redbatch import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.stream_batch import STOP, StreamBatch

STEPS: list[list[str]] = []  # the members (keys) of every step, in-process models
STARTS: list[int] = [0]  # how many generators counting and held_counting started
STEP_S = float(os.environ.get("STREAM_STEP_S", "0"))
DIE_AT = int(os.environ.get("STREAM_DIE_AT", "-1"))  # crasher: exit at this chunk,
DIE_FILE = os.environ.get("STREAM_DIE_FILE", "")  # once: the file it then creates says so


def _die_now(sent: dict[str, int]) -> bool:
    if DIE_AT < 0 or max(sent.values()) <= DIE_AT or os.path.exists(DIE_FILE):
        return False
    with open(DIE_FILE, "w"):
        return True


def _items(batch: StreamBatch, sent: dict[str, int]) -> list[Any]:
    for key, _value in batch.joined():
        sent[key] = 0
    STEPS.append(batch.keys)
    out: list[Any] = []
    for key, value in zip(batch.keys, batch, strict=True):
        i = sent[key]
        if value.get("fail") == i:
            raise ValueError("asked to fail")
        if value.get("fail_one") == i:  # this member alone fails
            out.append(ValueError("asked to fail this one"))
        else:
            out.append(STOP if i >= value["n"] else f"{value.get('tag', '')}{i}")
        sent[key] = i + 1
    return out


def counting(batch: StreamBatch) -> Iterator[list[Any]]:
    STARTS[0] += 1
    sent: dict[str, int] = {}
    while len(batch):
        items = _items(batch, sent)
        if _die_now(sent):
            os._exit(17)  # a crash mid-stream: no reply, no cleanup
        time.sleep(STEP_S)
        yield items


async def counting_async(batch: StreamBatch) -> AsyncIterator[list[Any]]:
    sent: dict[str, int] = {}
    while len(batch):
        await asyncio.sleep(0)
        yield _items(batch, sent)


def checked_counting(batch: StreamBatch) -> Iterator[list[Any]]:
    """``counting``, but a batch holding a ``refuse`` input raises when called, before
    its generator exists (a function that checks its batch first)."""
    if any(value.get("refuse") for value in batch):
        raise ValueError("refused before its first step")
    return counting(batch)


def checked(size: int = 4) -> Model:
    return Model("checked", fn=checked_counting, policy=policy(size), streaming=True)


def policy(size: int, wait_s: float = 0.05) -> BatchPolicy:
    return BatchPolicy(max_batch_size=size, batch_wait_timeout_s=wait_s)


def counter(size: int = 2, continuous: bool = True, name: str = "counter",
            wait_s: float = 0.05) -> Model:
    return Model(name, fn=counting, policy=policy(size, wait_s), continuous=continuous)


def counter_async() -> Model:
    return Model("acounter", fn=counting_async, policy=policy(4))


crasher = Model("crasher", fn=counting, policy=policy(4, 0.2))


def fixed_counting(batch: StreamBatch) -> Iterator[list[Any]]:
    """Reads its inputs once, as Ray's streaming batches do (``continuous=False``):
    a batch that changed under it would fail the contract."""
    values = list(batch)
    keys = batch.keys
    STEPS.append(keys)
    for i in range(max(v["n"] for v in values) + 1):
        time.sleep(STEP_S)
        if any(v.get("fail") == i for v in values):
            raise ValueError("asked to fail")
        yield [STOP if i >= v["n"] else f"{v.get('tag', '')}{i}" for v in values]


def fixed(size: int = 2) -> Model:  # (``fail``: it raises at that step)
    return Model("fixed", fn=fixed_counting, policy=policy(size, 0.3), continuous=False)


def raw_bytes(batch: StreamBatch) -> Iterator[list[Any]]:
    """Yields bytes, which JSON cannot carry (a msgpack caller gets them whole)."""
    yield [b"\x00\x01" for _ in batch]  # then it returns: its members end


def bytes_model() -> Model:
    return Model("bytesm", fn=raw_bytes, policy=policy(2, 0.0))


RUNS: list[int] = [0]  # noisy: how many times its generator started


def noisy_counting(batch: StreamBatch) -> Iterator[list[Any]]:
    """A counter whose chunks name its run: a rerun yields other chunks."""
    RUNS[0] += 1
    run = RUNS[0]
    sent: dict[str, int] = {}
    while len(batch):
        yield [f"{run}:{item}" if isinstance(item, str) else item
               for item in _items(batch, sent)]


def noisy() -> Model:
    return Model("noisy", fn=noisy_counting, policy=policy(2))


HELD = threading.Event()  # held_counting: a rerun waits at its first step
RELEASE = threading.Event()  # ... until this is set


def held_counting(batch: StreamBatch) -> Iterator[list[Any]]:
    """A counter whose reruns (each generator after the first) wait at their first
    step until ``RELEASE`` is set (``HELD`` says one waits)."""
    STARTS[0] += 1
    if STARTS[0] > 1:
        HELD.set()
        RELEASE.wait(10)
    sent: dict[str, int] = {}
    while len(batch):
        time.sleep(STEP_S)
        yield _items(batch, sent)


def held() -> Model:
    return Model("held", fn=held_counting, policy=policy(2, 0.3))


FULL_AT: list[int | None] = [None]  # filling: the step its cache is full at


def filling(batch: StreamBatch) -> Iterator[list[Any]]:
    """A counter whose cache fills up: the first generator that holds ``FULL_SIZE``
    members sets ``FULL_AT`` three steps later, and every generator (reruns too) raises
    at that step of its own, whatever its input."""
    STARTS[0] += 1
    sent: dict[str, int] = {}
    step = 0
    while len(batch):
        if FULL_AT[0] is None and len(batch) >= FULL_SIZE:
            FULL_AT[0] = step + 3
        if step == FULL_AT[0]:
            raise ValueError("cache full")
        step += 1
        time.sleep(0.002)
        yield _items(batch, sent)


FULL_SIZE = 16


def full(size: int = FULL_SIZE) -> Model:
    return Model("full", fn=filling, policy=policy(size, 0.05))


def two_steps(batch: StreamBatch) -> Iterator[list[Any]]:
    """Yields two chunks for its members, then returns (they end); a member with
    ``fail`` makes its first step raise."""
    for step in range(2):
        time.sleep(0.05)
        if any(value.get("fail") for value in batch):
            raise ValueError("asked to fail")
        yield [str(step) for _ in batch]


def brief(size: int = 2) -> Model:
    return Model("brief", fn=two_steps, policy=policy(size, 0.3))


def reset() -> None:
    """Forget what earlier tests' models counted."""
    STEPS.clear()
    STARTS[0] = RUNS[0] = 0
    FULL_AT[0] = None
    HELD.clear()
    RELEASE.clear()
