"""The v1 gateway at its edges: names nobody serves cost bounded memory, outputs JSON
cannot hold, GET on a streaming model, the GET field cap, the key's white space, a
401's request id, and bad entries in Redis, against a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.config import GatewayConfig
from redbatch.errors import ConfigError
from redbatch.registry import LiveCache
from redbatch.worker.model import Model
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.stream_models import counter
from tests.test_gateway import gateway

pytestmark = pytest.mark.timeout(30)


async def test_the_live_cache_keeps_a_bounded_number_of_names(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unknown name a client asks for was kept, forever (430 bytes each)."""
    from redbatch import registry

    monkeypatch.setattr(registry, "MAX_SUMMARIES", 40)
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = LiveCache(client)
        for i in range(200):
            await cache.get(f"nobody{i}")
            assert len(cache._summaries) <= 40
    finally:
        await client.aclose()


def deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


async def test_an_output_json_cannot_hold_is_the_models_error_and_deep_inputs_are_refused(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([Model("bytesout", fn=lambda xs: [b"\x00" for _ in xs]),
                  Model("same", fn=lambda xs: xs)])
    await wait_live(redis_url, "bytesout")
    await wait_live(redis_url, "same")
    async with gateway(redis_url, max_body_bytes=4 << 20) as http:
        resp = await http.post("/v1/models/bytesout/predict", json={"inputs": 1},
                               headers={"X-Request-ID": "mine-1"})
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"]["code"] == "model_error"
        assert resp.headers["x-request-id"] == "mine-1"
        # nested deeper than an entry may be: refused before the model runs
        assert (await http.post("/v1/models/same/predict",
                                json={"inputs": deep(31)})).status_code == 200
        resp = await http.post("/v1/models/same/predict", json={"inputs": deep(300)})
        assert resp.status_code == 422 and "deeper than 32" in resp.text, resp.text
        # more lists and maps than an entry may hold (a body limit raised to allow them):
        # a 400 before the body is parsed
        resp = await http.post("/v1/models/same/predict",
                               content=b'{"inputs":[' + b"[]," * 600_000 + b"[]]}",
                               headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "lists and maps" in resp.text, resp.text


async def test_get_on_a_streaming_model_is_refused_and_get_takes_256_values_and_more(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([counter(size=2), Model("count", fn=lambda xs: [len(x) for x in xs])])
    await wait_live(redis_url, "counter")
    await wait_live(redis_url, "count")
    async with gateway(redis_url) as http:
        resp = await http.get("/v1/models/counter/predict?n=3")
        assert resp.status_code == 400 and "POST" in resp.text, resp.text
        query = "&".join(["inputs=1"] * 256) + "&timeout_ms=5000"
        resp = await http.get(f"/v1/models/count/predict?{query}")
        assert resp.status_code == 200 and resp.json() == {"outputs": 256}, resp.text


async def test_a_key_with_white_space_around_it_and_a_401s_request_id(
        redis_url: str) -> None:
    assert GatewayConfig(api_key="sekrit\n").api_key == "sekrit"
    with pytest.raises(ConfigError, match="white space"):
        GatewayConfig(api_key=" \n")
    async with gateway(redis_url, api_key="sekrit\n") as http:
        resp = await http.post("/v1/models/m/predict", json={"inputs": 1})
        assert resp.status_code == 401 and resp.headers["x-request-id"]
        # a bad X-Request-ID without the key: a 401 of its own id (it was a text 500)
        resp = await http.post("/v1/models/m/predict", json={"inputs": 1},
                               headers={"X-Request-ID": "bad id!"})
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "unauthorized"
        assert resp.headers["x-request-id"] not in ("", "bad id!")
        resp = await http.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert resp.status_code == 200


async def test_a_bad_entry_in_redis_is_left_out_not_fatal(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([Model("fine", fn=lambda xs: xs)])
    await wait_live(redis_url, "fine")
    now = protocol.now_ms()
    raw_redis.zadd(protocol.MODELS_KEY, {"garbled": now, "listy": now, "typed": now})
    raw_redis.set(protocol.meta_key("garbled"), "garbage{")
    raw_redis.set(protocol.meta_key("listy"), "[1, 2]")
    raw_redis.set(protocol.workers_key("typed"), "a string where a sorted set belongs")
    async with gateway(redis_url) as http:
        resp = await http.get("/v1/models")
        assert resp.status_code == 200, resp.text
        assert [m["name"] for m in resp.json()["models"]] == ["fine"]
        assert (await http.get("/readyz")).status_code == 200
        resp = await http.post("/v1/models/garbled/predict", json={"inputs": 1})
        assert resp.status_code == 404, resp.text


async def test_get_sends_a_list_of_one_to_an_input_with_dimensions(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    from redbatch import TensorSpec

    start_worker([Model("lens1", fn=lambda xs: [len(x) for x in xs],
                        spec=TensorSpec("float32", (None,)))])
    await wait_live(redis_url, "lens1")
    async with gateway(redis_url) as http:
        resp = await http.get("/v1/models/lens1/predict?inputs=5")
        assert resp.status_code == 200 and resp.json() == {"outputs": 1}, resp.text
        assert (await http.get("/v1/models/lens1/predict?inputs=5,6")).json() == \
            {"outputs": 2}


async def test_one_unreadable_model_freezes_no_other_models_gauges(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """``aaa``'s queue key holds a string and its capacity an infinite rate: ``bbb``'s
    depth still moves, and the scrape answers."""
    raw_redis.zadd(protocol.MODELS_KEY, dict.fromkeys(("aaa", "bbb", "ccc"), protocol.now_ms()))
    raw_redis.rpush(protocol.queue_key("bbb"), *[b"x"] * 5)
    async with gateway(redis_url) as http:
        assert 'redbatch_queue_depth{model="bbb"} 5.0' in (await http.get("/metrics")).text
        raw_redis.set(protocol.queue_key("aaa"), "a string where a list belongs")
        raw_redis.zadd(protocol.workers_key("ccc"), {"w": protocol.now_ms() + 60_000})
        raw_redis.hset(protocol.worker_capacity_key("ccc"), "w",
                       '{"items_per_s": 1e400, "rows": true, "served_per_s": 1e400}')
        raw_redis.rpush(protocol.queue_key("bbb"), *[b"x"] * 895)
        resp = await http.get("/metrics")
        assert resp.status_code == 200
        assert 'redbatch_queue_depth{model="bbb"} 900.0' in resp.text


async def test_a_models_level_series_go_when_its_levels_do(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Redeployed with one level, a model kept its old levels' depth series forever."""
    raw_redis.zadd(protocol.MODELS_KEY, {"lv": protocol.now_ms()})
    raw_redis.set(protocol.meta_key("lv"),
                  '{"name": "lv", "priority": {"levels": 3, "default": 2}}')
    for level, count in ((1, 4), (3, 7)):
        raw_redis.rpush(protocol.queue_key("lv", level), *[b"x"] * count)
    async with gateway(redis_url) as http:
        text = (await http.get("/metrics")).text
        assert 'redbatch_queue_depth_level{level="3",model="lv"} 7.0' in text, text
        raw_redis.set(protocol.meta_key("lv"), '{"name": "lv"}')
        text = (await http.get("/metrics")).text
        assert 'redbatch_queue_depth_level{level="3",model="lv"}' not in text
        assert 'redbatch_queue_depth{model="lv"} 0.0' in text


async def test_a_port_where_something_else_answers_is_redis_unavailable() -> None:
    """``InvalidResponse`` (an HTTP server on the URL's port) went through untranslated:
    the gateway died with a traceback."""
    import asyncio

    from redbatch import Client
    from redbatch.errors import RedisUnavailable

    async def http_like(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"<html>not redis</html>\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http_like, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RedisUnavailable):
            async with Client(f"redis://127.0.0.1:{port}/0", require_workers=False):
                pass
    finally:
        server.close()
        await server.wait_closed()


def test_an_embedded_redis_that_never_answers_leaves_nothing_behind(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys
    import tempfile
    from pathlib import Path

    from redbatch import embedded
    from redbatch.errors import RedisUnavailable

    fake = Path(str(tmp_path)) / "mute-server"
    fake.write_text(f"#!{sys.executable}\n"
                    "import socket, sys, time\n"
                    "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
                    "s = socket.socket(); s.bind(('127.0.0.1', port)); s.listen()\n"
                    "conns = []\n"
                    "while True: conns.append(s.accept())\n")
    fake.chmod(0o755)
    monkeypatch.setattr(embedded, "START_TIMEOUT_S", 2.0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RedisUnavailable):
        embedded.start_redis_server(str(fake))
    assert [p for p in os.listdir(str(tmp_path)) if p.startswith("redbatch-redis-")] == []


async def test_a_model_the_gateway_knew_that_redis_forgot_is_503_not_404(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """After a Redis restart (or a promoted replica that never got the registration)
    the gateway's own metadata read misses until the workers' next heartbeat: a model
    it read within ``KNOWN_GRACE_S`` is 503 ``no_workers`` (retry), on v1 and v2."""
    raw_redis.set(protocol.meta_key("forgot"), b'{"name": "forgot"}')
    raw_redis.zadd(protocol.workers_key("forgot"), {"w": protocol.now_ms() + 60_000})
    async with gateway(redis_url, meta_refresh_s=0.1) as http:
        assert (await http.get("/v2/models/forgot")).status_code == 200
        raw_redis.delete(protocol.meta_key("forgot"), protocol.workers_key("forgot"))
        await asyncio.sleep(max(defaults.LIVE_REFRESH_S, 0.1) + 0.2)  # caches stale
        v1 = await http.post("/v1/models/forgot/predict", json={"inputs": 1})
        v2 = await http.get("/v2/models/forgot")
        never = await http.post("/v1/models/never/predict", json={"inputs": 1})
    assert (v1.status_code, v2.status_code, never.status_code) == (503, 503, 404), v1.text
    assert v1.headers["retry-after"]


async def test_readiness_asks_of_the_latest_models_first(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Names of retired models stay in ``rb:models``: asking of each, the oldest first,
    took longer than a probe waits (its bound does not end a read redis-py swallows the
    cancel of)."""
    now = protocol.now_ms()
    raw_redis.zadd(protocol.MODELS_KEY, {f"old{i:05}": now - 86_400_000 + i
                                         for i in range(20_000)})
    raw_redis.zadd(protocol.MODELS_KEY, {"alive": now})
    raw_redis.zadd(protocol.workers_key("alive"), {"w": now + 60_000})
    async with gateway(redis_url) as http:
        asked = time.monotonic()
        assert (await http.get("/readyz")).status_code == 200
        assert time.monotonic() - asked < 2 * defaults.PROBE_TIMEOUT_S  # (before: 6.5 s)


async def test_a_registered_name_that_is_not_utf8_or_long_expired_is_left_out(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """A name in ``rb:models`` that is not UTF-8 made ``/metrics``, ``/v1/models`` and
    ``/readyz`` answer 500 (``/readyz`` is the readiness probe); a name whose metadata
    expired long ago was read at every scrape, and is pruned by a heartbeat."""
    now = protocol.now_ms()
    raw_redis.zadd(protocol.MODELS_KEY, {b"\xff\xfe": now + 60_000,
                                         "ancient": now - 2 * protocol.META_TTL_S * 1000})
    start_worker([Model("fine", fn=lambda xs: xs)])
    await wait_live(redis_url, "fine")
    async with gateway(redis_url) as http:
        for path in ("/metrics", "/v1/models", "/readyz", "/v2/health/ready"):
            assert (await http.get(path)).status_code == 200, path
        names = [m["name"] for m in (await http.get("/v1/models")).json()["models"]]
    assert names == ["fine"]
    for _ in range(40):
        if raw_redis.zscore(protocol.MODELS_KEY, "ancient") is None:
            break
        await asyncio.sleep(0.05)
    assert raw_redis.zscore(protocol.MODELS_KEY, "ancient") is None


async def test_v2_stats_and_the_index_leave_out_a_model_whose_keys_cannot_be_read(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """One model's workers key of another type made every model's statistics (and the
    repository index) a 503 saying Redis was away."""
    start_worker([Model("fine", fn=lambda xs: xs)])
    await wait_live(redis_url, "fine")
    raw_redis.zadd(protocol.MODELS_KEY, {"ghost": protocol.now_ms()})
    raw_redis.set(protocol.workers_key("ghost"), "x")
    async with gateway(redis_url) as http:
        stats = await http.get("/v2/models/stats")
        index = await http.post("/v2/repository/index", json={})
    assert stats.status_code == 200, stats.text
    assert [s["name"] for s in stats.json()["model_stats"]] == ["fine"]
    assert index.status_code == 200 and [m["name"] for m in index.json()] == ["fine"]
