"""The worker pool: one spawned process per replica, restarted if it crashes."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any

from redbatch import defaults
from redbatch.config import RedisSettings, WorkerConfig, check_socket_timeout
from redbatch.errors import ConfigError

log = logging.getLogger("redbatch.pool")
RESTART_BACKOFF_CAP_S = 10.0
HEALTHY_UPTIME_S = 60.0  # a replica up this long before it exits starts its backoff over
SERVING = b"serving"  # what a replica reports once its batch loops run
DRAINED = b"drained"  # what it reports as it exits after draining its versions
MAX_REPORT_BYTES = 4096


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
           log_level: str, overrides: dict[str, Any], report: mp_connection.Connection,
           quiet: bool = False) -> None:
    """A replica's process: reports ``SERVING`` once it serves, or the last line of
    the error that stopped it (read by the pool's supervisor; text, never pickle).
    ``quiet``: the same error was shown with its traceback already."""
    from redbatch.supervised import supervised_child
    from redbatch.worker.process import run_worker_process, set_threads

    supervised_child()
    try:
        set_threads(config.threads)  # before _gpu_count() may import torch
        device = config.device
        if device in {"auto", "cuda"} or "," in device:
            device = replica_device(device, index, _gpu_count())
        run_worker_process(target, redis, config, device, log_level, index, overrides,
                           on_serving=functools.partial(_report, report, SERVING),
                           on_drained=functools.partial(_report, report, DRAINED))
    except KeyboardInterrupt:  # Ctrl-C while starting: the pool is stopping anyway
        return
    except Exception as exc:
        log.error("worker replica %d failed: %s", index, last_line(exc),
                  exc_info=None if quiet else exc)
        _report(report, last_line(exc).encode())
        raise SystemExit(1) from None


def _report(report: mp_connection.Connection, message: bytes) -> None:
    with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
        report.send_bytes(message)


def last_line(exc: BaseException) -> str:
    """``ValueError: no weights at /x``: what a traceback's last line says."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def check_device(device: str) -> None:
    """Fail at once, in the parent, when ``device`` names a GPU this host lacks:
    every replica would die on it, again and again."""
    wanted = [d.strip() for d in device.split(",") if d.strip().startswith("cuda")]
    if not wanted:
        return
    count = _gpu_count()
    if count == 0:
        raise ConfigError(f"--device {device}: CUDA is not available on this host "
                          "(torch.cuda.is_available() is False); use --device cpu, or auto "
                          "to use a GPU only when there is one")
    for name in wanted:
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= count):
            raise ConfigError(f"--device {device}: this host has {count} GPU(s), "
                              f"cuda:0 to cuda:{count - 1}")


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
    report: mp_connection.Connection  # the child's SERVING, or its last error line
    started_s: float  # when this process was started (the pool's clock)
    restarts: int = 0  # restarts since the replica last stayed up HEALTHY_UPTIME_S
    next_start: float = 0.0  # the restart's time, once its exit was booked
    booked: bool = False  # this process's exit is counted (its restart waits its delay)
    served_s: float | None = None  # when it reported SERVING (the pool's clock)
    served: bool = False  # this process reached its serving loop
    failed_starts: int = 0  # exits in a row of processes that never served
    last_error: str = ""
    drained: bool = False  # stopped after draining its versions: not restarted
    said_drained: bool = False  # it reported DRAINED (an exit code 3 alone is a crash)


class Pool:
    """Starts ``config.replicas`` worker processes with the spawn start method and
    restarts those that exit, unless the pool is stopping.  A replica that fails
    ``config.max_failed_starts`` times in a row before it serves stops the pool:
    ``failure`` says why."""

    def __init__(self, target: str, redis: RedisSettings, config: WorkerConfig,
                 log_level: str = defaults.LOG_LEVEL,
                 overrides: dict[str, Any] | None = None) -> None:
        check_device(config.device)
        check_socket_timeout(redis, config.block_timeout_s)  # here, not in every replica
        self.target = target
        self.overrides = overrides or {}  # batching overrides (redbatch up -c FILE)
        self.redis = redis
        self.config = config
        self.log_level = log_level
        self._ctx = mp.get_context("spawn")
        self.replicas: list[_Replica] = []
        self._stopping = threading.Event()
        self._clock: Callable[[], float] = time.monotonic
        self.failure: str | None = None

    def _spawn(self, index: int, quiet: bool = False
               ) -> tuple[BaseProcess, mp_connection.Connection]:
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child, name=f"redbatch-worker-{index}",
                                 args=(self.target, self.redis, self.config, index,
                                       self.log_level, self.overrides, writer, quiet))
        proc.start()
        writer.close()  # the child holds the only writer: its exit reads as EOF
        log.info("started worker replica %d (pid %s) for %s", index, proc.pid, self.target)
        return proc, reader

    def _new_replica(self, index: int) -> _Replica:
        return _Replica(index, *self._spawn(index), started_s=self._clock())

    def start(self) -> None:
        self.replicas = [self._new_replica(i) for i in range(self.config.replicas)]

    def supervise(self, stop: threading.Event, tick_s: float = defaults.POOL_TICK_S) -> None:
        """Restart exited replicas (with capped backoff) until ``stop`` is set, until
        every replica drained its versions, or until the pool gives up (then ``stop``
        is set too).  Blocks on the processes'
        sentinels, so an exit is seen at once."""
        while not (stop.is_set() or self._stopping.is_set()):
            sentinels = [r.process.sentinel for r in self.replicas if r.process.is_alive()]
            if sentinels:
                mp_connection.wait(sentinels, timeout=tick_s)
            else:
                stop.wait(tick_s)  # all down: retry after the restart backoff
            if stop.is_set():  # a signal stops the replicas too: none is restarted
                break
            for replica in self.replicas:
                self._check(replica)
            if self.replicas and all(r.drained for r in self.replicas):
                log.info("every worker replica drained its versions: the pool stops")
                break
        self._stopping.set()
        if self.failure:
            stop.set()

    def _check(self, replica: _Replica) -> None:
        self._read_report(replica)
        if self._stopping.is_set() or replica.drained or replica.process.is_alive():
            return
        if replica.process.exitcode == defaults.DRAINED_EXIT_CODE and replica.said_drained:
            replica.drained = True
            log.info("worker replica %d drained its versions and stopped; not restarted",
                     replica.index)
            return
        if not replica.booked:  # its exit, seen now: the restart waits from here
            self._count_exit(replica)
            if replica.failed_starts >= self.config.max_failed_starts:
                self._give_up(replica)
                return
            delay = min(RESTART_BACKOFF_CAP_S, 0.5 * 2 ** min(replica.restarts - 1, 5))
            replica.booked, replica.next_start = True, self._clock() + delay
        if self._clock() >= replica.next_start:
            self._restart(replica)

    def _restart(self, replica: _Replica) -> None:
        log.warning("worker replica %d: restart #%d", replica.index, replica.restarts)
        replica.report.close()
        proc, replica.report = self._spawn(replica.index, quiet=replica.failed_starts > 0)
        replica.process, replica.served, replica.last_error = proc, False, ""
        replica.started_s, replica.served_s, replica.booked = self._clock(), None, False

    def _read_report(self, replica: _Replica) -> None:
        with contextlib.suppress(EOFError, OSError):  # EOF: the child has exited
            while replica.report.poll():
                message = replica.report.recv_bytes(MAX_REPORT_BYTES)
                if message == SERVING:
                    replica.served, replica.failed_starts = True, 0
                    replica.served_s = self._clock()
                elif message == DRAINED:
                    replica.said_drained = True
                else:
                    replica.last_error = message.decode(errors="replace")

    def _count_exit(self, replica: _Replica) -> None:
        """Book an exit: a replica that stayed up ``HEALTHY_UPTIME_S`` starts its
        backoff over; one that never served counts as a failed start."""
        proc = replica.process
        if replica.served_s is not None and self._clock() - replica.served_s >= \
                HEALTHY_UPTIME_S:  # (served that long: a long model load is no uptime)
            replica.restarts = 0
        replica.restarts += 1
        replica.failed_starts = 0 if replica.served else replica.failed_starts + 1
        if not replica.last_error:  # killed, or died in C code: no line reported
            replica.last_error = f"exit code {proc.exitcode}"
        log.warning("worker replica %d (pid %s) exited with code %s%s", replica.index,
                    proc.pid, proc.exitcode, "" if replica.served else " before it served")

    def _give_up(self, replica: _Replica) -> None:
        self.failure = (f"worker replica {replica.index} of {self.target} failed to start "
                        f"{replica.failed_starts} times in a row and never served; last "
                        f"error: {replica.last_error}. Fix what the log above shows (the "
                        "model's build, its files, --device), then start again")
        self._stopping.set()

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every replica, wait ``grace_s`` for them (by default the replicas' own
        grace plus ``POOL_STOP_MARGIN_S``), then SIGKILL the rest."""
        if grace_s is None:
            grace_s = self.config.grace_s + defaults.POOL_STOP_MARGIN_S
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
