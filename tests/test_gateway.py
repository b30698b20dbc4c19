"""The HTTP gateway in-process (httpx ASGI transport) against a real Redis."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette

from redbatch import GatewayConfig, Model, RedisSettings, TensorSpec, batch, metrics
from redbatch.api import create_app
from redbatch.worker.process import Worker
from tests.conftest import RedisServer


def vec_sum(xs: list[object]) -> list[float]:
    return [float(sum(x)) for x in xs]  # type: ignore[call-overload]


VEC = Model("vec", fn=vec_sum, spec=TensorSpec("float32", (3,)), input_name="x",
            output_name="y")


@batch(name="sleepy", batch_wait_timeout_s=0)
def sleepy(xs: list[int]) -> list[int]:
    time.sleep(1.0)
    return xs


@batch(name="broken", batch_wait_timeout_s=0)
def broken(xs: list[int]) -> list[int]:
    raise ValueError("bad weights")


@asynccontextmanager
async def gateway(url: str | RedisSettings, **config: object
                  ) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_app(url, **config) as (_app, client):
        yield client


@asynccontextmanager
async def gateway_app(url: str | RedisSettings, **config: object
                      ) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The app (``app.state.gateway``: its ``Gateway``) and an HTTP client of it; ``url``
    may be whole settings (a cluster's timeouts)."""
    settings = url if isinstance(url, RedisSettings) else RedisSettings(url)
    app = create_app(GatewayConfig(**config), settings)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=10) as client:
            yield app, client


@pytest.fixture
async def http(start_worker: Callable[..., Worker], redis_url: str
               ) -> AsyncIterator[httpx.AsyncClient]:
    start_worker([VEC, sleepy, broken])
    async with gateway(redis_url, max_body_bytes=2048, max_timeout_s=5.0,
                       default_timeout_s=5.0) as client:
        await _wait_registered(client)
        yield client


async def _wait_registered(client: httpx.AsyncClient) -> None:
    for _ in range(100):
        if (await client.get("/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    pytest.fail("worker never registered")


def error_code(resp: httpx.Response) -> str:
    body = resp.json()
    assert "Traceback" not in resp.text
    assert body["error"]["message"]
    return str(body["error"]["code"])


async def test_predict_ok(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3.5]})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"y": 6.5}
    assert int(resp.headers["x-redbatch-batch-size"]) >= 1


async def test_concurrent_predicts_batch(http: httpx.AsyncClient) -> None:
    responses = await asyncio.gather(*(http.post("/v1/models/vec/predict",
                                                 json={"x": [i, 0, 0]}) for i in range(20)))
    assert [r.json()["y"] for r in responses] == [float(i) for i in range(20)]


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/models/nope/predict", json={"x": [1, 2, 3]})
    assert resp.status_code == 404 and error_code(resp) == "unknown_model"
    resp = await http.post("/v1/models/bad%20name/predict", json={"x": [1, 2, 3]})
    assert resp.status_code in (404, 422)


@pytest.mark.parametrize(("body", "status"), [
    (b"", 400), (b"{", 400), (b"[1, 2, 3]", 400), (b'{"x": [1, 2, NaN]}', 400),
    (b'{"x": [1, 2]}', 422), (b'{"x": [[1, 2, 3]]}', 422), (b'{"x": ["a", "b", "c"]}', 422),
    (b'{"x": [1e39, 0, 0]}', 422), (b'{"y": [1, 2, 3]}', 422), (b'{"x": null}', 422),
    (b'{"x": [1, 2, 3], "timeout_ms": -5}', 400), (b'{"x": [1, 2, 3], "timeout_ms": "z"}', 400),
])
async def test_bad_bodies_get_4xx_with_a_message(http: httpx.AsyncClient, body: bytes,
                                                  status: int) -> None:
    resp = await http.post("/v1/models/vec/predict", content=body,
                           headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error_code(resp)


async def test_body_over_the_limit_is_413(http: httpx.AsyncClient) -> None:
    big = b'{"x": [' + b"1," * 2000 + b"1]}"
    resp = await http.post("/v1/models/vec/predict", content=big)
    assert resp.status_code == 413 and error_code(resp) == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"x": ['
        for _ in range(100):
            yield b"1," * 20
        yield b"1]}"

    resp = await http.post("/v1/models/vec/predict", content=chunks())
    assert resp.status_code == 413


async def test_client_can_shorten_its_deadline(http: httpx.AsyncClient) -> None:
    started = time.monotonic()
    resp = await http.post("/v1/models/sleepy/predict", json={"inputs": 1},
                           headers={"x-redbatch-timeout-ms": "200"})
    assert resp.status_code == 504 and error_code(resp) == "deadline_exceeded"
    assert time.monotonic() - started < 0.9  # well before the 1 s forward ends


async def test_a_504_names_the_request_the_worker_logs(http: httpx.AsyncClient,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    caplog.set_level(logging.DEBUG, logger="redbatch.worker")
    resp = await http.post("/v1/models/sleepy/predict", json={"inputs": 1},
                           headers={"x-redbatch-timeout-ms": "200"})
    assert resp.status_code == 504
    request_id = resp.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    deadline = time.monotonic() + 5
    while not any("request_ids=" in r.getMessage() and request_id in r.getMessage()
                  for r in caplog.records):
        assert time.monotonic() < deadline, "the worker never logged the timed-out request"
        await asyncio.sleep(0.05)


async def test_client_cannot_lengthen_past_the_maximum(start_worker: Callable[..., Worker],
                                                       redis_url: str) -> None:
    start_worker([sleepy])
    async with gateway(redis_url, max_timeout_s=0.3, default_timeout_s=0.3) as client:
        await _wait_registered(client)
        started = time.monotonic()
        resp = await client.post("/v1/models/sleepy/predict",
                                 json={"inputs": 1, "timeout_ms": 60_000})
        assert resp.status_code == 504
        assert time.monotonic() - started < 0.9


async def test_model_error_is_json_not_traceback(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/models/broken/predict", json={"inputs": 1})
    assert resp.status_code == 500 and error_code(resp) == "model_error"
    assert "bad weights" in resp.json()["error"]["message"]


async def test_unknown_routes_and_methods_are_json(http: httpx.AsyncClient) -> None:
    resp = await http.get("/nowhere")
    assert resp.status_code == 404 and error_code(resp) == "http_error"
    resp = await http.put("/v1/models/vec/predict", json={"x": [1, 2, 3]})
    assert resp.status_code == 405  # GET and POST predict; nothing else


async def test_models_listing_and_health(http: httpx.AsyncClient) -> None:
    listing = (await http.get("/v1/models")).json()["models"]
    by_name = {m["name"]: m for m in listing}
    assert set(by_name) == {"vec", "sleepy", "broken"}
    assert by_name["vec"]["live_workers"] == 1
    assert by_name["vec"]["queue_depth"] == 0
    assert by_name["vec"]["spec"] == {"dtype": "float32", "shape": [3]}
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/readyz")).status_code == 200


async def test_readyz_without_workers_is_503(redis_url: str) -> None:
    async with gateway(redis_url) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 503 and error_code(resp) == "no_workers"


def _unknown_outcomes(outcome: str) -> float:
    found = REGISTRY.get_sample_value("redbatch_requests_total",
                                      {"model": metrics.UNKNOWN_MODEL, "outcome": outcome})
    return found or 0.0


async def test_redis_down_is_503(redis_server_factory: Callable[[], RedisServer]) -> None:
    server = redis_server_factory()
    counted = {o: _unknown_outcomes(o) for o in ("error", "rejected")}
    async with gateway(server.url) as client:
        server.kill()
        resp = await client.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})
        assert resp.status_code == 503 and error_code(resp) == "redis_unavailable"
        assert resp.headers["retry-after"] == "1"
        assert {o: _unknown_outcomes(o) for o in counted} == {  # Redis away: no back-
            "error": counted["error"] + 1, "rejected": counted["rejected"]}  # pressure
        port = str(urlsplit(server.url).port)  # Redis's address stays in the gateway log
        assert port not in resp.text, resp.text
        v2 = await client.post("/v2/models/vec/infer", json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]})
        assert v2.status_code == 503 and port not in v2.text, v2.text
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200


async def test_gateway_starts_while_redis_is_down(redis_server_factory: Callable[[], RedisServer]
                                                  ) -> None:
    server = redis_server_factory()
    server.kill()
    async with gateway(server.url) as client:
        resp = await client.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})
        assert resp.status_code == 503
