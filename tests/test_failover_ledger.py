"""Failover ledgers: steady load on a real Redis Cluster (3 primaries, 3 replicas) and on
a Sentinel set-up while the primary that serves the model dies, every request
accounted for.

An in-process worker serves ``adder``; a ``Client`` sends ``PER_TICK`` requests every
``TICK_S`` (open loop), each with a deadline of ``TIMEOUT_S`` and a known answer
(x + 1).  The primary is killed (SIGKILL) after ``BEFORE_S``; the load goes on for
``AFTER_S`` once a replica is promoted.  The ledger must show: no call that hangs, no
wrong answer, no untyped error, nothing lost (every accepted request ends with its
answer or a typed error by its deadline), no duplicate reply, and the model served
again (every request of the last second answered) once the failover is over.

Asynchronous replication may drop an acknowledged enqueue: its caller then gets
``DeadlineExceeded`` by its deadline.  ``pytest -s`` prints each ledger (with the WAIT
variant's, for comparison); only the promises are asserted, not counts that depend on
timing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from redbatch import protocol
from redbatch.config import RedisSettings, ReplicaWait
from redbatch.errors import RedbatchError
from redbatch.producer.client import Client
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, wait_live
from tests.engines import ClusterEngine, SentinelEngine
from tests.models_for_tests import adder

pytestmark = [pytest.mark.engines, pytest.mark.timeout(40)]
MODEL = "adder"
TIMEOUT_S = 2.0  # each request's deadline
GRACE_S = 0.5  # a request with neither answer nor error by deadline + this is lost
TICK_S = 0.01
PER_TICK = 3  # about 300 requests/s
BEFORE_S = 1.5  # load before the kill
AFTER_S = 5.0  # load after the promotion
TAIL_S = 1.0  # at least the requests sent in this last stretch must all be answered
RECOVER_S = 10.0  # the first answer after the kill comes within this


@dataclass
class Ledger:
    """Every request's fate.  ``refused``: a typed error before the enqueue returned
    (never accepted); ``errors``: typed errors of accepted requests; ``lost``: accepted,
    neither answer nor error by deadline + grace; ``hung``: a call that did not
    return by then; ``untyped``: errors outside ``RedbatchError``."""

    sent: int = 0
    accepted: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    hung: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    untyped: list[BaseException] = field(default_factory=list)
    fates: list[tuple[float, bool]] = field(default_factory=list)  # (sent, monotonic), ok

    def settle(self, sent_s: float, ok: bool) -> None:
        self.ok += ok
        self.fates.append((sent_s, ok))

    def served_again_s(self) -> tuple[float, float]:
        """When the last failed request was sent (every later one was answered), and
        how long the requests kept being answered after it."""
        fates = sorted(self.fates)
        failed = [sent_s for sent_s, ok in fates if not ok]
        since_s = failed[-1] if failed else fates[0][0]
        return since_s, fates[-1][0] - since_s

    def report(self, title: str, stats: dict[str, int]) -> str:
        lines = [f"{title}", f"  sent {self.sent}", f"  refused {dict(self.refused)}",
                 f"  accepted {self.accepted}", f"  ok {self.ok} (wrong answers: "
                 f"{self.wrong})", f"  typed errors {dict(self.errors)}",
                 f"  untyped errors {len(self.untyped)}", f"  lost {self.lost}",
                 f"  hung {self.hung}", f"  duplicated {stats.get('duplicates')}",
                 f"  client stats {stats}"]
        return "\n".join(lines)


async def call(client: Client, ledger: Ledger, x: int) -> None:
    """One request, its outcome in ``ledger``: ``submit_many`` returns once the
    enqueue did (a refusal is in the future), then the answer is awaited."""
    ledger.sent += 1
    sent_s = time.monotonic()
    deadline_s = sent_s + TIMEOUT_S
    try:
        async with asyncio.timeout(TIMEOUT_S + GRACE_S):
            [future] = await client.submit_many(MODEL, [x], timeout_s=TIMEOUT_S)
    except TimeoutError:
        ledger.hung += 1
        return
    except RedbatchError as exc:
        ledger.refused[type(exc).__name__] += 1
        return ledger.settle(sent_s, False)
    if future.done() and future.exception() is not None and time.monotonic() < deadline_s:
        ledger.refused[type(future.exception()).__name__] += 1
        return ledger.settle(sent_s, False)
    ledger.accepted += 1
    await outcome(ledger, future, x, sent_s, deadline_s)


async def outcome(ledger: Ledger, future: asyncio.Future[Any], x: int, sent_s: float,
                  deadline_s: float) -> None:
    done, _ = await asyncio.wait([future], timeout=deadline_s + GRACE_S - time.monotonic())
    if not done:
        future.cancel()
        ledger.lost += 1
        return
    exc = future.exception()
    if exc is None:
        right = future.result() == x + 1
        ledger.wrong += not right
        return ledger.settle(sent_s, right)
    if isinstance(exc, RedbatchError):
        ledger.errors[type(exc).__name__] += 1
    else:
        ledger.untyped.append(exc)
    ledger.settle(sent_s, False)


async def generate(client: Client, ledger: Ledger, stop: asyncio.Event) -> None:
    """``PER_TICK`` calls every ``TICK_S`` until ``stop``; then every call's end."""
    loop, calls, x = asyncio.get_running_loop(), [], 0
    next_s = loop.time()
    while not stop.is_set():
        for _ in range(PER_TICK):
            calls.append(asyncio.create_task(call(client, ledger, x)))
            x += 1
        next_s += TICK_S
        await asyncio.sleep(max(0.0, next_s - loop.time()))
    await asyncio.gather(*calls)


async def run_ledger(client: Client, fail_over: Callable[[], Awaitable[object]]
                     ) -> tuple[Ledger, float, float]:
    """Load, the failover in the middle, load after it: the ledger, when the primary
    was killed and when a replica was promoted (monotonic)."""
    ledger, stop = Ledger(), asyncio.Event()
    load = asyncio.create_task(generate(client, ledger, stop))
    await asyncio.sleep(BEFORE_S)
    assert ledger.ok > 0, f"nothing served before the failover: {ledger}"
    killed_s = time.monotonic()
    await fail_over()
    promoted_s = time.monotonic()
    await asyncio.sleep(AFTER_S)
    stop.set()
    await load
    return ledger, killed_s, promoted_s


def check_promises(ledger: Ledger, killed_s: float, stats: dict[str, int]) -> None:
    assert ledger.hung == 0, "a call did not return by its deadline"
    assert ledger.wrong == 0, "a wrong answer"
    assert not ledger.untyped, f"untyped errors: {ledger.untyped[:3]}"
    assert ledger.lost == 0, "an accepted request ended neither answered nor failed"
    assert stats["duplicates"] == 0, "a request answered twice"
    assert ledger.accepted == ledger.ok + sum(ledger.errors.values())
    since_s, served_s = ledger.served_again_s()
    assert since_s - killed_s < RECOVER_S, "not served again after the failover"
    assert served_s >= TAIL_S, f"requests failed in the last {TAIL_S} s"


ClientOf = Callable[[ReplicaWait | None], Client]


async def serving(url: str, start_worker: Callable[..., Worker]) -> ClientOf:
    """An in-process worker of ``adder`` at ``url``, live; a maker of clients."""
    settings = RedisSettings(url, socket_timeout_s=3.0, connect_timeout_s=0.5)
    start_worker([adder], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, MODEL)
    return lambda wait: Client(settings=settings, replica_wait=wait or ReplicaWait())


@pytest.fixture
async def cluster_client(redis_cluster: ClusterEngine, start_worker: Callable[..., Worker]
                         ) -> ClientOf:
    return await serving(redis_cluster.url, start_worker)


@pytest.fixture
async def sentinel_client(redis_sentinel: SentinelEngine,
                          start_worker: Callable[..., Worker]) -> ClientOf:
    return await serving(redis_sentinel.url, start_worker)


async def ledger_through(client: Client, fail_over: Callable[[], Awaitable[object]],
                         title: str) -> None:
    async with client:
        ledger, killed_s, promoted_s = await run_ledger(client, fail_over)
        stats = client.stats()
    since_s, _ = ledger.served_again_s()
    print(f"\n{ledger.report(title, stats)}\n  promoted {promoted_s - killed_s:.1f} s after "
          f"the kill; every request sent from {since_s - killed_s:.1f} s on answered")
    check_promises(ledger, killed_s, stats)


WAIT_ONE = ReplicaWait(wait_replicas=1, wait_timeout_ms=100)


@pytest.mark.parametrize("wait", [None, WAIT_ONE], ids=["async", "wait1"])
async def test_cluster_failover_ledger(redis_cluster: ClusterEngine, wait: ReplicaWait | None,
                                       cluster_client: ClientOf) -> None:
    key = protocol.queue_key(MODEL)
    await ledger_through(cluster_client(wait),
                         lambda: asyncio.to_thread(redis_cluster.fail_over, key),
                         f"cluster failover, WAIT {wait}")


@pytest.mark.parametrize("wait", [None, WAIT_ONE], ids=["async", "wait1"])
async def test_sentinel_failover_ledger(redis_sentinel: SentinelEngine,
                                        wait: ReplicaWait | None,
                                        sentinel_client: ClientOf) -> None:
    await ledger_through(sentinel_client(wait),
                         lambda: asyncio.to_thread(redis_sentinel.fail_over),
                         f"sentinel failover, WAIT {wait}")
