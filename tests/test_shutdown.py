"""Ctrl-C on ``redbatch up``: the terminal sends SIGINT to the whole process group.
Every time, at any point of start-up or while serving, everything must be gone within
10 s: gateway, worker replicas (none restarted), and the embedded Redis, stopped last."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable

import psutil
import pytest

from tests.conftest import Proc, RedisServer, free_port, redbatch_cmd, test_env, wait_http

pytestmark = pytest.mark.e2e
STOP_WITHIN_S = 10.0
READY_ROUNDS = {0, 4, 8}  # SIGINT once it serves; the other rounds during its start-up


def leftovers(mark: str) -> list[psutil.Process]:
    """Processes that inherited this run's marker in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RB_SHUTDOWN_TEST") == mark:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def interrupt_and_wait(proc: Proc) -> float:
    """SIGINT to the process group, as a terminal's Ctrl-C; seconds until it exited."""
    began = time.monotonic()
    os.killpg(proc.popen.pid, signal.SIGINT)
    try:
        proc.popen.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOP_WITHIN_S} s after SIGINT:\n{proc.log()}")
    return time.monotonic() - began


def assert_nothing_left(mark: str, proc: Proc) -> None:
    alive = leftovers(mark)
    _, alive = psutil.wait_procs(alive, timeout=2)  # reaped just now: give it a moment
    for stray in alive:
        stray.kill()
    assert not alive, f"left running: {alive}\n{proc.log()}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("round_", range(10))
def test_ctrl_c_stops_everything_within_10_s(spawn: Callable[..., Proc], round_: int) -> None:
    mark = uuid.uuid4().hex
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--port", str(port)),
                 env=test_env(RB_SHUTDOWN_TEST=mark), name="up")
    if round_ in READY_ROUNDS:
        wait_http(f"http://127.0.0.1:{port}/readyz", 50, proc)
    else:
        time.sleep(0.5 * round_)  # at different points of start-up
    interrupt_and_wait(proc)
    if round_ in READY_ROUNDS:
        assert proc.popen.returncode == 0, proc.log()
        log = proc.log()
        assert "restart #" not in log and "could not return its batch" not in log, log
    assert_nothing_left(mark, proc)


def test_ctrl_c_with_redis_already_gone(spawn: Callable[..., Proc],
                                        redis_server_factory: Callable[..., RedisServer]
                                        ) -> None:
    server = redis_server_factory()
    mark = uuid.uuid4().hex
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--port", str(port)),
                 env=test_env(REDIS_URL=server.url, RB_SHUTDOWN_TEST=mark), name="up")
    wait_http(f"http://127.0.0.1:{port}/readyz", 50, proc)
    server.kill()
    time.sleep(0.5)  # the workers notice: their pops fail and they retry
    interrupt_and_wait(proc)
    assert "restart #" not in proc.log()
    assert_nothing_left(mark, proc)
