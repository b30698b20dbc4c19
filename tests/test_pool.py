"""The pool's supervisor (``Pool._check``/``supervise``) with fake processes and a
clock the test moves: backoff, its reset after healthy serving, no restart while
stopping, and giving up on a replica that never starts."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest

from redbatch import defaults
from redbatch.config import RedisSettings, WorkerConfig
from redbatch.errors import ConfigError
from redbatch.worker import pool as pool_module
from redbatch.worker.pool import DRAINED, HEALTHY_UPTIME_S, SERVING, Pool


class FakeReport:
    """The parent's end of a replica's report pipe."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def poll(self) -> bool:
        return bool(self.messages)

    def recv_bytes(self, maxlength: int) -> bytes:
        return self.messages.pop(0)

    def close(self) -> None:
        pass


class FakeProc:
    """A replica process: alive until ``die()``; its sentinel is always ready."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode, self.alive = pid, None, True
        self._read, self._write = os.pipe()
        os.write(self._write, b"x")
        self.sentinel = self._read

    def is_alive(self) -> bool:
        return self.alive

    def die(self, code: int = 1) -> None:
        self.alive, self.exitcode = False, code

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class FakePool(Pool):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__("tests.models_broken:broken", RedisSettings(), config)
        self.now = 1000.0
        self._clock = lambda: self.now
        self.spawned: list[tuple[FakeProc, FakeReport]] = []

    def _spawn(self, index: int, quiet: bool = False  # type: ignore[override]
               ) -> tuple[FakeProc, FakeReport]:
        self.spawned.append((FakeProc(len(self.spawned)), FakeReport()))
        return self.spawned[-1]

    @property
    def proc(self) -> FakeProc:
        return self.spawned[-1][0]

    def serve(self) -> None:
        self.spawned[-1][1].messages.append(SERVING)

    def crash(self, error: bytes = b"") -> None:
        """The replica exits: its exit is booked, and it is restarted once its delay
        has passed (the clock moved on to it)."""
        if error:
            self.spawned[-1][1].messages.append(error)
        self.proc.die()
        self._check(self.replicas[0])  # booked: its restart waits from now
        self.now = max(self.now, self.replicas[0].next_start)
        self._check(self.replicas[0])


@pytest.fixture
def make_pool() -> Iterator[Callable[..., FakePool]]:
    pools: list[FakePool] = []

    def make(config: WorkerConfig | None = None) -> FakePool:
        pool = FakePool(config or WorkerConfig())
        pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        for proc, _ in pool.spawned:
            proc.close()


def test_backoff_grows_then_resets_after_healthy_serving(
        make_pool: Callable[..., FakePool]) -> None:
    """Each restart waits its delay from the exit (it was counted from the start, so a
    replica that took longer than the delay to crash came back at once)."""
    pool = make_pool()
    replica = pool.replicas[0]
    delays = []
    for _ in range(4):  # a bad spell: each restart waits longer
        pool.serve()
        pool.now += 30  # (up, then crashes: longer than any delay)
        pool.proc.die()
        pool._check(replica)
        delays.append(replica.next_start - pool.now)
        pool.now += delays[-1] / 2  # inside the delay: no restart yet
        pool._check(replica)
        assert len(pool.spawned) == len(delays)
        pool.now = replica.next_start
        pool._check(replica)
    assert delays == [0.5, 1.0, 2.0, 4.0] and len(pool.spawned) == 5
    pool.serve()
    pool._check(replica)  # it serves, then stays up a long time
    pool.now += HEALTHY_UPTIME_S
    pool.proc.die()
    pool._check(replica)
    assert replica.restarts == 1 and replica.next_start - pool.now == 0.5


def test_a_long_model_load_is_no_healthy_uptime(make_pool: Callable[..., FakePool]) -> None:
    """Uptime counts from serving: a replica that loads for minutes, serves, and
    crashes keeps its backoff growing."""
    pool = make_pool()
    replica = pool.replicas[0]
    for _ in range(3):
        pool.now += HEALTHY_UPTIME_S + 10  # loading
        pool.serve()
        pool.crash()
    assert replica.restarts == 3


def test_a_short_run_keeps_the_backoff(make_pool: Callable[..., FakePool]) -> None:
    pool = make_pool()
    for _ in range(3):
        pool.serve()
        pool.now = pool.replicas[0].next_start + 1
        pool.crash()
    assert pool.replicas[0].restarts == 3


def test_no_restart_once_stop_is_set(make_pool: Callable[..., FakePool]) -> None:
    """The replica gets the terminal's SIGINT too and exits while the supervisor
    waits: stop was set by then, and nothing may be restarted."""
    pool = make_pool()
    stop = threading.Event()
    proc = pool.proc

    def dies_as_stop_is_set() -> bool:
        if proc.alive:
            proc.alive = False
            proc.exitcode = 0
            stop.set()
            return True
        return False

    proc.is_alive = dies_as_stop_is_set  # type: ignore[method-assign]
    pool.supervise(stop, tick_s=0.01)
    assert len(pool.spawned) == 1
    pool._check(pool.replicas[0])  # after supervise returned: stopping
    assert len(pool.spawned) == 1


def test_a_replica_that_never_serves_stops_the_pool(make_pool: Callable[..., FakePool]) -> None:
    pool = make_pool(WorkerConfig(max_failed_starts=3))
    pool.crash(b"FileNotFoundError: no weights")
    pool.serve()  # the second one serves: the count starts over
    pool.now = pool.replicas[0].next_start
    pool.crash()
    for _ in range(3):
        pool.now = pool.replicas[0].next_start
        pool.crash(b"FileNotFoundError: no weights")
    assert pool.failure and "3 times in a row" in pool.failure
    assert "FileNotFoundError: no weights" in pool.failure
    assert len(pool.spawned) == 5
    stop = threading.Event()
    pool.supervise(stop, tick_s=0.01)  # returns at once, and stops the rest too
    assert stop.is_set() and len(pool.spawned) == 5


def test_a_killed_replica_that_never_served_reports_its_exit_code(
        make_pool: Callable[..., FakePool]) -> None:
    pool = make_pool(WorkerConfig(max_failed_starts=1))
    pool.crash()
    assert pool.failure and "last error: exit code 1" in pool.failure


def test_cuda_on_a_host_without_it_fails_before_any_spawn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "_gpu_count", lambda: 0)
    for device in ("cuda", "cuda:0", "cuda:0,cuda:1"):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            Pool("x:y", RedisSettings(), WorkerConfig(device=device))
    monkeypatch.setattr(pool_module, "_gpu_count", lambda: 1)
    with pytest.raises(ConfigError, match="1 GPU"):
        Pool("x:y", RedisSettings(), WorkerConfig(device="cuda:0,cuda:1"))
    Pool("x:y", RedisSettings(), WorkerConfig(device="cuda:0"))
    Pool("x:y", RedisSettings(), WorkerConfig(device="auto"))


class _Stubborn:
    """A process that ignores SIGTERM: it is alive until killed."""

    def __init__(self) -> None:
        self.alive, self.joined, self.killed = True, [], False

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        pass

    def join(self, timeout_s: float | None = None) -> None:
        self.joined.append(timeout_s)

    def kill(self) -> None:
        self.killed, self.alive = True, False


def test_stop_waits_for_the_replicas_own_grace_before_killing() -> None:
    from redbatch import defaults
    from redbatch.config import RedisSettings, WorkerConfig
    from redbatch.worker.pool import Pool, _Replica

    pool = Pool("redbatch.demo:adder", RedisSettings(), WorkerConfig(grace_s=40.0,
                                                                     device="cpu"))
    stubborn = _Stubborn()
    pool.replicas = [_Replica(0, stubborn, None, 0.0)]  # type: ignore[arg-type]
    pool.stop()
    assert stubborn.killed
    assert stubborn.joined[0] > 40.0 + defaults.POOL_STOP_MARGIN_S - 1  # not a fixed 35 s


def test_a_replica_that_drained_its_versions_is_not_restarted(
        make_pool: Callable[..., FakePool]) -> None:
    pool = make_pool()
    pool.serve()
    pool.spawned[-1][1].messages.append(DRAINED)
    pool.proc.die(defaults.DRAINED_EXIT_CODE)
    pool._check(pool.replicas[0])
    pool.now += 600
    pool._check(pool.replicas[0])
    assert len(pool.spawned) == 1 and pool.replicas[0].drained


def test_a_replica_exiting_with_3_for_its_own_reasons_is_restarted(
        make_pool: Callable[..., FakePool]) -> None:
    pool = make_pool()
    pool.serve()
    pool.proc.die(defaults.DRAINED_EXIT_CODE)  # no DRAINED report: the model's sys.exit(3)
    pool._check(pool.replicas[0])
    pool.now = pool.replicas[0].next_start
    pool._check(pool.replicas[0])
    assert len(pool.spawned) == 2 and not pool.replicas[0].drained



def test_a_pool_whose_every_replica_drained_returns(make_pool: Callable[..., FakePool]
                                                    ) -> None:
    pool = make_pool()
    pool.serve()
    pool.spawned[-1][1].messages.append(DRAINED)
    pool.proc.die(defaults.DRAINED_EXIT_CODE)
    stop = threading.Event()
    pool.supervise(stop, tick_s=0.01)  # returns (it idled forever before)
    assert len(pool.spawned) == 1 and pool.replicas[0].drained and not pool.failure
