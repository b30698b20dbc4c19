"""TLS and the sentinels' own password on the several-node URLs, against real servers:
a one-node Redis Cluster that speaks TLS only (``?ssl=true&ssl_ca_certs=...``), and a
TLS primary watched by a sentinel that speaks TLS and requires a password
(``?sentinel_password=...``).  A worker and a client serve ``adder`` through each."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import RedisClusterException

from redbatch.config import RedisSettings, WorkerConfig
from redbatch.embedded import free_port
from redbatch.errors import RedisUnavailable
from redbatch.producer.client import Client
from redbatch.redis_conn import sync_client
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.engines import REDIS_BIN, SERVICE, have_binaries
from tests.models_for_tests import adder

pytestmark = [pytest.mark.engines, pytest.mark.timeout(60),
              pytest.mark.skipif(not have_binaries(), reason="needs redis-server")]
WORKER = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=2.0)
SENTINEL_PASSWORD = "s3ntinel-Pw"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    """A CA, and a server certificate it signed for 127.0.0.1."""
    with tempfile.TemporaryDirectory(prefix="rb-tls-") as name:
        where = Path(name)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                 "/CN=rb-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=where)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                 "-keyout", "server.key", "-out", "server.csr", cwd=where)
        (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem",
                 cwd=where)
        yield where


def _tls_args(certs: Path, port: int) -> list[str]:
    return ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(certs / "server.pem"), "--tls-key-file",
            str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.pem"),
            "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
            "--loglevel", "warning"]


class Servers:
    """``redis-server`` processes started by a test, killed (and their directories
    removed) at its end."""

    def __init__(self, certs: Path) -> None:
        self.certs = certs
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dirs: list[tempfile.TemporaryDirectory[str]] = []

    def start(self, *args: str) -> int:
        """A TLS-only server (``args`` first: a config file's path must lead)."""
        assert REDIS_BIN
        port, workdir = free_port(), tempfile.TemporaryDirectory(prefix="rb-tls-node-")
        self._dirs.append(workdir)
        self._procs.append(subprocess.Popen(
            [REDIS_BIN, *args, *_tls_args(self.certs, port), "--dir", workdir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return port

    def client(self, port: int, **extra: Any) -> redis.Redis:
        return redis.Redis(port=port, ssl=True, ssl_ca_certs=str(self.certs / "ca.pem"),
                           socket_timeout=2, socket_connect_timeout=2, **extra)

    def stop(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait(10)
        for workdir in self._dirs:
            workdir.cleanup()


@pytest.fixture
def servers(certs: Path) -> Iterator[Servers]:
    started = Servers(certs)
    yield started
    started.stop()


def _until(what: str, check: Callable[[], Any], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            pass
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.05)


def _tls_cluster(servers: Servers) -> int:
    """One TLS-only cluster node holding every slot."""
    port = servers.start("--cluster-enabled", "yes", "--tls-cluster", "yes",
                         "--cluster-port", str(free_port()))
    _until("answering", lambda: servers.client(port).ping())
    servers.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    _until("a formed cluster", lambda: b"cluster_state:ok" in servers.client(port)
           .execute_command("CLUSTER", "INFO"))
    return port


def _tls_sentinel(servers: Servers) -> int:
    """A TLS primary, and one TLS sentinel watching it that requires a password."""
    primary = servers.start()
    _until("answering", lambda: servers.client(primary).ping())
    conf = Path(tempfile.mkdtemp(prefix="rb-tls-sentinel-")) / "sentinel.conf"
    conf.write_text("\n".join([f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 1",
                               "tls-replication yes", f"requirepass {SENTINEL_PASSWORD}", ""]))
    sentinel = servers.start(str(conf), "--sentinel")
    _until("watching", lambda: servers.client(sentinel, password=SENTINEL_PASSWORD)
           .execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE))
    return sentinel


async def _serves(url: str, start_worker: Callable[..., Worker]) -> None:
    settings = RedisSettings(url, socket_timeout_s=3.0, connect_timeout_s=1.0)
    start_worker([adder], url=url, config=WORKER)
    async with Client(settings=settings) as producer:
        await wait_live(url, "adder")
        assert await producer.predict_many("adder", list(range(10)), timeout_s=5) == \
            list(range(1, 11))


async def test_a_cluster_over_tls(servers: Servers, certs: Path,
                                  start_worker: Callable[..., Worker]) -> None:
    port = _tls_cluster(servers)
    ca = certs / "ca.pem"
    await _serves(f"redis+cluster://127.0.0.1:{port}?ssl=true&ssl_ca_certs={ca}", start_worker)
    plain = RedisSettings(f"redis+cluster://127.0.0.1:{port}", connect_timeout_s=0.5,
                          socket_timeout_s=0.5)
    with pytest.raises(RedisClusterException):  # no TLS: the node does not answer
        sync_client(plain).ping()


async def test_a_sentinel_over_tls_with_its_own_password(
        servers: Servers, certs: Path, start_worker: Callable[..., Worker]) -> None:
    port = _tls_sentinel(servers)
    base = f"redis+sentinel://127.0.0.1:{port}/{SERVICE}?ssl=true&ssl_ca_certs={certs}/ca.pem"
    await _serves(f"{base}&sentinel_password={SENTINEL_PASSWORD}", start_worker)
    wrong = RedisSettings(f"{base}&sentinel_password=wrong", connect_timeout_s=0.5,
                          socket_timeout_s=0.5)
    with pytest.raises((redis.RedisError, RedisUnavailable)):
        sync_client(wrong).ping()
