"""The worker pool: one spawned process per replica, restarted if it crashes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any

from redbatch.config import RedisSettings, WorkerConfig

log = logging.getLogger("redbatch.pool")
RESTART_BACKOFF_CAP_S = 10.0


def replica_device(device: str, index: int, gpu_count: int) -> str:
    """The device of replica ``index``: GPUs are dealt round-robin, as Ray's num_gpus."""
    if "," in device:
        choices = [d.strip() for d in device.split(",") if d.strip()]
        return choices[index % len(choices)]
    if device in {"auto", "cuda"} and gpu_count > 0:
        return f"cuda:{index % gpu_count}"
    if device == "cuda":
        return "cuda"
    return "cpu" if device == "auto" else device


def _child(target: str, redis: RedisSettings, config: WorkerConfig, index: int,
           log_level: str, overrides: dict[str, Any] | None = None) -> None:
    from redbatch.worker.process import run_worker_process, set_threads

    set_threads(config.threads)  # before _gpu_count() may import torch
    device = config.device
    if device in {"auto", "cuda"} or "," in device:
        device = replica_device(device, index, _gpu_count())
    run_worker_process(target, redis, config, device, log_level, index, overrides)


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@dataclass
class _Replica:
    index: int
    process: BaseProcess
    restarts: int = 0
    next_start: float = 0.0


class Pool:
    """Starts ``config.replicas`` worker processes with the spawn start method."""

    def __init__(self, target: str, redis: RedisSettings, config: WorkerConfig,
                 log_level: str = "INFO", overrides: dict[str, Any] | None = None) -> None:
        self.target = target
        self.overrides = overrides or {}  # batching overrides (redbatch up -c FILE)
        self.redis = redis
        self.config = config
        self.log_level = log_level
        self._ctx = mp.get_context("spawn")
        self.replicas: list[_Replica] = []
        self._stopping = threading.Event()

    def _spawn(self, index: int) -> BaseProcess:
        proc = self._ctx.Process(target=_child, name=f"redbatch-worker-{index}",
                                 args=(self.target, self.redis, self.config, index,
                                       self.log_level, self.overrides))
        proc.start()
        log.info("started worker replica %d (pid %s) for %s", index, proc.pid, self.target)
        return proc

    def start(self) -> None:
        self.replicas = [_Replica(i, self._spawn(i)) for i in range(self.config.replicas)]

    def supervise(self, stop: threading.Event, tick_s: float = 0.5) -> None:
        """Restart crashed replicas (with capped backoff) until ``stop`` is set.  Blocks
        on the processes' sentinels, so an exit is seen at once."""
        while not stop.is_set():
            sentinels = [r.process.sentinel for r in self.replicas if r.process.is_alive()]
            if sentinels:
                mp_connection.wait(sentinels, timeout=tick_s)
            else:
                stop.wait(tick_s)  # all down: retry after the restart backoff
            for replica in self.replicas:
                self._check(replica)

    def _check(self, replica: _Replica) -> None:
        proc = replica.process
        if self._stopping.is_set() or proc.is_alive() or time.monotonic() < replica.next_start:
            return
        replica.restarts += 1
        delay = min(RESTART_BACKOFF_CAP_S, 0.5 * 2 ** min(replica.restarts, 5))
        log.warning("worker replica %d (pid %s) exited with code %s; restart #%d",
                    replica.index, proc.pid, proc.exitcode, replica.restarts)
        replica.process = self._spawn(replica.index)
        replica.next_start = time.monotonic() + delay

    def stop(self, grace_s: float = 35.0) -> None:
        """SIGTERM every replica, wait ``grace_s`` for them, then SIGKILL the rest."""
        self._stopping.set()
        for replica in self.replicas:
            if replica.process.is_alive():
                replica.process.terminate()
        deadline = time.monotonic() + grace_s
        for replica in self.replicas:
            replica.process.join(max(0.0, deadline - time.monotonic()))
            if replica.process.is_alive():
                log.warning("worker replica %d did not stop in %.0f s; killing it",
                            replica.index, grace_s)
                replica.process.kill()
                replica.process.join(5)
