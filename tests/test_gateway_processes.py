"""``redbatch gateway --workers N``: N processes on one port, one set of metrics.

The gateway runs as a real subprocess (``redbatch gateway``, or ``redbatch up`` with its
own workers); a ``gateway`` test's worker runs on the test's loop."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from redbatch import batch, defaults, protocol
from redbatch.config import GatewayConfig, from_env
from redbatch.errors import ConfigError
from redbatch.worker.process import Worker
from tests.conftest import Proc, free_port, redbatch_cmd, test_env, wait_http, wait_live

REQUESTS = 40


@batch(name="twice", batch_wait_timeout_s=0.002)
def twice(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


def start_gateway(spawn: Callable[..., Proc], redis_url: str, **env: str
                  ) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn(redbatch_cmd("gateway", "--workers", "2", "--port", str(port),
                              "--redis-url", redis_url), env=test_env(**env), name="gateway")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", 30, proc)
    deadline = time.monotonic() + 30
    while proc.log().count(f"gateway listening on {base}") < 2:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)
    return proc, base


def gateway_children(proc: Proc) -> list[psutil.Process]:
    """The spawned children: gateway processes (and, under up, worker replicas), not
    multiprocessing's resource tracker."""
    children = psutil.Process(proc.popen.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def metrics_dir_of(proc: Proc) -> Path:
    match = re.search(r"prometheus multiprocess dir: (\S+)", proc.log())
    assert match, proc.log()
    return Path(match.group(1))


def requests_ok(text: str, model: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "redbatch_requests_total"
                    and sample.labels == {"model": model, "outcome": "ok"}):
                return sample.value
    return 0.0


def served_by(pid: int, path: Path, tmp: Path) -> float:
    """The ok requests that process ``pid`` counted, read from its own file."""
    own = tmp / f"pid-{pid}"
    own.mkdir()
    shutil.copy(path / f"counter_{pid}.db", own)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(own))  # type: ignore[no-untyped-call]
    value = registry.get_sample_value("redbatch_requests_total",
                                      {"model": "twice", "outcome": "ok"})
    return value or 0.0


async def predict_fresh(base: str, x: int) -> int:
    """One request on a connection of its own (the kernel picks the process)."""
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(f"{base}/v1/models/twice/predict", json={"inputs": x})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["outputs"])


async def scrape(base: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(f"{base}/metrics")
    assert resp.status_code == 200
    return resp.text


@pytest.mark.e2e
async def test_two_processes_share_the_port_and_one_set_of_counters(
        spawn: Callable[..., Proc], start_worker: Callable[..., Worker], redis_url: str,
        tmp_path: Path) -> None:
    start_worker([twice])
    await wait_live(redis_url, "twice")
    # in a thread: the in-process worker's heartbeats must go on while the gateway starts
    proc, base = await asyncio.to_thread(start_gateway, spawn, redis_url)
    children = gateway_children(proc)
    assert len(children) == 2, proc.log()
    path = metrics_dir_of(proc)
    assert path.is_dir()
    for x in range(REQUESTS):
        assert await predict_fresh(base, x) == 2 * x
    totals = [requests_ok(await scrape(base), "twice") for _ in range(8)]
    assert totals == [REQUESTS] * 8  # whichever process answered: no flapping
    per_process = [served_by(c.pid, path, tmp_path) for c in children]
    assert all(n > 0 for n in per_process), per_process  # both served
    assert sum(per_process) == REQUESTS
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}"
    assert not path.exists()
    for child in children:  # one line each at shutdown, with its exit code
        assert re.search(rf"\(pid {child.pid}\) stopped with exit code (0|-15)\b",
                         proc.log()), proc.log()


def level_depth(text: str, model: str, level: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "redbatch_queue_depth_level" and \
                    sample.labels == {"model": model, "level": level}:
                return sample.value
    return None


@pytest.mark.e2e
async def test_a_level_gone_shows_no_old_depth_with_several_processes(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis) -> None:
    """Each process removed the series of a level gone, but the files the processes
    share kept its last value: the old backlog showed for ever."""
    raw_redis.zadd(protocol.MODELS_KEY, {"lv": protocol.now_ms()})
    raw_redis.set(protocol.meta_key("lv"),
                  '{"name": "lv", "priority": {"levels": 3, "default": 2}}')
    raw_redis.rpush(protocol.queue_key("lv", 3), *[b"x"] * 7)
    proc, base = await asyncio.to_thread(start_gateway, spawn, redis_url)
    texts = [await scrape(base) for _ in range(6)]  # (each process scrapes some)
    assert 7.0 in [level_depth(t, "lv", "3") for t in texts]
    raw_redis.set(protocol.meta_key("lv"), '{"name": "lv"}')  # one level now
    texts = [await scrape(base) for _ in range(8)]
    assert level_depth(texts[-1], "lv", "3") in (None, 0.0), texts[-1]
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log()


@pytest.mark.e2e
def test_a_process_that_dies_stops_the_gateway_with_an_error(
        spawn: Callable[..., Proc], redis_url: str, tmp_path: Path) -> None:
    given = tmp_path / "prom"  # the user's own directory: used, and kept
    proc, base = start_gateway(spawn, redis_url, PROMETHEUS_MULTIPROC_DIR=str(given))
    for _ in range(6):  # in-flight gauges (live mode) appear in each process's files
        httpx.post(f"{base}/v1/models/nobody/predict", json={"inputs": 1}, timeout=10)
    assert list(given.glob("gauge_livesum_*.db")), proc.log()
    victim, other = gateway_children(proc)
    victim.kill()
    assert proc.popen.wait(40) == 2, proc.log()
    assert f"(pid {victim.pid}) exited with code -9" in proc.log()
    assert f"(pid {victim.pid}) stopped with exit code -9" in proc.log()
    _, alive = psutil.wait_procs([other], timeout=10)
    assert not alive
    assert given.is_dir()
    assert not list(given.glob("gauge_livesum_*.db"))  # both marked dead


def test_workers_out_of_range_fail_loudly() -> None:
    for args, env in ((["--workers", "0"], {}), ([], {"REDBATCH_GATEWAY_PROCESSES": "65"})):
        done = subprocess.run(redbatch_cmd("gateway", "--port", str(free_port()), *args),
                              capture_output=True, text=True, timeout=30,
                              env=test_env(**env), check=False)
        assert done.returncode == 2, done.stderr
        assert "must be 1..64" in done.stderr
        assert "listening" not in done.stderr


def test_process_count_comes_from_env_and_defaults_to_two() -> None:
    assert from_env(GatewayConfig, env={}).gateway_processes == defaults.GATEWAY_PROCESSES == 2
    config = from_env(GatewayConfig, env={"REDBATCH_GATEWAY_PROCESSES": "3"})
    assert config.gateway_processes == 3
    with pytest.raises(ConfigError, match=r"must be 1\.\.64"):
        GatewayConfig(gateway_processes=-1)


def test_a_taken_port_is_one_error_even_for_a_shared_socket() -> None:
    port = free_port()
    from redbatch.gateway_server import bind_shared

    first = bind_shared("127.0.0.1", port, 2)  # SO_REUSEPORT: a second group could join
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            bind_shared("127.0.0.1", port, 2)
    finally:
        for sock in first:
            sock.close()


@pytest.mark.e2e
def test_up_runs_several_gateways_beside_the_workers(spawn: Callable[..., Proc],
                                                     redis_url: str) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--gateways", "2", "--port", str(port)),
                 env=test_env(REDIS_URL=redis_url), name="up")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 90, proc)
    for x in range(8):
        resp = httpx.post(f"{base}/v1/models/adder/predict", json={"inputs": x}, timeout=30)
        assert resp.json() == {"outputs": x + 1}
    children = gateway_children(proc)
    assert len(children) == 3, proc.log()  # two gateway processes and one worker replica
    path = metrics_dir_of(proc)
    assert requests_ok(httpx.get(f"{base}/metrics", timeout=10).text, "adder") == 8
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(60) == 0, proc.log()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}"
    assert not path.exists()


@pytest.mark.parametrize("where", ["a-file", "a-file/under-it"])
def test_a_metrics_dir_that_cannot_be_used_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from redbatch.gateway_procs import MULTIPROC_ENV, metrics_dir

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path / where))
    with pytest.raises(ConfigError, match=MULTIPROC_ENV), metrics_dir():
        pass
