"""A private Redis for ``redbatch up`` when ``REDIS_URL`` is unset.

A real ``redis-server`` on a free port when the binary exists, else an
in-process fakeredis TCP server (good enough for a demo, not for production).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from redbatch.errors import RedisUnavailable

log = logging.getLogger("redbatch.embedded")
START_TIMEOUT_S = 10.0
# On Linux, redis-server is exec'd by a tiny Python that asks the kernel to SIGTERM it
# when we die (even by SIGKILL): in its own session, no group signal would reach it.
_DIE_WITH_PARENT = [sys.executable, "-I", "-S", "-c",
                    "import ctypes, os, signal, sys; "
                    "ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # 1: PR_SET_PDEATHSIG
                    "os.execv(sys.argv[1], sys.argv[1:])"] if sys.platform == "linux" else []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EmbeddedRedis:
    url: str
    kind: str
    _stop: Any = field(repr=False)

    def stop(self) -> None:
        self._stop()


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError,
                    redis.exceptions.InvalidResponse):  # (not up yet, or not Redis)
                time.sleep(0.05)
    finally:
        client.close()
    raise RedisUnavailable(f"embedded redis at {url} did not start in {START_TIMEOUT_S} s")


def _stopper(proc: subprocess.Popen[bytes], workdir: str) -> Callable[[], None]:
    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)

    return stop


def start_redis_server(binary: str) -> EmbeddedRedis:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="redbatch-redis-")
    # Its own session: a Ctrl-C in the terminal reaches the whole foreground group, and
    # Redis must outlive the workers that return their batches to it; ``stop()`` ends it.
    proc = subprocess.Popen(
        [*_DIE_WITH_PARENT, binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir, "--maxmemory-policy", "noeviction",
         "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    stop = _stopper(proc, workdir)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_ready(url)
    except BaseException:  # (its work folder goes too)
        stop()
        raise
    return EmbeddedRedis(url, f"redis-server ({binary}, pid {proc.pid})", stop)


def start_fakeredis() -> EmbeddedRedis:
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="fakeredis")
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    url = f"redis://127.0.0.1:{port}/0"
    _wait_ready(url)
    return EmbeddedRedis(url, "fakeredis TCP server (in-process; no redis-server binary found)",
                         stop)


def start_embedded(prefer_fake: bool = False) -> EmbeddedRedis:
    """Start a private Redis; log which kind was chosen."""
    binary = None if prefer_fake else shutil.which("redis-server")
    embedded = start_redis_server(binary) if binary else start_fakeredis()
    log.info("REDIS_URL is unset: started an embedded %s at %s", embedded.kind, embedded.url)
    return embedded
