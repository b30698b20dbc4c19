"""TLS (rediss://), ACL users, secrets kept out of logs, and the gateway's API key."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from redbatch import Client, RedisSettings, RedisUnavailable, batch
from redbatch.config import WorkerConfig
from redbatch.errors import ConfigError
from redbatch.worker.process import Worker
from tests.conftest import RedisServer, free_port
from tests.test_gateway import _wait_registered, gateway

CONFIG = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0)
SECRET = "s3cret-Pa55"


@batch(name="plus", max_batch_size=8, batch_wait_timeout_s=0.0)
def plus(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


@pytest.fixture
def acl_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    server = redis_server_factory()
    client = server.client()
    client.acl_setuser("app", enabled=True, passwords=[f"+{SECRET}"], keys=["*"],
                       channels=["*"], commands=["+@all"])
    client.config_set("requirepass", "admin-only")
    client.close()
    return server


async def test_acl_user_from_the_url(acl_server: RedisServer, start_worker: Callable[..., Worker],
                                     caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://app:{SECRET}@127.0.0.1:{acl_server.port}/0"
    caplog.set_level(logging.DEBUG, logger="redbatch")
    start_worker([plus], url=url, config=CONFIG)
    async with Client(url, require_workers=False) as client:
        assert await client.predict("plus", 1) == 2
    assert SECRET not in caplog.text
    assert SECRET not in repr(RedisSettings(url))


async def test_wrong_password_is_a_typed_error_without_the_secret(acl_server: RedisServer
                                                                  ) -> None:
    url = f"redis://app:wrong-{SECRET}@127.0.0.1:{acl_server.port}/0"
    with pytest.raises(RedisUnavailable) as info:
        await asyncio.wait_for(Client(url, require_workers=False).start(), 10)
    assert SECRET not in str(info.value) and "***" in str(info.value)


async def test_a_worker_refused_its_credentials_stops_with_a_config_error(
        acl_server: RedisServer) -> None:
    url = f"redis://app:wrong-{SECRET}@127.0.0.1:{acl_server.port}/0"
    worker = Worker([plus], RedisSettings(url), CONFIG, device="cpu")
    served: list[bool] = []
    worker.on_serving = lambda: served.append(True)
    with pytest.raises(ConfigError, match="refused this worker's credentials") as info:
        await asyncio.wait_for(worker.run(asyncio.Event()), 10)  # (not retried forever)
    assert SECRET not in str(info.value) and "***" in str(info.value) and not served


async def test_a_worker_stopped_before_it_registers_never_says_it_serves(
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens: its registration retries until the stop
    worker = Worker([plus], RedisSettings(f"redis://127.0.0.1:{port}/0"), CONFIG, device="cpu")
    served: list[bool] = []
    worker.on_serving = lambda: served.append(True)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, stop.set)
    caplog.set_level(logging.INFO, logger="redbatch")
    await asyncio.wait_for(worker.run(stop), 10)
    assert not served and "serving" not in caplog.text


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server that speaks only TLS, with a self-signed certificate."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--port",
         "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"],
        stdout=subprocess.DEVNULL)
    yield port, cert
    proc.kill()
    proc.wait(10)


async def test_tls_rediss_url(tls_server: tuple[int, Path],
                              start_worker: Callable[..., Worker]) -> None:
    port, cert = tls_server
    url = f"rediss://localhost:{port}/0?ssl_ca_certs={cert}"
    for _ in range(50):
        try:
            async with Client(url, require_workers=False) as probe:
                await probe.redis.ping()
            break
        except RedisUnavailable:
            await asyncio.sleep(0.1)
    start_worker([plus], url=url, config=CONFIG)
    async with Client(url, require_workers=False) as client:
        assert await client.predict_many("plus", [1, 2, 3]) == [2, 3, 4]


async def test_gateway_api_key(start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([plus], config=CONFIG)
    async with gateway(redis_url, api_key="k3y") as http:
        assert (await http.get("/healthz")).status_code == 200
        await _wait_registered(http)
        denied = await http.post("/v1/models/plus/predict", json={"inputs": 1})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "unauthorized"
        wrong = await http.post("/v1/models/plus/predict", json={"inputs": 1},
                                headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        for headers in ({"authorization": "Bearer k3y"}, {"x-api-key": "k3y"}):
            ok = await http.post("/v1/models/plus/predict", json={"inputs": 1}, headers=headers)
            assert ok.status_code == 200 and ok.json() == {"outputs": 2}
        for path in ("/v2/health/live", "/v2/health/ready", "/openapi.json", "/metrics"):
            assert (await http.get(path)).status_code == 200, path  # open, like /healthz
        for path in ("/v1/models", "/v2/models/plus", "/v1/stats"):
            assert (await http.get(path)).status_code == 401, path
        v2 = await http.post("/v2/models/plus/infer", json={"inputs": []})
        assert v2.status_code == 401  # in v2's shape: tritonclient reads a string there
        assert v2.json() == {"error": "missing or wrong API key"}
        assert (await http.get("/v2/models/stats")).json() == v2.json()


def test_api_key_not_in_config_repr() -> None:
    from redbatch.config import GatewayConfig

    assert "k3y" not in repr(GatewayConfig(api_key="k3y"))


async def test_ready_checks_reveal_nothing_of_redis(caplog: pytest.LogCaptureFixture) -> None:
    """They are open without the key: the address, user and error stay in the log."""
    port = free_port()  # nothing listens there
    url = f"redis://alice:{SECRET}@127.0.0.1:{port}/7"
    caplog.set_level(logging.WARNING, logger="redbatch")
    async with gateway(url, api_key="k3y") as http:
        for path in ("/readyz", "/v2/health/ready"):
            resp = await http.get(path)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1", path
            assert "redis unavailable" in resp.text, resp.text
            for secret in ("127.0.0.1", str(port), "alice", SECRET, "/7", "Error", "refused",
                           "Connect"):
                assert secret not in resp.text, (path, secret, resp.text)
    assert str(port) in caplog.text and SECRET not in caplog.text  # the detail is logged


async def test_predict_needs_a_json_content_type(start_worker: Callable[..., Worker],
                                                 redis_url: str) -> None:
    """A page on another site can make a browser post text/plain or a form without a
    CORS preflight: such bodies are refused, so a keyless gateway is not driven so."""
    start_worker([plus], config=CONFIG)
    async with gateway(redis_url) as http:
        await _wait_registered(http)
        for refused in ("text/plain", "text/plain;charset=UTF-8",
                        "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                        "application/jsonx", "application/msgpack"):
            resp = await http.post("/v1/models/plus/predict", content=b'{"inputs": 1}',
                                   headers={"content-type": refused})
            assert resp.status_code == 415, (refused, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "unsupported_media_type" and "application/json" in error[
                "message"]
            assert resp.headers["x-request-id"]
        for accepted in ("application/json", "Application/JSON; charset=utf-8", None):
            headers = {"content-type": accepted} if accepted else {}
            resp = await http.post("/v1/models/plus/predict", content=b'{"inputs": 1}',
                                   headers=headers)
            assert resp.status_code == 200 and resp.json() == {"outputs": 2}, accepted


V2_BODY = b'{"inputs": [{"name": "inputs", "datatype": "INT64", "shape": [1], "data": [1]}]}'


async def test_v2_infer_refuses_the_types_a_cross_site_form_can_send(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The same for v2 infer, which also takes its binary extension's type."""
    start_worker([plus], config=CONFIG)
    async with gateway(redis_url) as http:
        await _wait_registered(http)
        for refused in ("text/plain", "application/x-www-form-urlencoded",
                        "multipart/form-data; b=x"):
            for path in ("/v2/models/plus/infer", "/v2/models/plus/versions/1/infer"):
                resp = await http.post(path, content=V2_BODY, headers={"content-type": refused})
                assert resp.status_code == 415, (refused, path, resp.text)
                assert "application/octet-stream" in resp.json()["error"]  # (v2: a string)
        for accepted in ("application/json", "application/octet-stream", None):
            headers = {"content-type": accepted} if accepted else {}
            resp = await http.post("/v2/models/plus/infer", content=V2_BODY, headers=headers)
            assert resp.status_code == 200, (accepted, resp.text)
            assert resp.json()["outputs"][0]["data"] == [2], accepted
