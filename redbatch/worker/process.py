"""One worker process: serves its models until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from redbatch import protocol
from redbatch.config import RedisSettings, WorkerConfig, check_socket_timeout
from redbatch.errors import RedbatchError
from redbatch.redis_conn import REDIS_ERRORS, async_client
from redbatch.worker import heartbeat
from redbatch.worker.loader import load_models
from redbatch.worker.model import Model
from redbatch.worker.runner import BatchRunner

log = logging.getLogger("redbatch.worker")
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
GRACE_S = 30.0


async def _keep_going(name: str, step: Callable[[], Awaitable[object]],
                      stop: asyncio.Event) -> None:
    """Run ``step`` until ``stop``; back off (capped) on Redis errors, never die."""
    backoff_s = BACKOFF_START_S
    while not stop.is_set():
        try:
            await step()
            backoff_s = BACKOFF_START_S
        except (*REDIS_ERRORS, RedbatchError) as exc:
            log.warning("%s: redis unavailable (%s: %s); retrying in %.2f s", name,
                        type(exc).__name__, exc, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, BACKOFF_CAP_S)
        except Exception:
            log.exception("%s: unexpected error; retrying in %.2f s", name, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, BACKOFF_CAP_S)


class Worker:
    """Serves a list of models from one process: one batch loop per model, one
    forward thread shared by all (the GPU runs one pass at a time), one heartbeat."""

    def __init__(self, models: list[Model], redis: RedisSettings, config: WorkerConfig,
                 device: str = "cpu", worker_id: str | None = None) -> None:
        check_socket_timeout(redis, config.block_timeout_s)
        self.models = models
        self.redis_settings = redis
        self.config = config
        self.device = device
        self.worker_id = worker_id or protocol.new_id()[:12]
        self.runners: list[BatchRunner] = []

    async def run(self, stop: asyncio.Event) -> None:
        redis = async_client(self.redis_settings, max_connections=2 * len(self.models) + 4)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redbatch-forward")
        try:
            self.runners = [BatchRunner(redis, m, m.bind(self.device), self.worker_id, executor,
                                        self.config.block_timeout_s) for m in self.models]
            await self._serve(redis, stop)
        finally:
            executor.shutdown(wait=True)
            await redis.aclose()

    async def _serve(self, client: aioredis.Redis, stop: asyncio.Event) -> None:
        info = heartbeat.worker_info(self.worker_id, self.device)

        async def beat() -> None:
            await heartbeat.beat(client, self.models, self.worker_id, info,
                                 self.config.lease_ttl_s)
            await _sleep_or_stop(stop, self.config.heartbeat_interval_s)

        tasks = [asyncio.create_task(_keep_going(f"model={r.model.name}", r.run_batch, stop))
                 for r in self.runners]
        tasks.append(asyncio.create_task(_keep_going("heartbeat", beat, stop)))
        log.info("worker %s serving %s on %s", self.worker_id,
                 ",".join(m.name for m in self.models), self.device)
        await stop.wait()
        _done, pending = await asyncio.wait(tasks, timeout=GRACE_S)
        for task in pending:
            task.cancel()
        await self._leave(client)

    async def _leave(self, client: aioredis.Redis) -> None:
        try:
            await heartbeat.leave(client, self.models, self.worker_id)
        except REDIS_ERRORS as exc:
            log.warning("could not deregister worker %s: %s", self.worker_id, exc)
        log.info("worker %s stopped", self.worker_id)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


def set_threads(threads: int) -> None:
    """CPU threads for this process, as Ray's ``num_cpus`` does (before torch loads)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)


def _apply_torch_threads(threads: int) -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


async def _main(worker: Worker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await worker.run(stop)


def run_worker_process(target: str, redis: RedisSettings, config: WorkerConfig, device: str,
                       log_level: str = "INFO") -> None:
    """Entry point of a spawned worker process."""
    from redbatch.logs import setup_logging

    setup_logging(log_level)
    set_threads(config.threads)
    models = load_models(target)
    worker = Worker(models, redis, config, device=device)
    _apply_torch_threads(config.threads)
    asyncio.run(_main(worker))
