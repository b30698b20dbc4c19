"""``redbatch up`` (embedded Redis), the fakeredis fallback, and CLI errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
import redis
import torch

from redbatch import Client, batch
from redbatch.embedded import start_embedded
from redbatch.errors import ConfigError
from redbatch.worker.process import Worker
from tests.conftest import (
    DEMO_NAMES,
    ROOT,
    Proc,
    free_port,
    redbatch_cmd,
    test_env,
    wait_http,
    wait_live,
    wait_registered,
)


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
    # the demo models and the demo pipeline
    assert wait_registered(redis_url) >= DEMO_NAMES


@batch(name="triple", batch_wait_timeout_s=0.01)
def triple(xs: list[int]) -> list[int]:
    return [3 * x for x in xs]


async def test_fakeredis_fallback_serves_the_whole_path(start_worker: Callable[..., Worker]
                                                        ) -> None:
    embedded = start_embedded(prefer_fake=True)
    try:
        assert "fakeredis" in embedded.kind
        start_worker([triple], url=embedded.url)
        await wait_live(embedded.url, "triple")
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


def _fails_in_one_line(*args: str, says: str, secret: str = "", **env: str) -> None:
    result = subprocess.run(redbatch_cmd(*args), env=test_env(**env), cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert says in output and "Traceback" not in output, output
    assert not secret or secret not in output


def test_an_unreachable_cluster_and_a_bad_log_level_fail_in_one_line(tmp_path: Path) -> None:
    _fails_in_one_line("status", says="cannot read redis at redis+cluster://:***@",
                       secret="Qx7Kp9", REDIS_URL="redis+cluster://:Qx7Kp9@127.0.0.1:1")
    _fails_in_one_line("status", "--log-level", "bogus", says="the log level")
    for flag in (("status", "--interval-s", "inf"), ("jobs", "status", "x", "--poll-s", "0")):
        # (inf hung, 0 spun)
        _fails_in_one_line(*flag, says="must be a number of seconds > 0 and at most 86400")
    _fails_in_one_line("worker", "redbatch.demo:models", "--block-timeout-s", "20",
                       says="must exceed block_timeout_s (20.0)",
                       REDIS_URL="redis://127.0.0.1:1")
    declared = tmp_path / "pipe.toml"
    declared.write_text("[[models]]\ntarget = 'redbatch.demo:models'\n"
                        "[[pipelines]]\nname = 'p'\nstages = ['tok', 'textcls']\n")
    _fails_in_one_line("up", "-c", str(declared), says="redis at redis://127.0.0.1:1 "
                       "unavailable", REDIS_URL="redis://127.0.0.1:1")


def test_unverified_tls_is_warned_about() -> None:
    url = f"rediss://127.0.0.1:{free_port()}/0?ssl_cert_reqs=none"
    result = subprocess.run(redbatch_cmd("status", "--redis-url", url), env=test_env(),
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.stderr.count("certificate is NOT verified") == 1, result.stderr


def run_cli(*args: str, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(redbatch_cmd(*args), env=test_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.parametrize("env", [
    {"REDBATCH_SOCKET_TIMEOUT_S": "1.5"},  # not above the blocking timeout by 1 s
    {"REDBATCH_WAIT_REPLICAS": "1", "REDBATCH_WAIT_TIMEOUT_MS": "9000",
     "REDBATCH_SOCKET_TIMEOUT_S": "5"},  # a WAIT past the socket's timeout
])
def test_gateway_settings_that_do_not_hold_together_fail_once_before_binding(
        env: dict[str, str]) -> None:
    port = free_port()
    result = run_cli("gateway", "--port", str(port), "--workers", "4",
                     "--redis-url", f"redis://127.0.0.1:{free_port()}/0", **env)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "socket_timeout" in errors[0], result.stderr
    assert "listening" not in result.stderr and "gateway process" not in result.stderr


@pytest.mark.e2e
def test_a_model_that_never_builds_stops_the_worker(redis_url: str) -> None:
    result = run_cli("worker", "tests.models_broken:broken", "--redis-url", redis_url,
                     "--max-failed-starts", "2", timeout_s=55)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "failed to start 2 times in a row" in last, result.stderr
    assert "FileNotFoundError: no weights at /models/missing.pt" in last
    assert result.stderr.count("started worker replica") == 2
    assert result.stderr.count("Traceback") == 1  # the first failure only
    assert "restart #2" not in result.stderr


@pytest.mark.e2e
def test_up_stops_when_its_model_never_builds() -> None:
    result = run_cli("up", "--models", "tests.models_broken:broken", "--port",
                     str(free_port()), "--max-failed-starts", "2", timeout_s=55)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "failed to start 2 times in a row" in last, result.stderr
    assert "FileNotFoundError: no weights" in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_on_a_host_without_it_fails_at_once() -> None:
    result = run_cli("worker", "tests.models_broken:broken", "--device", "cuda")
    assert result.returncode == 2, result.stderr
    assert "CUDA is not available" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.stderr and "started worker" not in result.stderr


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_a_taken_port_is_one_clear_error(redis_url: str, command: str) -> None:
    """``up`` too, before any worker starts (a replica started, reached "serving",
    claiming from a shared Redis, then stopped: the port was bound after the
    workers started)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(command, "--redis-url", redis_url, "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "pick one with --port" in result.stderr
    assert "listening" not in result.stderr and "Traceback" not in result.stderr
    assert "started worker" not in result.stderr, result.stderr


@pytest.mark.parametrize("host", ["not a host", "192.0.2.1"])  # (TEST-NET-1: not ours)
def test_a_host_that_is_not_ours_is_one_clear_error(host: str) -> None:
    from redbatch.gateway_server import bind

    with pytest.raises(ConfigError, match="pick one with --host"):
        bind(host, free_port()).close()


def test_listening_is_logged_once_the_port_is_bound(spawn: Callable[..., Proc],
                                                    redis_url: str) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("gateway", "--redis-url", redis_url, "--port", str(port)),
                 name="gateway")
    deadline = time.monotonic() + 30
    while f"listening on http://127.0.0.1:{port}" not in proc.log():
        assert time.monotonic() < deadline and proc.popen.poll() is None, proc.log()
        time.sleep(0.05)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the port was bound when the line was written


@pytest.mark.e2e
def test_up_with_a_bad_redis_setting_leaves_no_embedded_redis_behind(tmp_path: Path) -> None:
    result = run_cli("up", "--port", str(free_port()), TMPDIR=str(tmp_path),
                     REDBATCH_CONNECT_TIMEOUT_S="0")
    assert result.returncode == 2, result.stderr
    assert "connect_timeout_s" in result.stderr
    assert list(tmp_path.iterdir()) == []  # its work folder removed: it was stopped


@pytest.mark.e2e
def test_a_gateway_whose_startup_fails_exits_2_in_one_line(redis_url: str) -> None:
    """uvicorn ends a failed start with exit 3 (the worker pool's "drained" code)."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "nowait", "on", ">pw", "~*", "&*", "+@all",
                          "-wait")
    admin.close()
    port = redis_url.rsplit(":", 1)[1].split("/", maxsplit=1)[0]
    result = run_cli("gateway", "--redis-url", f"redis://nowait:pw@127.0.0.1:{port}/0",
                     "--port", str(free_port()), "--workers", "1", timeout_s=30,
                     REDBATCH_WAIT_REPLICAS="1")
    assert result.returncode == 2, result.stderr
    assert "the gateway did not start" in result.stderr.strip().splitlines()[-1]


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_gateway_processes_die_with_their_parent(redis_url: str) -> None:
    """A parent killed outright (SIGKILL, the OOM killer) left its gateway processes
    serving, holding the port."""
    port = free_port()
    proc = subprocess.Popen(redbatch_cmd("gateway", "--redis-url", redis_url, "--port",
                                         str(port), "--workers", "2"),
                            env=test_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30
        while len(parent.children()) < 2 or not _listening(port):
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        children = parent.children()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        _gone, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
