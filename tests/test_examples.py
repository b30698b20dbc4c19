"""The examples in ``examples/``, each run the way its docstring says.

* adder: a real worker process; 9 parallel queries; the worker log shows batches.
* doubler: an in-process worker; futures from ``Client.submit`` and ``SyncClient.submit``.
* house_price: a real worker and a real gateway; concurrent HTTP predictions.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from examples import adder as adder_example
from examples import doubler as doubler_example
from examples import house_price as house_example
from redbatch.worker.process import Worker
from tests.conftest import Proc, free_port, redbatch_cmd, wait_http, wait_live

SHAPE_RE = re.compile(r"examples\.adder\[\d+\] batch shape: \((\d+),\)")
WORKER_FLAGS = ("--device", "cpu", "--threads", "1", "--block-timeout-s", "0.2")


async def wait_log(proc: Proc, text: str, timeout_s: float = 30.0) -> None:
    """Wait until ``text`` shows in the process's log (or fail with the log)."""
    deadline = time.monotonic() + timeout_s
    while text not in proc.log():
        if proc.popen.poll() is not None:
            pytest.fail(f"process exited early:\n{proc.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in the log after {timeout_s} s:\n{proc.log()}")
        await asyncio.sleep(0.05)


def start_worker_process(spawn: Callable[..., Proc], target: str, redis_url: str) -> Proc:
    return spawn(redbatch_cmd("worker", target, "--redis-url", redis_url, *WORKER_FLAGS),
                 name="worker")


# --- adder ------------------------------------------------------------------
def test_adder_is_a_batch_function() -> None:
    assert adder_example.adder.name == "adder"
    assert adder_example.adder.policy.max_batch_size == 4
    assert adder_example.adder([0, 1, 2]) == [1, 2, 3]


async def test_adder_batches_parallel_queries(spawn: Callable[..., Proc], redis_url: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    worker = start_worker_process(spawn, "examples.adder:adder", redis_url)
    await wait_log(worker, "serving adder")

    assert await adder_example.query(redis_url) == list(range(1, 10))
    await asyncio.to_thread(adder_example.main, redis_url)
    assert capsys.readouterr().out.strip() == str(list(range(1, 10)))

    shapes = [int(n) for n in SHAPE_RE.findall(worker.log())]
    assert sum(shapes) == 2 * 9, worker.log()  # every query was computed exactly once
    assert all(1 <= n <= 4 for n in shapes), shapes  # max_batch_size=4
    assert max(shapes) > 1, shapes  # concurrent queries shared a batch


# --- doubler ----------------------------------------------------------------
EXPECTED_DOUBLES = [2 * i for i in range(8)]


async def test_doubler_async_submit(start_worker: Callable[..., Worker], redis_url: str
                                    ) -> None:
    start_worker([doubler_example.doubler])
    await wait_live(redis_url, doubler_example.MODEL)
    assert await doubler_example.submit_all(redis_url) == EXPECTED_DOUBLES


async def test_doubler_sync_submit_from_a_thread(start_worker: Callable[..., Worker],
                                                 redis_url: str) -> None:
    start_worker([doubler_example.doubler])
    await wait_live(redis_url, doubler_example.MODEL)
    results = await asyncio.to_thread(doubler_example.submit_all_sync, redis_url)
    assert results == EXPECTED_DOUBLES


# --- house price ------------------------------------------------------------
def test_house_price_policy_uses_the_seed_spelling() -> None:
    policy = house_example.house_price.policy
    assert (policy.max_batch_size, policy.batch_wait_timeout_s) == (32, 0.1)
    assert policy.allow_small_batch


def expected_prices(rows: list[list[float]]) -> list[float]:
    """The same model, built in the test process."""
    model = house_example.build_model().eval()
    with torch.inference_mode():
        return [float(p) for p in model(torch.tensor(rows, dtype=torch.float32))]


def start_stack(spawn: Callable[..., Proc], redis_url: str) -> str:
    """A worker for ``house_price`` and a gateway; return the gateway's base URL."""
    worker = start_worker_process(spawn, "examples.house_price:house_price", redis_url)
    port = free_port()
    gateway = spawn(redbatch_cmd("gateway", "--redis-url", redis_url, "--port", str(port)),
                    name="gateway")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", timeout_s=40.0, proc=gateway)
    assert worker.popen.poll() is None, worker.log()
    return base


async def post_all(base: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    url = f"{base}/v1/models/house_price/predict"
    async with httpx.AsyncClient(timeout=10.0) as http:
        return list(await asyncio.gather(*(http.post(url, json=b) for b in bodies)))


async def test_house_price_over_http(spawn: Callable[..., Proc], redis_url: str) -> None:
    base = await asyncio.to_thread(start_stack, spawn, redis_url)
    rows = np.random.default_rng(1).normal(size=(8, 8)).round(3).tolist()

    replies = await post_all(base, [{"features": row} for row in rows])

    assert [r.status_code for r in replies] == [200] * len(rows), [r.text for r in replies]
    prices = [r.json()["price"] for r in replies]
    assert all(isinstance(p, float) and math.isfinite(p) for p in prices), prices
    assert prices == pytest.approx(expected_prices(rows), abs=1e-4)
    assert all(1 <= int(r.headers["x-redbatch-batch-size"]) <= 32 for r in replies)


async def test_house_price_wrong_length_is_422(spawn: Callable[..., Proc], redis_url: str
                                               ) -> None:
    base = await asyncio.to_thread(start_stack, spawn, redis_url)

    (reply,) = await post_all(base, [{"features": [1.0, 2.0, 3.0]}])

    assert reply.status_code == 422, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["code"] == "invalid_payload"
    assert "shape" in error["message"]
