"""``GET /v1/models/{model}/predict?field=value``: the input in the query string,
through the same core (and checks, and errors) as a POST."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from redbatch import batch
from redbatch.worker.process import Worker
from tests.test_gateway import VEC, _wait_registered, error_code, gateway, sleepy
from tests.test_metrics import sample


@batch(name="adder", batch_wait_timeout_s=0)
def adder(ns: list[int]) -> list[int]:  # no TensorSpec
    return [n + 1 for n in ns]


@pytest.fixture
async def http(start_worker: Callable[..., Worker], redis_url: str
               ) -> AsyncIterator[httpx.AsyncClient]:
    start_worker([VEC, adder, sleepy])
    async with gateway(redis_url, default_timeout_s=5.0, api_key="k3y") as client:
        client.headers["x-api-key"] = "k3y"
        await _wait_registered(client)
        yield client


async def test_get_a_scalar_as_the_tutorial_does(http: httpx.AsyncClient) -> None:
    resp = await http.get("/v1/models/adder/predict?inputs=41")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"outputs": 42}
    assert resp.headers["x-request-id"] and int(resp.headers["x-redbatch-batch-size"]) >= 1
    posted = await http.post("/v1/models/adder/predict", json={"inputs": 41})
    assert posted.json() == resp.json()


async def test_head_answers_as_get_does_without_a_body(http: httpx.AsyncClient) -> None:
    """HEAD, which the route lists in its ``Allow``, is a GET's answer without the body
    (it was read as a POST without a body: a 400)."""
    for path in ("/v1/models/adder/predict?inputs=41",
                 "/v1/models/adder/versions/1/predict?inputs=41"):
        resp = await http.head(path)
        assert resp.status_code == 200, (path, resp.headers)
        assert resp.headers["content-type"] == "application/json" and resp.headers[
            "x-request-id"]


async def test_metrics_answer_get_and_head_alone(http: httpx.AsyncClient) -> None:
    assert (await http.get("/metrics")).status_code == 200
    assert (await http.head("/metrics")).status_code == 200
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        resp = await http.request(method, "/metrics")
        assert resp.status_code == 405, method
        assert resp.headers["allow"] == "GET, HEAD"
        assert resp.json()["error"]["code"] == "http_error"


@pytest.mark.parametrize("query", ["x=1,2,3.5", "x=1&x=2&x=3.5", "x=1%2C2%2C3.5&other=z"])
async def test_get_a_list_from_commas_or_repeated_keys(http: httpx.AsyncClient,
                                                       query: str) -> None:
    resp = await http.get(f"/v1/models/vec/predict?{query}")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"y": 6.5}


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/v1/models/nope-123/predict?inputs=1", 404, "unknown_model"),
    ("/v1/models/adder/predict?inputs=abc", 400, "bad_request"),
    ("/v1/models/adder/predict?inputs=1e999", 400, "bad_request"),
    ("/v1/models/adder/predict?inputs=1,", 400, "bad_request"),
    ("/v1/models/adder/predict?inputs=%FF", 400, "bad_request"),
    ("/v1/models/adder/predict?inputs=1&timeout_ms=0", 400, "bad_request"),
    ("/v1/models/adder/predict?inputs=1&timeout_ms=5&timeout_ms=9", 400, "bad_request"),
    ("/v1/models/adder/predict?input=1", 422, "invalid_payload"),
    ("/v1/models/vec/predict?x=1,2", 422, "invalid_payload"),
])
async def test_get_errors_are_a_posts(http: httpx.AsyncClient, path: str, status: int,
                                      code: str) -> None:
    resp = await http.get(path)
    assert resp.status_code == status, resp.text
    assert error_code(resp) == code and resp.headers["x-request-id"]


async def test_get_refuses_a_body_and_too_many_values(http: httpx.AsyncClient) -> None:
    resp = await http.request("GET", "/v1/models/adder/predict?inputs=1", content=b"{}")
    assert resp.status_code == 400 and "query string" in resp.json()["error"]["message"]
    many = ",".join(["1"] * 300)
    resp = await http.get(f"/v1/models/adder/predict?inputs={many}")
    assert resp.status_code == 400 and error_code(resp) == "bad_request"


@pytest.mark.parametrize("how", ["query", "header"])
async def test_get_timeout_from_the_query_or_the_header(http: httpx.AsyncClient,
                                                        how: str) -> None:
    path, headers = "/v1/models/sleepy/predict?inputs=1", {}
    if how == "query":
        path += "&timeout_ms=200"
    else:
        headers["x-redbatch-timeout-ms"] = "200"
    started = time.monotonic()
    resp = await http.get(path, headers=headers)
    assert resp.status_code == 504 and error_code(resp) == "deadline_exceeded"
    assert time.monotonic() - started < 0.9  # sleepy takes 1 s


async def test_get_needs_the_api_key_and_is_counted(http: httpx.AsyncClient) -> None:
    denied = await http.get("/v1/models/adder/predict?inputs=1", headers={"x-api-key": "no"})
    assert denied.status_code == 401 and error_code(denied) == "unauthorized"
    ok = sample("redbatch_requests_total", model="adder", outcome="ok")
    bad = sample("redbatch_requests_total", model="adder", outcome="invalid")
    assert (await http.get("/v1/models/adder/predict?inputs=1")).status_code == 200
    assert (await http.get("/v1/models/adder/predict?inputs=x")).status_code == 400
    assert sample("redbatch_requests_total", model="adder", outcome="ok") == ok + 1
    assert sample("redbatch_requests_total", model="adder", outcome="invalid") == bad + 1
    assert sample("redbatch_inflight_requests", model="adder") == 0
