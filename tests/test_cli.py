"""``redbatch up`` (embedded Redis), the fakeredis fallback, and CLI errors."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import Callable

import httpx
import psutil
import pytest
import redis

from redbatch import Client, batch
from redbatch.embedded import start_embedded
from redbatch.worker.process import Worker
from tests.conftest import ROOT, Proc, free_port, redbatch_cmd, test_env, wait_http


@pytest.mark.e2e
@pytest.mark.parametrize("stop_with", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_up_runs_everything_on_an_embedded_redis(spawn: Callable[..., Proc],
                                                  stop_with: signal.Signals) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--port", str(port)), name="up")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 90, proc)
    resp = httpx.post(f"{base}/v1/models/adder/predict", json={"inputs": 41}, timeout=30)
    assert resp.json() == {"outputs": 42}
    match = re.search(r"embedded redis-server .* at (redis://\S+)", proc.log())
    assert match, proc.log()
    children = psutil.Process(proc.popen.pid).children(recursive=True)
    assert len(children) >= 2  # redis-server and the worker processes
    proc.popen.send_signal(stop_with)
    assert proc.popen.wait(60) == 0, proc.log()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(match.group(1), socket_connect_timeout=1).ping()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}"  # nothing orphaned


@pytest.mark.e2e
def test_up_uses_redis_url_when_set(spawn: Callable[..., Proc], redis_url: str) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--port", str(port)), env=test_env(REDIS_URL=redis_url),
                 name="up")
    wait_http(f"http://127.0.0.1:{port}/readyz", 90, proc)
    assert "using REDIS_URL" in proc.log()
    assert "embedded" not in proc.log()
    assert redis.Redis.from_url(redis_url).zcard("rb:models") == 3


@batch(name="triple", batch_wait_timeout_s=0.01)
def triple(xs: list[int]) -> list[int]:
    return [3 * x for x in xs]


async def test_fakeredis_fallback_serves_the_whole_path(start_worker: Callable[..., Worker]
                                                        ) -> None:
    embedded = start_embedded(prefer_fake=True)
    try:
        assert "fakeredis" in embedded.kind
        start_worker([triple], url=embedded.url)
        async with Client(embedded.url) as client:
            assert await client.predict_many("triple", [1, 2, 3]) == [3, 6, 9]
            for x in (5, 7):  # each arrives while the worker is blocked in its pop
                await asyncio.sleep(0.1)
                assert await client.predict("triple", x, timeout_s=10) == 3 * x
    finally:
        embedded.stop()


def test_bad_worker_target_fails_loudly() -> None:
    result = subprocess.run(redbatch_cmd("worker", "no_such_module:models"), env=test_env(),
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "cannot import 'no_such_module'" in result.stderr


def test_bad_config_names_the_setting() -> None:
    result = subprocess.run([sys.executable, "-m", "redbatch", "gateway"],
                            env=test_env(REDBATCH_PORT="http"), cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "REDBATCH_PORT" in result.stderr


@pytest.mark.parametrize("command", [("up",), ("gateway",), ("worker", "redbatch.demo:models")])
def test_a_mangled_redis_url_fails_in_one_line_without_the_password(command: tuple[str, ...]
                                                                    ) -> None:
    url = "redis://:Qx7/Kp9#Zw4@127.0.0.1:6379/0"  # a password with a raw '/' and '#'
    result = subprocess.run(redbatch_cmd(*command, "--redis-url", url), env=test_env(),
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    output = result.stdout + result.stderr
    assert "percent-encode" in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1, output
    for secret in ("Qx7", "Kp9", "Zw4"):
        assert secret not in output


def test_unverified_tls_is_warned_about() -> None:
    url = f"rediss://127.0.0.1:{free_port()}/0?ssl_cert_reqs=none"
    result = subprocess.run(redbatch_cmd("status", "--redis-url", url), env=test_env(),
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.stderr.count("certificate is NOT verified") == 1, result.stderr
