"""One worker process: serves its models until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from redbatch import defaults, lua, metrics, protocol, supervised
from redbatch.checks import worker_warnings
from redbatch.config import RedisSettings, WorkerConfig, check_socket_timeout
from redbatch.errors import ConfigError, RedbatchError
from redbatch.pipelines.definition import Pipeline
from redbatch.pipelines.duty import PipelineDuty, check_declared
from redbatch.redis_conn import (
    NODE_ERRORS,
    REDIS_ERRORS,
    async_client,
    cancel_requested,
    check_cancelled,
    close_all,
    is_cluster,
    remap_after,
)
from redbatch.worker import heartbeat
from redbatch.worker.drain import Drain
from redbatch.worker.live import LiveKnobs
from redbatch.worker.loader import load_target
from redbatch.worker.model import Model, is_stream_fn
from redbatch.worker.replies import DeadLetters
from redbatch.worker.runner import BatchRunner
from redbatch.worker.stream import StreamRunner

log = logging.getLogger("redbatch.worker")
T = TypeVar("T")
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
BLOCKING_CLUSTER_CONNECTIONS = 4  # per node, for a model's blocking client on a cluster
AUTH_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
STUCK_CLAIM_S = 1.0  # at a stop: a claim this long past its pop's timeout is ended
LEAVE_TIMEOUT_S = 3.0  # returning the batch at shutdown: Redis gone must not hang the stop


async def _keep_going(name: str, step: Callable[[], Awaitable[object]],
                      stop: asyncio.Event, *, once: bool = False) -> None:
    """Run ``step`` until ``stop`` (or, with ``once``, until it first succeeds); back
    off (capped) on errors and never die of them."""
    backoff_s = BACKOFF_START_S
    while not stop.is_set():
        check_cancelled()  # (a cancel that redis-py swallowed ends the loop too)
        try:
            await step()
            if once:
                return
            backoff_s = BACKOFF_START_S
            continue
        except ConfigError:
            raise
        except (*REDIS_ERRORS, RedbatchError) as exc:  # Redis down, or a lost lease
            log.warning("%s: %s: %s; retrying in %.2f s", name, type(exc).__name__, exc,
                        backoff_s)
        except Exception:
            log.exception("%s: unexpected error; retrying in %.2f s", name, backoff_s)
        except asyncio.CancelledError:
            if cancel_requested():  # a stop
                raise
            log.exception("%s: ended cancelled, though nothing cancelled it; retrying in "
                          "%.2f s", name, backoff_s)
        await _sleep_or_stop(stop, backoff_s)
        backoff_s = min(backoff_s * 2, BACKOFF_CAP_S)


class Worker:
    """Serves a list of models from one process: one batch loop per model, one
    forward thread shared by all (the GPU runs one pass at a time), and one
    heartbeat that renews the lease and reaps workers whose lease expired."""

    def __init__(self, models: list[Model], redis: RedisSettings, config: WorkerConfig,
                 device: str = "cpu", worker_id: str | None = None,
                 pipelines: list[Pipeline] | None = None) -> None:
        check_socket_timeout(redis, config.block_timeout_s)
        self.models = models
        self.pipelines = pipelines or []  # declared here (stored in Redis at start)
        check_declared(self.pipelines, models)
        self.redis_settings = redis
        self.config = config
        self.device = device
        self.worker_id = worker_id or protocol.new_id()[:12]
        self.runners: list[BatchRunner] = []
        self.on_serving: Callable[[], object] = lambda: None  # called once it serves
        self._info = heartbeat.static_info(self.worker_id, device)
        # the runners' models once they run (a live sub_queues change), the given before
        self._drain = Drain(lambda: [r.model for r in self.runners] or self.models,
                            self.worker_id)
        self.drained = False  # stopped after draining its versions (redbatch.versions)
        self.stopped_clean = True  # False: a batch loop was cancelled past the grace
        self._stop = asyncio.Event()
        self._unranked: frozenset[str] = frozenset()  # too many live workers to rank
        self._clients: tuple[aioredis.Redis, ...] = ()  # (while it runs)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop  # set by the heartbeat too, once its versions are drained
        redis = async_client(self.redis_settings, max_connections=3 * len(self.models) + 4)
        # one connection per model for its blocking pops, so CLIENT UNBLOCK can end them
        # (on a cluster, a client whose link holds one to the node of the model's slot;
        # its pools have room for the calls that go through the client after a break)
        blocking = [async_client(self.redis_settings,
                                 max_connections=BLOCKING_CLUSTER_CONNECTIONS
                                 if is_cluster(redis) else 1) for _ in self.models]
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redbatch-forward")
        self._clients = (redis, *blocking)
        clean = False
        try:
            self.runners = [self._runner(redis, m, b, executor)
                            for m, b in zip(self.models, blocking, strict=True)]
            _apply_torch_threads(self.config.threads)  # loaders may have imported torch
            self._reapers = {r.model.name: r.reaper for r in self.runners}
            self._live = {r.model.name: LiveKnobs(r) for r in self.runners}
            clean = self.stopped_clean = await self._serve(redis, stop)
        finally:
            executor.shutdown(wait=clean, cancel_futures=True)
            await close_all(redis, *blocking)

    def _runner(self, redis: aioredis.Redis, model: Model, blocking: aioredis.Redis | None,
                executor: ThreadPoolExecutor) -> BatchRunner:
        """One model's runner, on a copy of the model: live knob changes apply to the
        copy, never to the caller's ``Model``."""
        fn = model.bind(self.device)
        streaming = bool(model.streaming) or is_stream_fn(fn)  # (a loader's generator)
        runner = StreamRunner if streaming else BatchRunner
        return runner(redis, dataclasses.replace(model, streaming=streaming), fn,
                      self.worker_id, executor, self.config.block_timeout_s,
                      self.config.max_attempts, blocking, self.device,
                      DeadLetters(self.config.dead_letter_ttl_s,
                                  self.config.dead_letter_max_bytes))

    async def _register(self, redis: aioredis.Redis, stop: asyncio.Event) -> bool:
        """Check the server (warnings logged once), load the scripts and take the lease
        before the first claim; return whether it took it (else: stopped first)."""
        async def checks() -> None:
            try:
                warnings = await worker_warnings(redis)
            except AUTH_ERRORS as exc:  # no retry mends a wrong password or user
                raise ConfigError(f"redis at {self.redis_settings.safe_url} refused this "
                                  f"worker's credentials: {str(exc).rstrip('.')}") from exc
            for warning in warnings:
                log.warning("%s", warning)

        async def first() -> None:
            for script in (lua.CLAIM, lua.CLAIM_LEVELS, lua.PUBLISH, lua.PUBLISH_HOLD,
                           lua.REAP, *heartbeat.BEAT_SCRIPTS):
                await redis.script_load(script)
            await self._beat(redis)
            registered.append(True)

        registered: list[bool] = []
        await _keep_going("checks", checks, stop, once=True)
        await _keep_going("register", first, stop, once=True)
        return bool(registered)

    async def _beat(self, redis: aioredis.Redis) -> None:
        fields = {r.model.name: heartbeat.published({**self._info, **r.published()}, r.stats)
                  for r in self.runners}
        beat = await heartbeat.beat(redis, [r.model for r in self.runners], self.worker_id,
                                    fields, self.config.lease_ttl_s, self._draining(),
                                    self._unranked)
        self._unranked = beat.unranked()
        for name, raw in beat.overrides.items():
            self._live[name].update(raw)
        for runner in self.runners:
            runner.claimer.rank(beat.live.get(runner.model.name))
            runner.notice_shrink(beat.shrunk.get(runner.model.name))
            runner.peers_hold_aware = beat.held_aware.get(runner.model.name, False)
        await self._reap_all(beat.expired)
        if beat.versions and await self._drain.done(redis, beat.versions):
            log.info("worker %s: its versions are drained; stopping", self.worker_id)
            self.drained = True
            self._stop.set()

    async def _reap_all(self, expired: dict[str, list[str]]) -> None:
        """Reap each dead worker on its own: one whose reap keeps failing (a key of
        another type, say) is logged and skipped, never holding up the others, this
        worker's registration, or its drain check."""
        for model, dead_ids in expired.items():
            for dead_id in dead_ids:
                try:
                    await self._reapers[model].reap(dead_id)
                except redis.ResponseError as exc:  # (Redis away: the beat fails, retried)
                    log.warning("model=%s could not reap dead worker %s: %s", model,
                                dead_id, exc)

    def _draining(self) -> heartbeat.Draining:
        """The sub-queues this worker still drains above each model's shrunk count."""
        counts = {r.model.name: n for r in self.runners
                  if (n := r.claimer.draining(r.model.sub_queues))}
        beats_ms = self.config.heartbeat_interval_s * 1000 * protocol.DRAINING_TTL_BEATS
        return heartbeat.Draining(counts, round(beats_ms))

    async def _serve(self, redis: aioredis.Redis, stop: asyncio.Event) -> bool:
        """Run until ``stop``; return whether every batch finished within the grace.
        Cancelled instead, its tasks end with it, before the connection pools close
        (one that went on would reconnect on a closed pool and leave it open)."""
        beating = asyncio.Event()  # set when the batch loops are done: the lease outlives them

        async def beat() -> None:
            await self._beat(redis)
            await _sleep_or_stop(beating, self.config.heartbeat_interval_s)

        registered = await self._register(redis, stop)
        if stop.is_set():  # stopped at its start: it never served
            if registered:  # (a stop during its first beat, or its versions drained)
                await self._leave(redis)
            return True
        tasks = [asyncio.create_task(_keep_going(
            f"model={r.model.name}", functools.partial(self._remapping, r.serve, stop), stop))
            for r in self.runners]
        heart = asyncio.create_task(_keep_going(
            "heartbeat", functools.partial(self._remapping, beat), beating))
        duty = asyncio.create_task(self._duty(redis).run(beating))  # hand-offs: till the end
        try:
            return await self._stop_after(redis, stop, beating, tasks, heart, duty)
        finally:  # (all done by now, unless cancelled)
            for task in (*tasks, heart, duty):
                task.cancel()
            await asyncio.gather(*tasks, heart, duty, return_exceptions=True)

    async def _remapping(self, step: Callable[..., Awaitable[object]], *args: Any) -> None:
        """``step(*args)``; after a cluster node's error, every client of this worker
        reads the slot map again (``remap_after``): a failover moved a model's slot, and
        the calls that succeed meanwhile (other models, other nodes) would not tell."""
        try:
            await step(*args)
        except NODE_ERRORS as exc:
            await asyncio.gather(*(remap_after(c, exc) for c in self._clients))
            raise

    async def _stop_after(self, redis: aioredis.Redis, stop: asyncio.Event,
                          beating: asyncio.Event, tasks: list[asyncio.Task[None]],
                          heart: asyncio.Task[None], duty: asyncio.Task[None]) -> bool:
        """Serve until ``stop``, then the batch loops finish (within the grace), the
        heartbeat and the duty end, and the worker leaves."""
        log.info("worker %s serving %s on %s", self.worker_id,
                 ",".join(m.name for m in self.models), self.device)
        self.on_serving()
        await stop.wait()
        pending = await self._loops_end(tasks)
        beating.set()
        await asyncio.gather(_ended(heart, LEAVE_TIMEOUT_S, "the heartbeat"),
                             _ended(duty, LEAVE_TIMEOUT_S, "the pipelines' duty"))
        await self._leave(redis)
        return not pending

    async def _loops_end(self, tasks: list[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
        """The batch loops' end after a stop, within the grace (those still running then
        are cancelled, and returned); a loop that waits on a claim with no batch of its
        own past the pop's timeout and ``STUCK_CLAIM_S`` after the stop (a stalled
        Redis: a stopping window closes within the pop's timeout) is cancelled then:
        nothing it holds is lost (``Runner.stuck_claiming``)."""
        stopped_at = time.monotonic()
        ends_at = stopped_at + self.config.grace_s
        stuck_after_s = self.config.block_timeout_s + STUCK_CLAIM_S
        pending = set(tasks)
        while pending and (left_s := ends_at - time.monotonic()) > 0:
            _done, pending = await asyncio.wait(pending, timeout=min(left_s, 0.1))
            for runner, task in zip(self.runners, tasks, strict=True):
                if task in pending and runner.stuck_claiming(stuck_after_s, stopped_at):
                    log.warning("model=%s: its claim did not end %.1f s after the stop "
                                "(Redis stalled?): stopped", runner.model.name, stuck_after_s)
                    task.cancel()
                    pending.discard(task)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return pending

    def _duty(self, redis: aioredis.Redis) -> PipelineDuty:
        """The pipelines' part: hand-offs of the stages served here (``redbatch.pipelines``)."""
        self.pipeline_duty = PipelineDuty(
            redis, self.models, self.worker_id, self.pipelines,
            self.config.heartbeat_interval_s, self.config.lease_ttl_s,
            wait_s=self.config.block_timeout_s)
        return self.pipeline_duty

    async def _leave(self, redis: aioredis.Redis) -> None:
        """Return any unfinished batch to the queue's front, then deregister; give up
        after ``LEAVE_TIMEOUT_S`` (Redis gone or hung): the lease expires on its own."""
        try:
            await asyncio.wait_for(self._return_and_deregister(redis), LEAVE_TIMEOUT_S)
        except (*REDIS_ERRORS, TimeoutError) as exc:
            log.warning("worker %s could not return its batch or deregister (%s); its lease "
                        "will expire and another worker will reap it", self.worker_id,
                        str(exc) or type(exc).__name__)
        log.info("worker %s stopped", self.worker_id)

    async def _return_and_deregister(self, redis: aioredis.Redis) -> None:
        for reaper in self._reapers.values():
            await reaper.reap(self.worker_id, force=True)
        await heartbeat.leave(redis, self.models, self.worker_id)


async def _ended(task: asyncio.Task[None], timeout_s: float, what: str) -> None:
    """``task``'s end at a stop, waited for ``timeout_s`` at most (a stalled Redis must
    not hold the stop), then cancelled; a failure is logged, never the end of a clean
    exit.  (The duty's cancel still lets its movers end, each step bounded.)"""
    _done, pending = await asyncio.wait([task], timeout=timeout_s)
    if pending:
        log.warning("%s had not ended %.0f s after the batch loops (Redis stalled?): "
                    "cancelled", what, timeout_s)
        task.cancel()
    (result,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(result, Exception):
        log.error("%s failed", what, exc_info=result)


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


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed (it is, with uvicorn[standard]): the
    producer path measured 8.2k -> 10.0k items/s with it on the client's side."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _main(worker: Worker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM,) if supervised.is_supervised() else (signal.SIGTERM,
                                                                   signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # (a pool's replica: SIGINT is the pool's)
    await worker.run(stop)


def run_worker_process(target: str, redis: RedisSettings, config: WorkerConfig, device: str,
                       log_level: str = defaults.LOG_LEVEL, index: int = 0,
                       overrides: dict[str, Any] | None = None,
                       on_serving: Callable[[], object] | None = None,
                       on_drained: Callable[[], object] | None = None) -> None:
    """Entry point of a spawned worker process (replica ``index``); ``overrides``
    replace the models' batching knobs and limits (``redbatch up -c FILE``);
    ``on_serving`` is called once the batch loops run, ``on_drained`` before it exits
    with ``DRAINED_EXIT_CODE``."""
    from redbatch.configfile import with_overrides
    from redbatch.heap import freeze_startup_heap
    from redbatch.logs import setup_logging

    setup_logging(log_level)
    set_threads(config.threads)  # before anything imports torch; Worker.run applies it too
    loaded, pipelines = load_target(target)
    models = with_overrides(loaded, overrides or {})
    worker = Worker(models, redis, config, device=device, pipelines=pipelines)
    worker.on_serving = on_serving or worker.on_serving
    if config.metrics_port:
        serve_metrics(config.metrics_port + index)
    freeze_startup_heap()  # redbatch.heap: no full collection walks torch under load
    run_loop(_main(worker))
    if worker.drained:  # the pool does not restart it
        if on_drained is not None:
            on_drained()
        sys.exit(defaults.DRAINED_EXIT_CODE)
    if not worker.stopped_clean:
        _exit_now()


def _exit_now() -> None:
    """End the process now: a pass cancelled past the grace still runs in the forward
    thread (its batch went back to the queue), and the interpreter's exit would wait
    for it (``concurrent.futures`` joins its threads) until the pool's SIGKILL."""
    log.warning("a forward pass still runs past the stop's grace: exiting without it")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_metrics(port: int) -> None:
    """Prometheus /metrics of this replica; a taken port costs the metrics, not the work."""
    try:
        metrics.serve(port)
    except (OSError, OverflowError) as exc:  # (a port past 65535: OverflowError)
        log.error("metrics: cannot listen on port %d (%s); this replica serves no /metrics",
                  port, exc)
        return
    log.info("metrics on :%d/metrics", port)
