"""Prometheus metrics (gateway /metrics, a worker replica's port) and X-Request-ID."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from redbatch import metrics, protocol
from redbatch.worker.process import Worker
from tests.conftest import Proc, free_port, redbatch_cmd, test_env, wait_http
from tests.test_gateway import VEC, _wait_registered, broken, gateway


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """The worker records a batch just after publishing its replies: wait for it."""
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


@pytest.fixture
async def http(start_worker: Callable[..., Worker], redis_url: str
               ) -> AsyncIterator[httpx.AsyncClient]:
    start_worker([VEC, broken])
    async with gateway(redis_url, default_timeout_s=5.0) as client:
        await _wait_registered(client)
        yield client


async def test_gateway_counts_outcomes_and_latency(http: httpx.AsyncClient) -> None:
    ok = sample("redbatch_requests_total", model="vec", outcome="ok")
    invalid = sample("redbatch_requests_total", model="vec", outcome="invalid")
    errors = sample("redbatch_requests_total", model="broken", outcome="error")
    unknown = sample("redbatch_requests_total", model=metrics.UNKNOWN_MODEL,
                     outcome="invalid")
    seen = sample("redbatch_request_duration_seconds_count", model="vec")
    for _ in range(3):
        assert (await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})).is_success
    assert (await http.post("/v1/models/vec/predict", json={"x": [1]})).status_code == 422
    assert (await http.post("/v1/models/broken/predict", json={"inputs": 1})).status_code == 500
    assert (await http.post("/v1/models/nope-123/predict", json={})).status_code == 404
    assert sample("redbatch_requests_total", model="vec", outcome="ok") == ok + 3
    assert sample("redbatch_requests_total", model="vec", outcome="invalid") == invalid + 1
    assert sample("redbatch_requests_total", model="broken", outcome="error") == errors + 1
    assert sample("redbatch_requests_total", model=metrics.UNKNOWN_MODEL,
                  outcome="invalid") == unknown + 1  # URL names never become labels
    assert sample("redbatch_request_duration_seconds_count", model="vec") == seen + 4
    assert sample("redbatch_inflight_requests", model="vec") == 0


def test_a_request_duration_has_buckets_up_to_the_furthest_deadline() -> None:
    """A long stream's duration (up to its deadline, 600 s at most) lands in a bucket
    of its own, not all in +Inf past 60 s."""
    for histogram in (metrics.REQUEST_DURATION, metrics.STREAM_FIRST_CHUNK):
        child = histogram.labels("bucket-probe")
        child.observe(250.0)
        uppers = [s.labels["le"] for m in histogram.collect() for s in m.samples
                  if s.name.endswith("_bucket") and s.labels["model"] == "bucket-probe"
                  and s.value == 1.0]
        assert uppers[0] == "300.0" and float(uppers[-2]) == protocol.MAX_TIMEOUT_S
        histogram.remove("bucket-probe")


async def test_v2_infer_is_counted_as_v1_predict_is(http: httpx.AsyncClient) -> None:
    ok = sample("redbatch_requests_total", model="vec", outcome="ok")
    invalid = sample("redbatch_requests_total", model="vec", outcome="invalid")
    seen = sample("redbatch_request_duration_seconds_count", model="vec")
    tensor = {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}
    resp = await http.post("/v2/models/vec/infer", json={"inputs": [tensor]})
    assert resp.status_code == 200, resp.text
    bad = await http.post("/v2/models/vec/infer", json={"inputs": [{**tensor, "shape": [3]}]})
    assert bad.status_code == 400
    scraped = (await http.get("/metrics")).text
    counted = {(s.labels.get("model"), s.labels.get("outcome")): s.value
               for f in text_string_to_metric_families(scraped)
               if f.name == "redbatch_requests" for s in f.samples
               if s.name == "redbatch_requests_total"}
    assert counted[("vec", "ok")] == ok + 1
    assert counted[("vec", "invalid")] == invalid + 1
    assert sample("redbatch_request_duration_seconds_count", model="vec") == seen + 2
    assert sample("redbatch_inflight_requests", model="vec") == 0


async def test_metrics_endpoint_has_every_gateway_series_and_live_gauges(
        http: httpx.AsyncClient) -> None:
    assert (await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})).is_success
    resp = await http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in metrics.GATEWAY_METRICS:  # counters' families drop the _total suffix
        assert name.removesuffix("_total") in families, name
    live = {s.labels["model"]: s.value for s in families["redbatch_live_workers"].samples}
    depth = {s.labels["model"]: s.value for s in families["redbatch_queue_depth"].samples}
    assert live["vec"] == 1 and depth["vec"] == 0


async def test_worker_counts_batches_items_and_dead_letters(http: httpx.AsyncClient,
                                                             raw_redis: object) -> None:
    batches = sample("redbatch_batch_size_count", model="vec")
    computed = sample("redbatch_worker_items_total", model="vec", outcome="computed")
    errored = sample("redbatch_worker_items_total", model="broken", outcome="error")
    dead = sample("redbatch_dead_letters_total", model="vec")
    assert (await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})).is_success
    await http.post("/v1/models/broken/predict", json={"inputs": 1})
    import redis as sync_redis

    assert isinstance(raw_redis, sync_redis.Redis)
    raw_redis.rpush(protocol.queue_key("vec"), b"\xc1 not msgpack")
    resp = await http.post("/v1/models/vec/predict", json={"x": [4, 5, 6]})
    assert resp.is_success
    assert await eventually(lambda: sample("redbatch_worker_items_total", model="vec",
                                           outcome="computed") == computed + 2)
    assert await eventually(lambda: sample("redbatch_worker_items_total", model="broken",
                                           outcome="error") == errored + 1)
    assert await eventually(lambda: sample("redbatch_dead_letters_total", model="vec") ==
                            dead + 1)
    assert sample("redbatch_batch_size_count", model="vec") >= batches + 1
    assert sample("redbatch_forward_seconds_count", model="vec") >= 2
    assert sample("redbatch_queue_wait_seconds_count", model="vec") >= 2


def test_every_exported_name_is_registered() -> None:
    registered = {m.name for m in REGISTRY.collect()}
    for name in metrics.GATEWAY_METRICS + metrics.WORKER_METRICS:
        assert name.removesuffix("_total") in registered, name
    assert "redbatch_batch_size_bucket" in metrics.series_names()
    assert "redbatch_retries_total" in metrics.series_names()


async def test_request_id_in_and_out(http: httpx.AsyncClient,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="redbatch.worker")
    mine = "trace-abc.123:x/y"
    resp = await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]},
                           headers={"X-Request-ID": mine})
    assert resp.headers["x-request-id"] == mine
    assert await eventually(lambda: any(mine in r.getMessage() for r in caplog.records))
    fresh = await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]})
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    failed = await http.post("/v1/models/vec/predict", json={"x": [1]},
                             headers={"X-Request-ID": "err-1"})
    assert failed.status_code == 422 and failed.headers["x-request-id"] == "err-1"
    bad = await http.post("/v1/models/vec/predict", json={"x": [1, 2, 3]},
                          headers={"X-Request-ID": "has spaces"})
    assert bad.status_code == 400 and "X-Request-ID" in bad.json()["error"]["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])  # ours, not theirs


def test_trace_id_on_the_wire() -> None:
    req = protocol.Request("r1", "m", 1, 2, "rb:reply:{m}:c", 3, trace_id="t-1")
    assert protocol.request_from_wire(req.to_wire()).trace_id == "t-1"
    assert "trace_id" not in protocol.Request("r1", "m", 1, 2, "rb:reply:{m}:c", 3).to_wire()
    wire = {**req.to_wire(), "trace_id": "x" * 129}  # dropped: it never costs the request
    assert protocol.request_from_wire(wire).trace_id == ""


def test_worker_replica_serves_metrics_on_its_port(spawn: Callable[..., Proc],
                                                   redis_url: str) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("worker", "redbatch.demo:models", "--redis-url", redis_url,
                              "--device", "cpu", "--metrics-port", str(port)),
                 env=test_env(), name="worker")
    wait_http(f"http://127.0.0.1:{port}/metrics", proc=proc)
    import redbatch

    with redbatch.SyncClient(redis_url, require_workers=False) as client:
        assert client.predict("adder", 41) == 42
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    counts = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "redbatch_batch_size_count" and s.labels["model"] == "adder"]
    assert counts and counts[0].value >= 1
