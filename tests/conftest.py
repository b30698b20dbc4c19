"""Shared fixtures: real redis-server processes on free ports, workers, gateways.

* ``redis_server_factory()`` starts a private ``redis-server`` (killable, restartable).
* ``redis_url`` is a clean database on the session's server, flushed after each test.
* ``start_worker(models)`` runs an in-process ``Worker`` (asyncio task) for a test.
* ``spawn(cmd)`` runs a real subprocess and kills it (and logs it) at teardown.
* ``redis_cluster`` / ``redis_sentinel``: a real Redis Cluster / Sentinel set-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from redbatch import protocol
from redbatch.config import RedisSettings, WorkerConfig
from redbatch.embedded import free_port
from redbatch.redis_conn import sync_client
from redbatch.worker.model import Model
from redbatch.worker.process import Worker
from tests import engines
from tests.engines import ClusterEngine, SentinelEngine

ROOT = Path(__file__).resolve().parent.parent
REDIS_BIN = shutil.which("redis-server")


@pytest.fixture(autouse=True)
def no_leaked_resources() -> Iterator[None]:
    """Fail the test that left an unclosed resource (a socket, a transport, a
    redis-py connection): collected here, after its own fixtures' teardown, instead of
    in whichever later test the collector happens to run.  With ``PYTHONTRACEMALLOC=N``
    the failure shows where the object was allocated.  The heap alive after the first
    test (the imports') is frozen out of the collector: a collection costs ~2 ms, not 50."""
    yield
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    if not gc.get_freeze_count():  # the imports' heap, walked by no collection after
        gc.freeze()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    for other in caught:
        if other not in leaks:
            warnings.warn_explicit(other.message, other.category, other.filename,
                                   other.lineno, source=other.source)
    if leaks:
        pytest.fail("\n\n".join(_leak_report(w) for w in leaks), pytrace=False)


def _leak_report(leak: warnings.WarningMessage) -> str:
    trace = tracemalloc.get_object_traceback(leak.source) if leak.source else None
    if trace is not None:
        where = "\n".join(trace.format())
    elif tracemalloc.is_tracing():
        where = "(not traced: see the other objects of this leak)"
    else:
        where = "(run with PYTHONTRACEMALLOC=25 for where it was allocated)"
    return f"{leak.category.__name__}: {leak.message}\nallocated at:\n{where}"


@dataclass
class RedisServer:
    """A private redis-server on a free port that a test may kill and restart."""

    port: int = field(default_factory=free_port)
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rb-test-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS_BIN, "redis-server is not installed (scripts/test installs it)"
        self.proc = engines.spawn_redis(self.port, self.workdir,
                                        ["--save", "", "--appendonly", "no", *self.args])
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)


@pytest.fixture(scope="session")
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(args=list(args)).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.kill()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def session_redis(redis_server_factory: Callable[[], RedisServer]) -> RedisServer:
    return redis_server_factory()


@pytest.fixture
def redis_url(session_redis: RedisServer) -> Iterator[str]:
    client = session_redis.client()
    client.flushall()
    yield session_redis.url
    client.flushall()
    client.close()


@pytest.fixture
def raw_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    client.close()


FAST_WORKER = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=2.0)


@pytest.fixture
async def start_worker(redis_url: str) -> AsyncIterator[Callable[..., Worker]]:
    """Run ``Worker(models)`` as a task on the test's loop; stopped at teardown."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    def start(models: list[Model], url: str | None = None,
              config: WorkerConfig = FAST_WORKER, pipelines: list[Any] | None = None
              ) -> Worker:
        worker = Worker(models, RedisSettings(url or redis_url), config, pipelines=pipelines)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(worker.run(stop))))
        return worker

    yield start
    for stop, _task in running:
        stop.set()
    for _stop, task in running:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def wait_live(url: str, model: str, timeout_s: float = 30.0) -> None:
    """Wait until a worker of ``model`` holds a live lease (clients refuse a model that
    has none, so a test that starts its worker and its client together waits first)."""
    client = sync_client(RedisSettings(url, socket_timeout_s=5.0))  # any URL form
    deadline = time.monotonic() + timeout_s
    try:
        while not client.zcount(protocol.workers_key(model), protocol.now_ms(), "+inf"):
            assert time.monotonic() < deadline, f"no live worker of {model!r}"
            await asyncio.sleep(0.02)
    finally:
        client.close()


async def until(check: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Wait until ``check()`` holds, polling; fail naming ``what`` after ``timeout_s``
    (generous: a loaded 2-core machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def connected(pool: Any) -> int:
    """How many connections of a redis-py asyncio pool are open (idle or in use)."""
    return sum(conn.is_connected for conn in (*pool._available_connections,
                                              *pool._in_use_connections))


async def ping_once_ended(client: Any, started: asyncio.Event) -> None:
    """Wait until cancelled, then send one more command on ``client`` (as a task does
    that goes on after its cancel: a read's retry, a cancel's mark)."""
    try:
        started.set()
        await asyncio.Event().wait()
    finally:
        await client.ping()


DEMO_NAMES = frozenset({"mlp", "echo", "echo_tokens", "textcls", "adder", "pair", "generate",
                        "tok", "classify_text"})


def wait_registered(url: str, names: frozenset[str] = DEMO_NAMES,
                    timeout_s: float = 30.0) -> set[str]:
    """Wait until every one of ``names`` is in the model directory (``rb:models``) and
    return what is there.  /readyz means some worker is live; a pipeline's first beat
    comes from the worker's pipeline duty a moment after its models' first beat."""
    client = sync_client(RedisSettings(url, socket_timeout_s=5.0))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            served = {m.decode() for m in client.zrange(protocol.MODELS_KEY, 0, -1)}
            if names <= served or time.monotonic() > deadline:
                return served
            time.sleep(0.05)
    finally:
        client.close()


def test_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    log_path: Path
    out: Any = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Spawner:
    """Subprocesses with their output in log files under ``log_dir``; ``stop()``
    SIGTERMs each one's process group, then SIGKILLs what is left after 15 s."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def __call__(self, args: list[str], env: dict[str, str] | None = None,
                 name: str = "proc") -> Proc:
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        out = log_path.open("w")
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True,
                                 env=env or test_env(), cwd=ROOT, start_new_session=True)
        proc = Proc(popen, log_path, out)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(5)
            proc.out.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    """Start a subprocess (output to a log file); SIGTERM, then SIGKILL at teardown."""
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.stop()


def redbatch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "redbatch", *args]


def wait_http(url: str, timeout_s: float = 30.0, proc: Proc | None = None) -> None:
    """Wait until ``url`` answers 200 (e.g. /readyz), or fail with the process log."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(f"process exited early:\n{proc.log()}")
        try:
            last = httpx.get(url, timeout=1.0)
            if last.status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    pytest.fail(f"{url} not ready in {timeout_s} s (last: {last})\n"
                f"{proc.log() if proc else ''}")


def _engine(engine: Any) -> Iterator[Any]:
    assert engines.have_binaries(), "redis-server and redis-cli are needed"
    try:
        yield engine.start()
    finally:
        engine.stop()


@pytest.fixture
def redis_cluster() -> Iterator[ClusterEngine]:
    """A fresh real Redis Cluster (3 primaries, 3 replicas; ``tests/engines.py``)."""
    yield from _engine(ClusterEngine())


@pytest.fixture
def redis_sentinel() -> Iterator[SentinelEngine]:
    """A fresh real Sentinel set-up (primary, replica, 3 sentinels; ``tests/engines.py``)."""
    yield from _engine(SentinelEngine())
