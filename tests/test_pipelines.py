"""Pipelines: chained models served under their own name (``redbatch.pipelines``),
handed on stage to stage through Redis, against a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from rich.console import Console

from redbatch import Client, RedisSettings, codec, protocol
from redbatch.api import create_app
from redbatch.config import GatewayConfig
from redbatch.errors import DeadlineExceeded, InvalidKnob, InvalidPayload, ModelError
from redbatch.lean import LeanLink
from redbatch.levels import ONE
from redbatch.pipelines import Pipeline, handoff
from redbatch.pipelines.context import Context
from redbatch.pipelines.mover import Mover
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, until, wait_live

pytestmark = pytest.mark.timeout(30)
POLICY = BatchPolicy(max_batch_size=16, batch_wait_timeout_s=0.0)
CALC = Pipeline("calc", ["inc", "dbl"])


def inc_fn(xs: list[int]) -> list[int]:
    if -1 in xs:
        raise ValueError("no -1 here")
    return [x + 1 for x in xs]


class Counted:
    """``dbl``: doubles, and counts how often it saw each input."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def __call__(self, xs: list[int]) -> list[int]:
        for x in xs:
            self.seen[x] = self.seen.get(x, 0) + 1
        return [2 * x for x in xs]


def inc() -> Model:
    return Model("inc", fn=inc_fn, policy=POLICY, inline=True)


def dbl(counted: Counted, levels: int = 1) -> Model:
    return Model("dbl", fn=counted, policy=POLICY, inline=True, priority_levels=levels,
                 default_priority=levels)


class Workers:
    """Workers as tasks on the test's loop, each stoppable on its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.running: list[tuple[asyncio.Event, asyncio.Task[None], Worker]] = []

    def start(self, models: list[Model], pipelines: list[Pipeline] | None = None,
              settings: RedisSettings | None = None) -> Worker:
        worker = Worker(models, settings or RedisSettings(self.url), FAST_WORKER,
                        pipelines=pipelines)
        stop = asyncio.Event()
        self.running.append((stop, asyncio.create_task(worker.run(stop)), worker))
        return worker

    async def stop(self, worker: Worker) -> None:
        for stop, task, each in self.running:
            if each is worker:
                stop.set()
                await asyncio.wait_for(task, 10)

    async def stop_all(self) -> None:
        for stop, _task, _worker in self.running:
            stop.set()
        for _stop, task, _worker in self.running:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)


@pytest.fixture
async def workers(redis_url: str) -> AsyncIterator[Workers]:
    running = Workers(redis_url)
    yield running
    await running.stop_all()


async def test_a_chain_answers_under_its_own_name(workers: Workers, redis_url: str) -> None:
    counted = Counted()
    workers.start([inc()], [CALC])
    workers.start([dbl(counted)])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        assert await client.predict("calc", 3, timeout_s=5) == 8
        assert await client.predict_many("calc", list(range(10, 30)), timeout_s=5) == [
            2 * (x + 1) for x in range(10, 30)]
        assert await client.predict("inc", 3, timeout_s=5) == 4  # a stage stays a model
    assert set(counted.seen.values()) == {1}


async def test_v1_predict_and_the_models_listing(workers: Workers, redis_url: str) -> None:
    workers.start([inc(), dbl(Counted())], [CALC])
    await wait_live(redis_url, "calc")
    app = create_app(GatewayConfig(), RedisSettings(redis_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as http:
        resp = await http.post("/v1/models/calc/predict", json={"inputs": 4},
                               headers={"x-request-id": "trace-v1"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"outputs": 10}
        assert resp.headers["x-request-id"] == "trace-v1"
        listing = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
        assert listing["calc"]["kind"] == "pipeline"
        assert listing["calc"]["stages"] == ["inc", "dbl"]
        assert listing["inc"]["kind"] == listing["dbl"]["kind"] == "model"
        failed = await http.post("/v1/models/calc/predict", json={"inputs": -1})
        assert failed.status_code == 500 and "stage 'inc' failed" in failed.text
        v2 = await http.post("/v2/models/calc/infer", json={"inputs": [
            {"name": "inputs", "datatype": "INT64", "shape": [3], "data": [41, 0, -2]}]})
        assert v2.status_code == 200, v2.text
        assert v2.json()["outputs"][0]["data"] == [84, 2, -2]
        assert v2.json()["model_name"] == "calc"
        bad_row = await http.post("/v2/models/calc/infer", json={"inputs": [
            {"name": "inputs", "datatype": "INT64", "shape": [2], "data": [1, -1]}]})
        assert bad_row.status_code == 500 and "stage 'inc' failed" in bad_row.text


async def test_a_pipelines_knobs_are_its_stages(workers: Workers, redis_url: str,
                                                raw_redis: redis.Redis) -> None:
    """No worker reads knobs stored under a pipeline's name: a change there is refused
    (422, ``InvalidKnob``) naming its stages, and nothing is stored; a stage's own
    change is taken."""
    workers.start([inc(), dbl(Counted())], [CALC])
    await wait_live(redis_url, "calc")
    app = create_app(GatewayConfig(), RedisSettings(redis_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as http:
        resp = await http.patch("/v1/models/calc/config", json={"max_batch_size": 4})
        assert resp.status_code == 422, resp.text
        assert "'calc' is a pipeline: its knobs are its stages' (inc, dbl)" in resp.text
        staged = await http.patch("/v1/models/inc/config", json={"max_batch_size": 4})
        assert staged.status_code == 200, staged.text
    async with Client(redis_url) as client:
        with pytest.raises(InvalidKnob, match="is a pipeline"):
            await client.configure("calc", reset=True)
    assert not raw_redis.exists(protocol.config_key("calc"))
    assert raw_redis.hgetall(protocol.config_key("inc")) == {b"max_batch_size": b"4"}


async def test_a_stage_error_names_the_stage(workers: Workers, redis_url: str) -> None:
    workers.start([inc(), dbl(Counted())], [CALC])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        with pytest.raises(ModelError, match=r"stage 'inc' failed: .*no -1 here"):
            await client.predict("calc", -1, timeout_s=5)
        assert await client.predict("calc", 1, timeout_s=5) == 4


async def test_a_row_a_stage_before_the_last_fails_stops_its_requests_rows(
        workers: Workers, redis_url: str) -> None:
    """The good rows' outputs were the failing stage's (``inc``'s 2 and 3 for 1 and 2),
    given to the caller as the pipeline's answer."""
    workers.start([inc(), dbl(Counted())], [CALC])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        (whole,) = await client.submit_many("calc", [[1, 2, 3]], timeout_s=5, batched=True)
        assert list(await whole) == [4, 6, 8]
        (rows,) = await client.submit_many("calc", [[1, 2, -1]], timeout_s=5, batched=True,
                                           reply=True)
        reply = await rows
    assert reply.payload == [None, None, None]
    assert "stage 'inc' failed" in reply.row_errors[2][1]
    assert "no -1 here" in reply.row_errors[2][1]
    for row in (0, 1):
        assert reply.row_errors[row][0] == "model_error"
        assert "not computed further: row(s) 2 of this request" in reply.row_errors[row][1]


async def test_deadline_priority_and_trace_travel_to_the_next_stage(
        workers: Workers, redis_url: str, raw_redis: redis.Redis) -> None:
    counted = Counted()
    second = workers.start([dbl(counted, levels=2)])  # publishes its levels, then stops
    await wait_live(redis_url, "dbl")
    await workers.stop(second)
    workers.start([inc()], [CALC])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        deadline_ms = protocol.now_ms() + 8000
        future = await client.submit("calc", 5, deadline_ms=deadline_ms, trace_id="trace-7",
                                     priority=1, reply=True)
        urgent = protocol.queue_key("dbl", 1)  # level 1 of dbl (its default is 2)
        for _ in range(200):
            if raw_redis.llen(urgent):
                break
            await asyncio.sleep(0.02)
        entry = protocol.request_from_wire(codec.decode(raw_redis.lindex(urgent, 0)))
        assert (entry.id, entry.payload, entry.deadline_ms) == (future.request_id, 6,
                                                                deadline_ms)
        assert (entry.trace_id, entry.priority) == ("trace-7", 1)
        assert entry.reply_to == protocol.outbox_key("dbl")
        workers.start([dbl(counted, levels=2)])
        reply = await future
        assert reply.ok and reply.payload == 12


async def test_an_expired_request_is_dropped_at_the_stage_it_reached(
        workers: Workers, redis_url: str, raw_redis: redis.Redis) -> None:
    counted = Counted()
    workers.start([inc()], [CALC])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        with pytest.raises(DeadlineExceeded):
            await client.predict("calc", 7, timeout_s=0.3)
        assert raw_redis.llen(protocol.queue_key("dbl")) == 1  # it reached dbl's queue
        workers.start([dbl(counted)])
        for _ in range(200):
            if not raw_redis.llen(protocol.queue_key("dbl")):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert counted.seen == {}  # answered deadline_exceeded, never computed
        assert await client.predict("calc", 1, timeout_s=5) == 4


async def test_a_hand_off_sent_twice_is_queued_once(redis_url: str,
                                                    raw_redis: redis.Redis) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    link = LeanLink(client)
    ctx = Context("calc", [], protocol.reply_key("calc", "c1"), protocol.now_ms() + 5000,
                  protocol.now_ms())
    assert await handoff.send(link, ONE, "dbl", "req-1", 3, ctx)
    assert not await handoff.send(link, ONE, "dbl", "req-1", 3, ctx)
    assert raw_redis.llen(protocol.queue_key("dbl")) == 1
    wire = {"v": 1, "id": "req-1", "ok": True, "payload": 6, "timings": {}}
    deliver = handoff.deliver_command("req-1", wire, ctx)
    assert await handoff.run_group(link, [deliver]) == [1]
    assert await handoff.run_group(link, [deliver]) == [0]  # one final reply
    assert raw_redis.llen(ctx.reply_to) == 1
    await link.release()
    await client.aclose()


async def test_a_hand_off_to_a_drained_version_is_refused(redis_url: str,
                                                          raw_redis: redis.Redis) -> None:
    """A stage that is a version closed by its drain takes nothing more (503): before,
    the request waited in a queue no worker would come to, to its deadline."""
    from redbatch.errors import NoLiveWorkers

    client = redis.asyncio.Redis.from_url(redis_url)
    link = LeanLink(client)
    ctx = Context("calc", [], protocol.reply_key("calc", "c1"), protocol.now_ms() + 5000,
                  protocol.now_ms())
    assert await handoff.send(link, ONE, "dbl@2", "req-1", 3, ctx)  # open
    raw_redis.set(protocol.closed_key("dbl@2"), 1)  # drained
    with pytest.raises(NoLiveWorkers, match="drained"):
        await handoff.send(link, ONE, "dbl@2", "req-2", 3, ctx)
    assert raw_redis.llen(protocol.queue_key("dbl@2")) == 1
    assert await handoff.send(link, ONE, "dbl", "req-3", 3, ctx)  # no version: no marker
    await link.release()
    await client.aclose()


def dying_movers(monkeypatch: pytest.MonkeyPatch, deaths: int = 3) -> list[int]:
    """The first ``deaths`` mover steps that take records "die" after sending them on
    but before marking them done (their DONE never goes out); leases of 300 ms."""
    monkeypatch.setattr(protocol, "HANDOFF_LEASE_MS", 300)
    died: list[int] = []
    real_step = Mover.step

    async def dying_step(self: Mover) -> int:
        taken = await real_step(self)
        if taken and len(died) < deaths:  # sent on, not marked done: the process "dies"
            died.append(taken)
            self.done = None
            raise ConnectionError("died between the two steps")
        return taken

    monkeypatch.setattr(Mover, "step", dying_step)
    return died


async def test_a_hand_off_whose_sender_died_is_resent_once(
        workers: Workers, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the lease of the dead movers' records expires they are taken again and sent
    again; the markers keep it to one entry and one reply each."""
    died = dying_movers(monkeypatch)
    counted = Counted()
    workers.start([inc(), dbl(counted)], [CALC])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        n = 60
        results = await client.predict_many("calc", list(range(n)), timeout_s=15)
        assert results == [2 * (x + 1) for x in range(n)]
        assert died  # some hand-offs did die half-way
        assert counted.seen == {x + 1: 1 for x in range(n)}  # computed once each
        assert client.stats()["duplicates"] == 0


def test_a_pipeline_is_checked() -> None:
    from redbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="appears twice"):
        Pipeline("p", ["a", "a"])
    with pytest.raises(ConfigError, match="at least one stage"):
        Pipeline("p", [])
    with pytest.raises(ConfigError):
        Pipeline("bad name", ["a"])
    assert Pipeline.from_json(CALC.to_json()) == CALC



async def test_a_pipeline_stored_in_redis_is_served_and_shown_by_status(
        workers: Workers, redis_url: str, raw_redis: redis.Redis) -> None:
    """Declared in the registry alone (as ``redbatch up -c FILE`` does): the workers of
    its stages take it up; ``status`` shows each stage's queue and throughput."""
    from redbatch import status
    from redbatch.pipelines import status as pipeline_status
    from redbatch.pipelines.definition import publish_sync

    publish_sync(raw_redis, [CALC])
    workers.start([inc()])
    workers.start([dbl(Counted())])
    await wait_live(redis_url, "calc")
    async with Client(redis_url) as client:
        assert await client.predict_many("calc", list(range(40)), timeout_s=5) == [
            2 * (x + 1) for x in range(40)]
    snaps: list[Any] = []

    def counted() -> bool:  # the workers publish their counters with the heartbeat
        snaps.append(status.sample(raw_redis, 0.01))
        return snaps[-1]["inc"].items == snaps[-1]["dbl"].items == 40

    await until(counted, "both stages' counters published")
    snap = snaps[-1]
    (calc,) = pipeline_status.read(raw_redis, snap)
    assert [s.stage for s in calc.stages] == ["inc", "dbl"]
    assert all(s.live_workers == 1 and s.queue_depth == 0 and s.handoff_backlog == 0
               for s in calc.stages)
    assert snap["inc"].items == snap["dbl"].items == 40
    console = Console(record=True, width=200)
    console.print(pipeline_status.table([calc]))
    text = console.export_text()
    assert "1. inc" in text and "2. dbl" in text
    raw_redis.set(protocol.outbox_key("inc"), b"garbage")  # (it used to fail the whole read)
    (calc,) = pipeline_status.read(raw_redis, snap)
    assert [s.handoff_backlog for s in calc.stages] == [None, 0]
    console.print(pipeline_status.table([calc]))
    raw_redis.delete(protocol.outbox_key("inc"))


def test_the_configuration_file_declares_pipelines(tmp_path: Any) -> None:
    from redbatch import configfile
    from redbatch.errors import ConfigError

    path = tmp_path / "rb.toml"
    path.write_text("[[models]]\ntarget='redbatch.demo:models'\n"
                    "[[pipelines]]\nname='classify_text'\nstages=['tok', 'textcls']\n")
    assert configfile.load(path).pipelines == [Pipeline("classify_text", ["tok", "textcls"])]
    path.write_text("[[models]]\ntarget='redbatch.demo:models'\n"
                    "[[pipelines]]\nname='fan'\nstages=['inc', ['fa', 'fb'], 'mrg']\n")
    assert configfile.load(path).pipelines == [FAN]
    path.write_text("[[models]]\ntarget='redbatch.demo:models'\n"
                    "[[pipelines]]\nname='p'\nstages='tok'\n")
    with pytest.raises(ConfigError, match=r"pipelines\[0\]\.stages"):
        configfile.load(path)


@pytest.mark.e2e
@pytest.mark.timeout(60)
async def test_a_worker_killed_between_stages_loses_nothing(
        workers: Workers, redis_url: str, spawn: Any, raw_redis: redis.Redis) -> None:
    """A worker process dies in its hand-off (records taken, none handed on yet): once
    the lease of its records expires another worker of the stage hands them on.  Ledger
    over every request: one reply each, each right, the next stage computed once each."""
    import sys

    from tests.pipeline_models import DIE_ON

    proc = spawn([sys.executable, "-m", "tests.pipeline_models", redis_url], name="inc")
    await wait_live(redis_url, "calc")
    counted = Counted()
    inputs = [*range(200, 260), DIE_ON - 1]
    async with Client(redis_url) as client:
        first = await client.submit_many("calc", inputs[:30], timeout_s=40)
        for _ in range(300):  # let the doomed worker take the first ones alone
            if raw_redis.zcard(protocol.handoff_key("inc")) or proc.popen.poll() is not None:
                break
            await asyncio.sleep(0.02)
        rest = await client.submit_many("calc", inputs[30:], timeout_s=40)
        for _ in range(500):
            if proc.popen.poll() is not None:
                break
            await asyncio.sleep(0.02)
        assert proc.popen.returncode == 17, proc.log()  # it died in the hand-off
        workers.start([inc(), dbl(counted)])  # the survivors: the stage's other workers
        results = await asyncio.gather(*first, *rest)
        assert results == [2 * (x + 1) for x in inputs]
        assert counted.seen == {x + 1: 1 for x in inputs}  # the next stage: once each
        assert client.stats()["duplicates"] == 0
    for _ in range(100):  # the last records are marked done with the next take
        if not raw_redis.zcard(protocol.handoff_key("inc")):
            break
        await asyncio.sleep(0.05)
    assert raw_redis.zcard(protocol.handoff_key("inc")) == 0


@pytest.mark.engines
@pytest.mark.timeout(90)
async def test_a_pipeline_on_redis_cluster(workers: Workers, redis_cluster: Any) -> None:
    """Every step in one slot: the stages and the pipeline on different nodes."""
    from redbatch.redis_conn import sync_client

    settings = RedisSettings(redis_cluster.url, socket_timeout_s=3.0, connect_timeout_s=0.5)
    owners = {redis_cluster.owner(protocol.queue_key(n)).port for n in ("inc", "dbl", "calc")}
    assert len(owners) > 1  # the hand-offs cross nodes
    counted = Counted()
    workers.start([inc()], [CALC], settings)
    workers.start([dbl(counted)], None, settings)
    await wait_live(redis_cluster.url, "calc")
    async with Client(settings=settings) as client:
        assert await client.predict_many("calc", list(range(30)), timeout_s=20) == [
            2 * (x + 1) for x in range(30)]
        with pytest.raises(ModelError, match="stage 'inc' failed"):
            await client.predict("calc", -1, timeout_s=20)
    check = sync_client(settings)
    for _ in range(100):  # the last records are marked done with the next take
        if not check.zcard(protocol.handoff_key("inc")):
            break
        await asyncio.sleep(0.05)
    assert check.zcard(protocol.handoff_key("inc")) == 0
    check.close()


async def test_a_reply_list_of_another_type_costs_its_request_alone(
        workers: Workers, redis_url: str, raw_redis: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    from redbatch.pipelines.enter import enter

    workers.start([inc(), dbl(Counted())], [CALC])
    await wait_live(redis_url, "calc")
    bad, good = protocol.reply_key("calc", "bad"), protocol.reply_key("calc", "good")
    raw_redis.set(bad, "not a list")
    client = redis.asyncio.Redis.from_url(redis_url)
    link = LeanLink(client)
    deadline_ms = protocol.now_ms() + 10_000
    for request_id, reply_to in (("r-bad", bad), ("r-good", good)):
        await enter(link, ONE, CALC, request_id, 1, reply_to=reply_to, deadline_ms=deadline_ms)
    got = await asyncio.to_thread(raw_redis.blpop, [good], 10)
    assert got is not None
    assert protocol.reply_from_wire(codec.decode(got[1])).payload == 4
    for _ in range(100):
        if "could not hand on" in caplog.text:
            break
        await asyncio.sleep(0.05)
    assert "could not hand on" in caplog.text and "WRONGTYPE" in caplog.text
    for _ in range(100):  # marked done with the mover's next take: not retried for ever
        if not raw_redis.zcard(protocol.handoff_key("dbl")):
            break
        await asyncio.sleep(0.05)
    assert raw_redis.zcard(protocol.handoff_key("dbl")) == 0
    await link.release()
    await client.aclose()


def test_the_demo_tokenizer() -> None:
    from redbatch.pipelines.tokenizer import UNKNOWN_ID, token_ids

    ids = token_ids("Some words, some WORDS!")
    assert ids.dtype == np.int64 and len(ids) == 4 and ids[0] == ids[2] and ids[1] == ids[3]
    assert token_ids("...").tolist() == [UNKNOWN_ID]
    assert len(token_ids("w " * 2000)) == 512


def test_the_demo_tokenizer_reads_a_bounded_prefix_of_a_huge_text() -> None:
    """It runs on the worker's event loop: only the first ``MAX_TEXT_CHARS``
    characters are read (a 16 MiB text once held every model of the worker)."""
    from redbatch.pipelines.tokenizer import MAX_TEXT_CHARS, UNKNOWN_ID, token_ids

    assert token_ids(" " * MAX_TEXT_CHARS + "word " * 10).tolist() == [UNKNOWN_ID]
    assert len(token_ids("ab " * (MAX_TEXT_CHARS // 3) + "tail")) == 512
    assert token_ids("x" * 100 + " " * (MAX_TEXT_CHARS - 101) + "yz")[-1] == \
        token_ids("y")[0]  # a word cut at the bound counts as what was read of it


def test_the_demo_tokenizer_refuses_what_is_not_text() -> None:
    from redbatch.errors import InvalidPayload
    from redbatch.pipelines.tokenizer import tokenize

    with pytest.raises(InvalidPayload, match="must be a string"):
        tokenize(["fine", 3])


FAN = Pipeline("fan", ["inc", ["fa", "fb"], "mrg"])


def fa_fn(xs: list[int]) -> list[int]:
    return [10 * x for x in xs]


def fb_fn(xs: list[int]) -> list[int]:
    if 13 in xs:
        raise ValueError("no 13 on this branch")
    return [x + 100 for x in xs]


async def test_a_fan_out_and_its_merge(workers: Workers, redis_url: str,
                                       raw_redis: redis.Redis) -> None:
    """``inc`` feeds ``fa`` and ``fb`` side by side; ``mrg`` gets both outputs, by
    branch; a branch's error names that branch."""
    merged: list[dict[str, int]] = []

    def mrg_fn(parts: list[dict[str, int]]) -> list[int]:
        merged.extend(parts)
        return [p["fa"] + p["fb"] for p in parts]

    workers.start([inc(), Model("mrg", fn=mrg_fn, policy=POLICY, inline=True)], [FAN])
    workers.start([Model("fa", fn=fa_fn, policy=POLICY, inline=True),
                   Model("fb", fn=fb_fn, policy=POLICY, inline=True)])
    await wait_live(redis_url, "fan")
    async with Client(redis_url) as client:
        assert await client.predict("fan", 1, timeout_s=5) == 20 + 102
        assert await client.predict_many("fan", list(range(20, 40)), timeout_s=5) == [
            10 * (x + 1) + x + 101 for x in range(20, 40)]
        with pytest.raises(ModelError, match=r"stage 'fb' failed: .*no 13"):
            await client.predict("fan", 12, timeout_s=5)
    assert len(merged) == 21 and {"fa", "fb"} == set(merged[0])  # once per request
    listing = raw_redis.hget(protocol.PIPELINES_KEY, "fan")
    assert Pipeline.from_json(listing) == FAN


async def test_a_merge_part_sent_twice_is_kept_once(raw_redis: redis.Redis) -> None:
    from redbatch import lua

    key = protocol.parts_key("mrg", "r1")
    part = lua.HANDOFF_PART
    assert raw_redis.eval(part, 1, key, "fa", b"A", 2, 5000) == []
    assert raw_redis.eval(part, 1, key, "fa", b"A2", 2, 5000) == []  # sent again: no change
    assert raw_redis.eval(part, 1, key, "fb", b"B", 2, 5000) == [b"fa", b"A", b"fb", b"B"]
    assert 0 < raw_redis.pttl(key) <= 5000


def test_a_fan_out_is_checked() -> None:
    from redbatch.errors import ConfigError

    assert FAN.models == ("inc", "fa", "fb", "mrg") and FAN.last == "mrg"
    for stages in (["a", ["b", "c"]], [["b", "c"], "d"], ["a", ["b"], "d"],
                   ["a", ["b", "c"], ["d", "e"], "f"]):
        with pytest.raises(ConfigError, match="fan-out"):
            Pipeline("p", stages)


async def test_a_fan_out_whose_movers_died_merges_once(
        workers: Workers, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Branch sends, parts and merge inputs sent again after the movers died between
    their two steps: the merge stage still runs once per request."""
    died = dying_movers(monkeypatch, deaths=6)
    merged = Counted()

    def mrg_fn(parts: list[dict[str, int]]) -> list[int]:
        return merged([p["fa"] + p["fb"] for p in parts])

    workers.start([inc(), Model("mrg", fn=mrg_fn, policy=POLICY, inline=True),
                   Model("fa", fn=fa_fn, policy=POLICY, inline=True),
                   Model("fb", fn=fb_fn, policy=POLICY, inline=True)], [FAN])
    await wait_live(redis_url, "fan")
    inputs = list(range(20, 60))
    async with Client(redis_url) as client:
        results = await client.predict_many("fan", inputs, timeout_s=15)
        assert results == [2 * (10 * (x + 1) + x + 101) for x in inputs]
        assert len(died) == 6
        assert merged.seen == {10 * (x + 1) + x + 101: 1 for x in inputs}
        assert client.stats()["duplicates"] == 0


async def test_a_stage_reply_waits_in_its_outbox_past_its_deadline(
        workers: Workers, redis_url: str, raw_redis: redis.Redis) -> None:
    """A stage's reply to a request of a long deadline, with no hand-off running yet
    (no pipeline known): its outbox keeps it at least until that deadline."""
    workers.start([inc()])
    await wait_live(redis_url, "inc")
    client = redis.asyncio.Redis.from_url(redis_url)
    link = LeanLink(client)
    deadline_ms = protocol.now_ms() + round(protocol.MAX_TIMEOUT_S * 1000) - 1000
    ctx = Context("calc", ["dbl"], protocol.reply_key("calc", "c1"), deadline_ms,
                  protocol.now_ms())
    assert await handoff.send(link, ONE, "inc", "long-1", 3, ctx)
    outbox = protocol.outbox_key("inc")
    for _ in range(200):
        if raw_redis.llen(outbox):
            break
        await asyncio.sleep(0.02)
    assert raw_redis.llen(outbox) == 1
    assert raw_redis.pttl(outbox) >= deadline_ms - protocol.now_ms()
    await link.release()
    await client.aclose()


def fan_models() -> list[Model]:
    return [inc(), Model("mrg", fn=lambda parts: [p["fa"] + p["fb"] for p in parts],
                         policy=POLICY, inline=True),
            Model("fa", fn=fa_fn, policy=POLICY, inline=True),
            Model("fb", fn=fb_fn, policy=POLICY, inline=True)]


async def test_a_fan_out_takes_rows_and_its_reply_times_every_branch(
        workers: Workers, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-row request (as v2 infer sends) merges row by row into a merge model
    without a spec; the final reply's stages hold both branches, in order."""
    from redbatch.producer import listener

    stages: list[list[str]] = []
    dispatch = listener.ReplyListener.dispatch

    def spy(self: listener.ReplyListener, raw: bytes) -> Any:
        stages.append([s["stage"] for s in codec.decode(raw).get(protocol.F_STAGES, [])])
        return dispatch(self, raw)

    monkeypatch.setattr(listener.ReplyListener, "dispatch", spy)
    workers.start(fan_models(), [FAN])
    await wait_live(redis_url, "fan")
    async with Client(redis_url) as client:
        assert await client.predict("fan", 1, timeout_s=5) == 20 + 102
        (rows,) = await client.submit_many("fan", [[1, 2]], timeout_s=5, batched=True)
        assert [int(x) for x in await rows] == [122, 133]
    assert stages[0] == ["inc", "fa", "fb", "mrg"]
    app = create_app(GatewayConfig(), RedisSettings(redis_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        body = {"inputs": [{"name": "inputs", "shape": [2], "datatype": "INT64",
                            "data": [1, 2]}]}
        resp = await http.post("/v2/models/fan/infer", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][0]["data"] == [122, 133]


def test_a_streaming_model_is_no_stage() -> None:
    from redbatch.errors import ConfigError
    from redbatch.pipelines.duty import check_declared
    from tests.stream_models import counter

    with pytest.raises(ConfigError, match="'counter' is a streaming model"):
        check_declared([Pipeline("p", ["inc", "counter"])], [inc(), counter()])


async def test_a_streaming_stage_served_elsewhere_fails_its_request_clearly(
        workers: Workers, redis_url: str) -> None:
    """Declared where the streaming stage is not served, the pipeline cannot be refused:
    the stage's first chunk fails each request (``config_error``), with no hang."""
    from redbatch.errors import ConfigError
    from tests.stream_models import counter

    workers.start([Model("ident", fn=lambda xs: xs, policy=POLICY, inline=True)],
                  [Pipeline("pstream", ["ident", "counter"])])
    workers.start([counter()])
    await wait_live(redis_url, "pstream")
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        with pytest.raises(ConfigError, match=r"stage 'counter' failed: .*streaming model"):
            await client.predict("pstream", {"n": 3}, timeout_s=5)
        with pytest.raises(InvalidPayload, match="is a pipeline"):
            await client.stream("pstream", {"n": 3}, 5).open()


def test_a_fan_out_is_at_most_64_wide_and_so_is_a_map_of_rows() -> None:
    from redbatch.errors import ConfigError
    from redbatch.worker.decode import decode_batch

    Pipeline("wide", ["a", [f"b{i}" for i in range(64)], "c"])
    with pytest.raises(ConfigError, match="2 to 64 stages"):
        Pipeline("wide", ["a", [f"b{i}" for i in range(65)], "c"])
    plain = Model("plain", fn=lambda xs: xs, policy=POLICY)
    now = protocol.now_ms()
    for names, ok in ((64, True), (65, False)):
        payload = {f"n{i}": [i, i] for i in range(names)}
        request = protocol.Request("r1", "plain", now, now + 5000, "rb:reply:{plain}:c",
                                   payload, rows=2)
        decoded = decode_batch([codec.encode(request.to_wire())], plain, now)
        assert (len(decoded.items), len(decoded.early)) == ((2, 0) if ok else (0, 1))


def pair_fn(xs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"lo": x["x"], "hi": 10 * x["x"]} for x in xs]


def mixed_models() -> list[Model]:
    """``wrap`` (one input, answers maps) then ``pair`` (named input ``x``, named outputs
    ``lo`` and ``hi``); ``pair`` then ``add`` (one input, one output)."""
    return [Model("wrap", fn=lambda xs: [{"x": x} for x in xs], policy=POLICY, inline=True),
            Model("pair", fn=pair_fn, policy=POLICY, inline=True, inputs={"x": None},
                  outputs=["lo", "hi"]),
            Model("add", fn=lambda xs: [x["lo"] + x["hi"] for x in xs], policy=POLICY,
                  inline=True)]


async def v2_names(http: httpx.AsyncClient, name: str, want: list[list[str]]
                   ) -> list[list[str]]:
    """The names of a model's v2 inputs and outputs, once they are ``want`` (a
    pipeline's outputs are known once its last stage has published its own), or after
    5 s."""
    got: list[list[str]] = []
    for _ in range(50):
        meta = (await http.get(f"/v2/models/{name}")).json()
        got = [[t["name"] for t in meta.get(kind, [])] for kind in ("inputs", "outputs")]
        if got == want:
            break
        await asyncio.sleep(0.1)
    return got


async def test_a_pipeline_of_one_input_and_named_outputs_and_the_reverse_over_v2(
        workers: Workers, redis_url: str) -> None:
    """A pipeline takes its first stage's inputs and answers its last stage's outputs,
    named or not: rows hand on as a list of maps, and v2 describes and answers each
    end as it is (before: a 500 for one, a 404 for the other)."""
    workers.start(mixed_models(), [Pipeline("mix_in", ["wrap", "pair"]),
                                   Pipeline("mix_out", ["pair", "add"])])
    await wait_live(redis_url, "mix_in")
    await wait_live(redis_url, "mix_out")
    app = create_app(GatewayConfig(), RedisSettings(redis_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as http:
        for name, want in (("mix_in", [["inputs"], ["lo", "hi"]]),
                           ("mix_out", [["x"], ["outputs"]])):
            assert await v2_names(http, name, want) == want
        config = (await http.get("/v2/models/mix_in/config")).json()
        assert [t["name"] for t in config["output"]] == ["lo", "hi"]
        resp = await http.post("/v2/models/mix_in/infer", json={
            "inputs": [{"name": "inputs", "shape": [2], "datatype": "INT64", "data": [1, 2]}],
            "outputs": [{"name": "hi"}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["outputs"] == [{"name": "hi", "datatype": "INT64", "shape": [2],
                                           "data": [10, 20]}]
        resp = await http.post("/v2/models/mix_out/infer", json={
            "inputs": [{"name": "x", "shape": [2], "datatype": "INT64", "data": [1, 2]}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["outputs"][0]["data"] == [11, 22]
        unknown = await http.post("/v2/models/mix_in/infer", json={
            "inputs": [{"name": "inputs", "shape": [1], "datatype": "INT64", "data": [1]}],
            "outputs": [{"name": "outputs"}]})
        assert unknown.status_code == 400 and "['lo', 'hi']" in unknown.text
        v1 = await http.post("/v1/models/mix_out/predict", json={"inputs": {"x": 3}})
        assert v1.json() == {"outputs": 33}


def test_a_pipeline_of_named_inputs_ending_in_any_output_name_is_read() -> None:
    """A model's one output may have any name (no field-name rule): a pipeline whose
    first stage has named inputs and whose last stage's output is ``probs/0`` is read
    as such, not as broken metadata (a 404 for every call)."""
    from redbatch.spec import ModelInfo

    info = ModelInfo.from_meta({"name": "p", "inputs": {"x": None},
                                "output_name": "probs/0", "kind": "pipeline"})
    assert info.signature is not None and list(info.signature.inputs) == ["x"]
    assert info.named_outputs is None and list(info.output_specs) == ["probs/0"]
