"""What the gateway lets through to a model without a tensor spec."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from redbatch.api.body import model_input
from redbatch.api.directory import ModelInfo
from redbatch.errors import InvalidPayload
from redbatch.worker.model import batch
from redbatch.worker.process import Worker
from tests.test_gateway import _wait_registered, error_code, gateway

TAGGED = {"__tensor__": {"dtype": "float32", "shape": [1], "data": "AACAPw=="}}


@batch(name="loose", batch_wait_timeout_s=0)
def loose(items: list[Any]) -> list[Any]:
    return items


@pytest.mark.parametrize("value", [
    TAGGED, [1, TAGGED], {"a": {"b": [TAGGED]}}, [[[[{"__tensor__": None}]]]],
], ids=["bare", "in-list", "nested-map", "deep"])
async def test_a_tensor_tagged_map_is_refused_at_once(
        start_worker: Callable[..., Worker], redis_url: str, value: Any) -> None:
    """The worker could not decode it, so it would have been dead-lettered without a
    word and the caller would have waited for its deadline."""
    start_worker([loose])
    async with gateway(redis_url, max_timeout_s=3.0, default_timeout_s=3.0) as http:
        await _wait_registered(http)
        started = time.monotonic()
        resp = await http.post("/v1/models/loose/predict", json={"inputs": value})
        assert resp.status_code == 422, resp.text
        assert error_code(resp) == "invalid_payload"
        assert "__tensor__" in resp.json()["error"]["message"]
        assert time.monotonic() - started < 2.5  # not the deadline's 504
        ok = await http.post("/v1/models/loose/predict",
                             json={"inputs": {"__tensor__": 1, "other": [2]}})
        assert ok.status_code == 200, ok.text  # more keys than the tag: a plain map
        assert ok.json() == {"outputs": {"__tensor__": 1, "other": [2]}}


def test_model_input_walks_deep_bodies_without_recursion() -> None:
    info = ModelInfo(name="loose", input_name="inputs", output_name="outputs", spec=None,
                     meta={})
    deep: list[Any] = []
    inner = deep
    for _ in range(5_000):  # deeper than Python's recursion limit
        inner.append([])
        inner = inner[0]
    with pytest.raises(InvalidPayload, match="deeper than 32"):  # refused, not a crash
        model_input({"inputs": deep}, info)
    shallow: list[Any] = [[[]] * 3] * 10  # 31 deep at most: taken
    assert model_input({"inputs": shallow}, info) is shallow
    with pytest.raises(InvalidPayload, match="__tensor__"):
        model_input({"inputs": [[[TAGGED]]]}, info)
