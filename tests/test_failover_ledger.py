"""Failover ledgers: steady load on a real Redis Cluster (3 primaries, 3 replicas) and on
a Sentinel set-up while the primary that serves the model dies, every request
accounted for.

An in-process worker serves ``gated``; a ``Client`` (or, in the gateway's ledgers, an
HTTP client of an in-process gateway) sends ``PER_TICK`` requests every
``TICK_S`` (open loop), each with a deadline of ``TIMEOUT_S`` and a known answer
(x + 1).  The primary is killed (SIGKILL) after ``BEFORE_S``, once its replica holds
every write it took (its writes paused for that moment); the load goes on until
requests have been answered again for ``SERVED_S``.  (The planned scenario instead
sends ``CLUSTER FAILOVER`` to the replica, and no request may fail at all.)  The
ledger must show: no call that
hangs, no wrong answer, no untyped error, nothing lost (every accepted request ends
with its answer or a typed error by its deadline), no duplicate reply, and the model
served again within ``RECOVER_S`` of the kill.

Asynchronous replication may drop an acknowledged enqueue: its caller then gets
``DeadlineExceeded`` by its deadline; and a reply whose marker's flip the replica
missed is sent again after the promotion.  A kill under load hits that gap now and then
(a loaded machine's replica reads a few writes behind), hence the pause above.  The
``lagging`` scenario makes it happen for sure: the replica is paused and cut off from
the primary, and the worker's passes held, for ``LAG_S`` before the kill, so the
requests the primary accepts meanwhile never reach the replica: they end with
``DeadlineExceeded``.  The replies the replica missed (a batch that was computing at
the cut) are sent again after the promotion, and the client's listener drops the
second one: there, ``duplicates`` may exceed 0, never a
caller's answers.  ``pytest -s`` prints each ledger (with and without ``WAIT``); only
the promises are asserted, not counts that depend on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from redbatch import batch, protocol
from redbatch.api import create_app
from redbatch.config import GatewayConfig, RedisSettings, ReplicaWait
from redbatch.errors import RedbatchError
from redbatch.producer.client import Client
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, wait_live
from tests.engines import START_TIMEOUT_S, ClusterEngine, Node, SentinelEngine, poll

pytestmark = [pytest.mark.engines, pytest.mark.serial, pytest.mark.timeout(40)]
MODEL = "gated"
TIMEOUT_S = 2.0  # each request's deadline
GRACE_S = 0.5  # a request with neither answer nor error by deadline + this is lost
TICK_S = 0.01
PER_TICK = 3  # about 300 requests/s
BEFORE_S = 1.5  # load before the kill
TAIL_S = 1.0  # at least the requests sent in this last stretch must all be answered
# the load goes on until the requests sent for this long were all answered (those sent
# later may still fail: they may take until their deadline)
SERVED_S = TAIL_S + TIMEOUT_S + GRACE_S
RECOVER_S = 10.0  # every request sent this long after the kill is answered
LAG_S = 0.5  # the lagging scenario: the replica cut off this long before the kill
CATCH_UP_S = 2.0  # otherwise: writes paused (this long at most) until the replica has them
GATE = threading.Event()  # cleared: the model's passes wait (the lagging scenario)
GATE.set()


@batch(name=MODEL, max_batch_size=8, batch_wait_timeout_s=0.002)
def _gated(xs: list[int]) -> list[int]:
    """Adds one, once the gate is open (it waits 5 s at most)."""
    GATE.wait(5.0)
    return [x + 1 for x in xs]


gated = dataclasses.replace(_gated, inline=False)  # waits in the forward thread


@dataclass
class Ledger:
    """Every request's fate.  ``refused``: a typed error before the enqueue returned
    (never accepted); ``errors``: typed errors of accepted requests; ``lost``: accepted,
    neither answer nor error by deadline + grace; ``hung``: a call that did not
    return by then; ``untyped``: errors that are not typed (a foreign exception, or a
    bare ``RedbatchError``, which wraps one)."""

    sent: int = 0
    accepted: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    hung: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    errors_before_kill: Counter[str] = field(default_factory=Counter)  # sent before it
    killed_s: float = math.inf  # (monotonic) when the primary was killed
    overrun_s: float = -math.inf  # the latest end of a call past its deadline
    untyped: list[BaseException | None] = field(default_factory=list)
    fates: list[tuple[float, bool]] = field(default_factory=list)  # (sent, monotonic), ok?

    def settle(self, sent_s: float, ok: bool) -> None:
        self.ok += ok
        self.overrun_s = max(self.overrun_s, time.monotonic() - sent_s - TIMEOUT_S)
        self.fates.append((sent_s, ok))

    def served_again_s(self) -> tuple[float, float]:
        """When the last failed request was sent (every later one was answered), and
        how long the requests kept being answered after it."""
        fates = sorted(self.fates) or [(0.0, False)]
        failed = [sent_s for sent_s, ok in fates if not ok]
        since_s = failed[-1] if failed else fates[0][0]
        return since_s, fates[-1][0] - since_s

    def report(self, title: str, stats: dict[str, int]) -> str:
        lines = [f"{title}", f"  sent {self.sent}", f"  refused {dict(self.refused)}",
                 f"  accepted {self.accepted}", f"  ok {self.ok} (wrong answers: "
                 f"{self.wrong})", f"  typed errors {dict(self.errors)}",
                 f"  of which sent before the kill {dict(self.errors_before_kill)}",
                 f"  untyped errors {len(self.untyped)}", f"  lost {self.lost}",
                 f"  hung {self.hung}", f"  duplicated {stats.get('duplicates')}",
                 f"  latest end past a deadline {self.overrun_s * 1000:.0f} ms",
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
    except Exception as exc:
        return refuse(ledger, sent_s, exc)
    if future.done() and future.exception() is not None and time.monotonic() < deadline_s:
        return refuse(ledger, sent_s, future.exception())
    ledger.accepted += 1
    await outcome(ledger, future, x, sent_s, deadline_s)


def typed(ledger: Ledger, exc: BaseException | None) -> str | None:
    """The name of ``exc``'s type; None for an error that is not a typed one (noted in
    ``untyped``): a foreign exception, or a bare ``RedbatchError`` (one wrapped)."""
    if isinstance(exc, RedbatchError) and type(exc) is not RedbatchError:
        return type(exc).__name__
    ledger.untyped.append(exc)
    return None


def refuse(ledger: Ledger, sent_s: float, exc: BaseException | None) -> None:
    if (name := typed(ledger, exc)) is not None:
        ledger.refused[name] += 1
    ledger.settle(sent_s, False)


async def outcome(ledger: Ledger, future: asyncio.Future[Any], x: int, sent_s: float,
                  deadline_s: float) -> None:
    done, _ = await asyncio.wait([future], timeout=deadline_s + GRACE_S - time.monotonic())
    if not done:
        future.cancel()
        ledger.lost += 1
        return
    if future.exception() is None:
        right = future.result() == x + 1
        ledger.wrong += not right
        return ledger.settle(sent_s, right)
    if (name := typed(ledger, future.exception())) is not None:
        ledger.errors[name] += 1
        ledger.errors_before_kill[name] += sent_s < ledger.killed_s
    ledger.settle(sent_s, False)


async def http_call(http: httpx.AsyncClient, ledger: Ledger, x: int) -> None:
    """One request through the HTTP gateway, its outcome in ``ledger``: a 200 with the
    answer, or a typed error (a 503 or 504 whose body names its code); a 500, a body
    without a code or a call past its deadline would break the promises."""
    ledger.sent += 1
    sent_s = time.monotonic()
    try:
        async with asyncio.timeout(TIMEOUT_S + GRACE_S):
            resp = await http.post(f"/v1/models/{MODEL}/predict",
                                   json={"inputs": x, "timeout_ms": TIMEOUT_S * 1000})
    except TimeoutError:
        ledger.hung += 1
        return
    ledger.accepted += 1  # (an HTTP caller cannot tell a refusal from a later error)
    if resp.status_code == 200:
        right = resp.json() == {"outputs": x + 1}
        ledger.wrong += not right
        return ledger.settle(sent_s, right)
    code = resp.json().get("error", {}).get("code") if resp.status_code in (503, 504) else None
    if code is None:
        ledger.untyped.append(RuntimeError(f"{resp.status_code} {resp.text[:200]}"))
    else:
        ledger.errors[f"{resp.status_code} {code}"] += 1
        ledger.errors_before_kill[f"{resp.status_code} {code}"] += sent_s < ledger.killed_s
    ledger.settle(sent_s, False)


Caller = Callable[["Ledger", int], Awaitable[None]]  # one request, its fate in the ledger


async def generate(caller: Caller, ledger: Ledger, stop: asyncio.Event) -> None:
    """``PER_TICK`` calls every ``TICK_S`` until ``stop``; then every call's end."""
    loop, calls, x = asyncio.get_running_loop(), [], 0
    next_s = loop.time()
    while not stop.is_set():
        for _ in range(PER_TICK):
            calls.append(asyncio.create_task(caller(ledger, x)))
            x += 1
        next_s += TICK_S
        await asyncio.sleep(max(0.0, next_s - loop.time()))
    await asyncio.gather(*calls)


Kill = Callable[["Ledger"], None]  # kills the primary (noting when), waits for promotion


async def run_ledger(caller: Caller, kill: Kill) -> tuple[Ledger, float]:
    """Load, the failover in the middle, load after it: the ledger, and when the
    replica was promoted (monotonic)."""
    ledger, stop = Ledger(), asyncio.Event()
    load = asyncio.create_task(generate(caller, ledger, stop))
    try:
        await asyncio.sleep(BEFORE_S)
        assert ledger.ok > 0, f"nothing served before the failover: {ledger.report('', {})}"
        await asyncio.to_thread(kill, ledger)
        promoted_s = time.monotonic()
        await served_again(ledger)
    finally:
        stop.set()
        await load  # (every call ends by its deadline and grace)
    return ledger, promoted_s


async def served_again(ledger: Ledger) -> None:
    """Until every request sent for ``SERVED_S`` has been answered (checked as they
    end), or ``RECOVER_S`` after the kill and that long again."""
    end_s = ledger.killed_s + RECOVER_S + SERVED_S
    while time.monotonic() < end_s and ledger.served_again_s()[1] < SERVED_S:
        await asyncio.sleep(0.1)


def check_promises(ledger: Ledger, stats: dict[str, Any], lag: bool) -> None:
    """The promises; with ``lag``, a reply the replica missed (its marker's flip with
    it) may be sent again after the promotion: the listener drops it (``duplicates``),
    the caller had its one answer."""
    assert ledger.hung == 0, "a call did not return by its deadline"
    assert ledger.wrong == 0, "a wrong answer"
    assert not ledger.untyped, f"untyped errors: {ledger.untyped[:3]}"
    assert ledger.lost == 0, "an accepted request ended neither answered nor failed"
    assert lag or stats["duplicates"] == 0, "a request answered twice"
    assert ledger.accepted == ledger.ok + sum(ledger.errors.values())
    since_s, served_s = ledger.served_again_s()
    assert since_s - ledger.killed_s < RECOVER_S, "not served again after the failover"
    assert served_s >= TAIL_S, f"requests failed in the last {TAIL_S} s"


def replica_offset(replica: Node) -> int:
    return int(replica.ask("INFO", "replication")["slave_repl_offset"])


def caught_up(primary: Node, replica: Node) -> None:
    """Writes paused on ``primary`` (for ``CATCH_UP_S`` at most: its clients' writes
    wait, unanswered), until ``replica`` holds every write it took."""
    primary.ask("CLIENT", "PAUSE", int(CATCH_UP_S * 1000), "WRITE")
    offset = int(primary.ask("INFO", "replication")["master_repl_offset"])
    end_s = time.monotonic() + CATCH_UP_S / 2
    while replica_offset(replica) < offset:
        assert time.monotonic() < end_s, "the replica did not catch up with its primary"
        time.sleep(0.001)


@contextmanager
def cut_off(primary: Node, replica: Node, lag: bool) -> Iterator[None]:
    """With ``lag``, for ``LAG_S`` before the block (the kill): the replica paused and
    its link to the primary cut (the writes the primary takes then never reach it), and
    the model's passes held (the requests stay queued); both resume after the block.
    Without, the replica has caught up with every write when the block starts."""
    if not lag:
        caught_up(primary, replica)
        yield
        return
    assert replica.proc is not None
    replica.proc.send_signal(signal.SIGSTOP)
    try:
        assert primary.ask("CLIENT", "KILL", "TYPE", "replica") == 1
        GATE.clear()
        time.sleep(LAG_S)  # (the load goes on: the primary takes what the replica misses)
        yield
    finally:
        replica.proc.send_signal(signal.SIGCONT)
        GATE.set()


def killing(primary: Node, replica: Node, lag: bool, ledger: Ledger) -> None:
    with cut_off(primary, replica, lag):
        ledger.killed_s = time.monotonic()
        primary.kill()


def replica_of(engine: ClusterEngine, key: str) -> Node:
    """The replica of the primary that serves ``key``'s slot."""
    slot = int(engine.nodes[0].ask("CLUSTER", "KEYSLOT", key))
    for start, end, _primary, replica, *_ in engine.nodes[0].ask("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return next(n for n in engine.nodes if n.port == int(replica[1]))
    raise AssertionError(f"slot {slot} is not served")


def cluster_kill(engine: ClusterEngine, lag: bool) -> Kill:
    key = protocol.queue_key(MODEL)

    def kill(ledger: Ledger) -> None:
        killing(engine.owner(key), replica_of(engine, key), lag, ledger)
        engine.fail_over(key)  # (its primary is dead already: it waits for the promotion)
    return kill


def cluster_planned(engine: ClusterEngine) -> Kill:
    """``CLUSTER FAILOVER`` on the replica of the queue's primary (a rolling upgrade's
    step): the primary pauses its clients' writes until the replica has them all, then
    hands the slot over and turns replica."""
    key = protocol.queue_key(MODEL)

    def fail_over(ledger: Ledger) -> None:
        replica = replica_of(engine, key)
        ledger.killed_s = time.monotonic()
        assert replica.ask("CLUSTER", "FAILOVER") == b"OK"
        poll("the replica took the slot over", lambda: engine.owner(key) is replica,
             START_TIMEOUT_S)
        engine.wait_ok()
    return fail_over


def sentinel_kill(engine: SentinelEngine, lag: bool) -> Kill:
    def kill(ledger: Ledger) -> None:
        assert engine.replica is not None
        killing(engine.primary, engine.replica, lag, ledger)
        engine.fail_over()
    return kill


ClientOf = Callable[[ReplicaWait | None], Client]


async def serving(url: str, start_worker: Callable[..., Worker]) -> ClientOf:
    """An in-process worker of ``gated`` at ``url``, live; a maker of clients."""
    settings = RedisSettings(url, socket_timeout_s=3.0, connect_timeout_s=0.5)
    start_worker([gated], url=settings.url, config=FAST_WORKER)
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


async def ledger_through(client: Client, kill: Kill, title: str, lag: bool) -> Ledger:
    async with client:
        ledger, promoted_s = await run_ledger(functools.partial(call, client), kill)
        stats = client.stats()
    report_and_check(ledger, promoted_s, stats, title, lag)
    return ledger


def report_and_check(ledger: Ledger, promoted_s: float, stats: dict[str, Any], title: str,
                     lag: bool) -> None:
    since_s, _ = ledger.served_again_s()
    print(f"\n{ledger.report(title, stats)}\n  promoted {promoted_s - ledger.killed_s:.1f} s "
          f"after the kill; every request sent from {since_s - ledger.killed_s:.1f} s on "
          "answered")
    check_promises(ledger, stats, lag)
    if lag:  # the requests the replica missed were accepted, then lost: each one timed out
        assert sum(n for name, n in ledger.errors_before_kill.items()
                   if "eadline" in name) > 0


WAIT_ONE = ReplicaWait(wait_replicas=1, wait_timeout_ms=100)
SCENARIOS = pytest.mark.parametrize(("wait", "lag"), [(None, False), (WAIT_ONE, False),
                                                      (WAIT_ONE, True)],
                                    ids=["async", "wait1", "lagging-wait1"])


@SCENARIOS
async def test_cluster_failover_ledger(redis_cluster: ClusterEngine, wait: ReplicaWait | None,
                                       lag: bool, cluster_client: ClientOf) -> None:
    await ledger_through(cluster_client(wait), cluster_kill(redis_cluster, lag),
                         f"cluster failover, WAIT {wait}, lagging replica {lag}", lag)


async def test_cluster_planned_failover_ledger(redis_cluster: ClusterEngine,
                                               cluster_client: ClientOf) -> None:
    """A planned failover keeps every promise of a kill's (no request lost, hung,
    wrong or answered twice), and more: no write is lost, so no request fails at all
    (the clients follow the slot's MOVED to the new primary)."""
    ledger = await ledger_through(cluster_client(None), cluster_planned(redis_cluster),
                                  "cluster planned failover (CLUSTER FAILOVER)", False)
    assert not ledger.errors and not ledger.refused, ledger.report("planned", {})


@SCENARIOS
async def test_sentinel_failover_ledger(redis_sentinel: SentinelEngine,
                                        wait: ReplicaWait | None, lag: bool,
                                        sentinel_client: ClientOf) -> None:
    await ledger_through(sentinel_client(wait), sentinel_kill(redis_sentinel, lag),
                         f"sentinel failover, WAIT {wait}, lagging replica {lag}", lag)


@asynccontextmanager
async def gateway_http(url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The HTTP gateway in this process (its lifespan run), at the Redis of ``url``."""
    app = create_app(GatewayConfig(default_timeout_s=TIMEOUT_S),
                     RedisSettings(url, socket_timeout_s=3.0, connect_timeout_s=0.5))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as http:
        yield http


async def test_gateway_failover_ledger_cluster(redis_cluster: ClusterEngine,
                                               start_worker: Callable[..., Worker]) -> None:
    """The same promises for callers of the HTTP gateway: a 200 with the answer or a
    503/504 with its code by the deadline, never a 500 nor a hang, and served again."""
    await gateway_ledger("cluster", redis_cluster.url, cluster_kill(redis_cluster, False),
                         start_worker)


async def test_gateway_failover_ledger_sentinel(redis_sentinel: SentinelEngine,
                                                start_worker: Callable[..., Worker]) -> None:
    """As above, behind Sentinel.  (Each engine comes before the worker fixture, so
    that the worker stops before its engine: stopped against dead sentinels, it left
    their clients' connections to be collected open, a ResourceWarning in a later
    test.)"""
    await gateway_ledger("sentinel", redis_sentinel.url, sentinel_kill(redis_sentinel, False),
                         start_worker)


async def gateway_ledger(engine: str, url: str, kill: Kill,
                         start_worker: Callable[..., Worker]) -> None:
    await serving(url, start_worker)
    async with gateway_http(url) as http:
        ledger, promoted_s = await run_ledger(functools.partial(http_call, http), kill)
        stats = (await http.get("/v1/stats")).json()
    report_and_check(ledger, promoted_s, stats, f"gateway, {engine} failover", False)
