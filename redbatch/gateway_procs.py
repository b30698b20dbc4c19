"""Several gateway processes on one port: ``redbatch gateway --workers N`` and
``redbatch up --gateways N``.

The parent binds one ``SO_REUSEPORT`` socket per process (the kernel spreads new
connections over them), spawns the processes and watches them; it serves no request.
Prometheus multiprocess mode comes with it: the parent makes a private directory
(or takes the ``PROMETHEUS_MULTIPROC_DIR`` the user set), each process sets it before
it imports ``prometheus_client``, so ``/metrics``, whichever process answers it, sums
them all.  A signal (or ``stop``) sends SIGTERM to every process.  A process that
exits by itself is logged and stops the others: the parent then raises, so that the
supervisor of the whole (systemd, Kubernetes, ``redbatch up``) sees the failure
rather than a gateway running on fewer processes.  Its metric files are marked dead;
a private directory is removed at exit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess

from redbatch import defaults
from redbatch.config import GatewayConfig, RedisSettings
from redbatch.errors import ConfigError

log = logging.getLogger("redbatch")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STOP_GRACE_S = 30.0  # at least; more when requests may wait longer (``max_timeout_s``)
STOP_MARGIN_S = 5.0  # beyond the longest deadline a request in flight may have


class _Terminated(BaseException):
    """SIGTERM reached a gateway process: stop cleanly.  A ``BaseException``, as
    ``KeyboardInterrupt``: one raised in a task of the event loop (the SIGTERM of a stop
    that came while the process was still starting) ends the loop, where an
    ``Exception`` would end that task alone, and the process would go on serving."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _child(sock: socket.socket, config: GatewayConfig, redis: RedisSettings,
           log_level: str, metrics_dir: str) -> None:
    """One gateway process (spawned): multiprocess metrics first, then serve."""
    from redbatch.supervised import supervised_child

    supervised_child()
    os.environ[MULTIPROC_ENV] = metrics_dir
    if "prometheus_client" in sys.modules:  # its value class is chosen at import
        raise RuntimeError("prometheus_client was imported before the multiprocess "
                           "directory was set")
    from redbatch import gateway_server
    from redbatch.logs import setup_logging

    setup_logging(log_level)
    # uvicorn re-raises the signal that stopped it once it is done: make that an exit
    signal.signal(signal.SIGTERM, _terminated)
    try:
        gateway_server.serve(config, redis, sock=sock)
    except (_Terminated, KeyboardInterrupt):
        pass
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)


@contextlib.contextmanager
def metrics_dir() -> Iterator[str]:
    """The user's ``PROMETHEUS_MULTIPROC_DIR`` (kept), else a private one (removed)."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        try:
            os.makedirs(given, exist_ok=True)
            kept = os.listdir(given)
        except OSError as exc:
            raise ConfigError(f"{MULTIPROC_ENV}={given}: not a directory this process can "
                              f"use ({exc.strerror or exc})") from exc
        log.info("prometheus multiprocess dir: %s (from %s)", given, MULTIPROC_ENV)
        if kept:
            log.warning("%s is not empty: the counts of earlier processes in it show in "
                        "/metrics too (empty it between runs)", MULTIPROC_ENV)
        yield given
        return
    path = tempfile.mkdtemp(prefix="redbatch-metrics-")
    log.info("prometheus multiprocess dir: %s", path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class GatewayGroup:
    """The gateway processes of one port, each on its own socket."""

    def __init__(self, config: GatewayConfig, redis: RedisSettings, log_level: str,
                 metrics_path: str) -> None:
        self.config, self.redis, self.log_level = config, redis, log_level
        self.metrics_path = metrics_path
        self.processes: list[BaseProcess] = []
        self.failure: str | None = None
        self._ctx = mp.get_context("spawn")

    def start(self, sockets: list[socket.socket]) -> None:
        for index, sock in enumerate(sockets):
            proc = self._ctx.Process(target=_child, name=f"redbatch-gateway-{index}", args=(
                sock, self.config, self.redis, self.log_level, self.metrics_path))
            proc.start()
            self.processes.append(proc)
            log.info("started gateway process %d (pid %s)", index, proc.pid)

    def supervise(self, stop: threading.Event,
                  tick_s: float = defaults.GATEWAY_PROCS_TICK_S) -> None:
        """Until ``stop`` is set or a process exits (``failure`` then says which)."""
        while not stop.is_set():
            mp_connection.wait([p.sentinel for p in self.processes], timeout=tick_s)
            exited = next((p for p in self.processes if not p.is_alive()), None)
            if exited is not None and not stop.is_set():
                self.failure = (f"gateway process {exited.name} (pid {exited.pid}) exited "
                                f"with code {exited.exitcode}")
                log.error("%s; stopping the others", self.failure)
                return

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every process, wait ``grace_s`` (by default long enough for a request
        accepted with the longest deadline to be answered), SIGKILL the rest; mark all
        dead."""
        if grace_s is None:
            grace_s = max(STOP_GRACE_S, self.config.max_timeout_s + STOP_MARGIN_S)
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("gateway process %s did not stop in %.0f s; killing it",
                            proc.name, grace_s)
                proc.kill()
                proc.join(5)
            self._log_exit(proc)
            self._mark_dead(proc)

    @staticmethod
    def _log_exit(proc: BaseProcess) -> None:
        """One line per process at shutdown: 0 (or -SIGTERM) is a clean stop."""
        clean = proc.exitcode in (0, -signal.SIGTERM)
        log.log(logging.INFO if clean else logging.WARNING,
                "gateway process %s (pid %s) stopped with exit code %s", proc.name,
                proc.pid, proc.exitcode)

    def _mark_dead(self, proc: BaseProcess) -> None:
        from prometheus_client import multiprocess

        if proc.pid is not None:
            multiprocess.mark_process_dead(proc.pid, self.metrics_path)  # type: ignore[no-untyped-call]


def serve_processes(config: GatewayConfig, redis: RedisSettings, log_level: str,
                    stop: threading.Event) -> None:
    """Run ``config.gateway_processes`` gateway processes until ``stop`` is set; a
    process that exited by itself stops the others and raises ``ConfigError``."""
    sockets = bind_all(config)
    with metrics_dir() as path:
        group = GatewayGroup(config, redis, log_level, path)
        try:
            group.start(sockets)
            _close(sockets)  # each process holds its own: its exit closes it
            group.supervise(stop)
        finally:
            _close(sockets)
            group.stop()
    if group.failure:
        raise ConfigError(group.failure)


def bind_all(config: GatewayConfig) -> list[socket.socket]:
    from redbatch import gateway_server

    return gateway_server.bind_shared(config.host, config.port, config.gateway_processes)


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
