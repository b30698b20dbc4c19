"""Streaming models and model versions on a real Redis Cluster (3 primaries, 3
replicas), end to end through the Python client and the gateway: the right chunks and
the right version answering, a worker that dies mid-stream reaped by another, and every
key they write in its model's slot (the multi-key scripts of a stream's steps, its
cancel, a dead worker's reap, a version's registration, a traffic change and a drain
never CROSSSLOT).  ``test_streaming`` and ``test_versions`` cover the
same features on a plain Redis."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import orjson
import pytest

from redbatch import Model, protocol
from redbatch.config import RedisSettings
from redbatch.errors import NoLiveWorkers, RedbatchError, UnknownModel, WorkerCrashed
from redbatch.generate import generate_model
from redbatch.producer.client import Client
from redbatch.producer.sync import SyncClient
from redbatch.worker import stream as worker_stream
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.stream_batch import StreamBatch
from tests import stream_models
from tests.conftest import FAST_WORKER, until, wait_live
from tests.engines import ClusterEngine, Node
from tests.stream_models import counter, counting
from tests.test_gateway import gateway
from tests.test_streaming import _sse
from tests.test_versions import streams_go_to_version_2

pytestmark = [pytest.mark.engines, pytest.mark.serial, pytest.mark.timeout(90)]
# "vx", "vx@1" and "vx@2" hash to slots on three different primaries: a version's
# keys, and its model's table, are each on a node of their own
VERSIONED = "vx"
VERSION_TAGS = {VERSIONED, f"{VERSIONED}@1", f"{VERSIONED}@2"}


@pytest.fixture
def settings(redis_cluster: ClusterEngine) -> RedisSettings:
    return RedisSettings(redis_cluster.url, socket_timeout_s=3.0, connect_timeout_s=0.5)


@pytest.fixture(autouse=True)
def _fresh_steps() -> Iterator[None]:
    stream_models.reset()
    yield
    stream_models.reset()


# --- what the cluster saw -------------------------------------------------------------
def cluster_keys(redis_cluster: ClusterEngine) -> dict[str, Node]:
    """Every key on the cluster, and the primary that holds it."""
    keys: dict[str, Node] = {}
    for node in redis_cluster.primaries():
        with node.client() as client:
            keys.update({key.decode(): node for key in client.scan_iter(count=1000)})
    return keys


def errors_of(node: Node) -> dict[str, int]:
    """The error replies ``node`` has sent, by kind (``INFO errorstats``)."""
    return {kind.removeprefix("errorstat_"): int(stats["count"])
            for kind, stats in node.ask("INFO", "errorstats").items()}


# no slot moves in these tests: no command is refused or redirected, not even a fresh
# client's first (``redis_conn.SlotMappedCluster`` reads the slot map before it)
SLOT_ERRORS = ("CROSSSLOT", "ASK", "TRYAGAIN", "MOVED")
CROSS_SLOT_TEXT = ("CROSSSLOT", "same key slot", "same slot")  # the server's, redis-py's


def check_slots(redis_cluster: ClusterEngine, tags: set[str]) -> dict[str, Node]:
    """Every key written carries one of ``tags`` (the models' hash tags; the model
    directory ``rb:models``, one key on its own, aside), and no node refused a
    multi-key command or script for keys in several slots (``CROSSSLOT``) or
    redirected one (``ASK``, ``TRYAGAIN``, ``MOVED``).  Every key, and the primary that holds it."""
    keys = cluster_keys(redis_cluster)
    untagged = sorted(k for k in keys if k != protocol.MODELS_KEY
                      and protocol.hash_tag(k) not in tags)
    assert not untagged, f"keys outside the models' slots: {untagged}"
    refused = {n.address: {k: c for k, c in errors_of(n).items() if k in SLOT_ERRORS}
               for n in redis_cluster.live()}
    assert not any(refused.values()), refused
    return keys


@pytest.fixture(autouse=True)
def _no_cross_slot_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No call refused for keys in several slots, by a node or by redis-py itself
    (which refuses a script or transaction whose keys span slots before sending it),
    logged by a worker, the gateway or a client that went on."""
    yield
    logged = [r.getMessage() for r in caplog.records
              if any(text in r.getMessage() or text in (r.exc_text or "")
                     for text in CROSS_SLOT_TEXT)]
    assert not logged, logged


def owner_of(redis_cluster: ClusterEngine, tag: str) -> Node:
    return redis_cluster.owner(f"{{{tag}}}")


# --- streaming models -----------------------------------------------------------------
async def test_concurrent_streams_step_together_and_answer_in_the_models_slot(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker]) -> None:
    """Six streams over a counter of batches of 4: each one's chunks numbered in
    order, none duplicated, some steps of several members (one step script over
    their markers and reply lists); each marker done, nothing left in flight."""
    start_worker([counter(size=4)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "counter")
    async with Client(settings=settings) as client:
        async def one(i: int) -> tuple[str, list[Any]]:
            stream = client.stream("counter", {"n": 3 + i, "tag": f"s{i}-"}, 10, chunks=True)
            chunks = [chunk async for chunk in stream]
            return stream.request_id, chunks

        ran = await asyncio.gather(*(one(i) for i in range(6)))
        for i, (_id, chunks) in enumerate(ran):
            assert [c.seq for c in chunks] == list(range(3 + i))
            assert [c.payload for c in chunks] == [f"s{i}-{j}" for j in range(3 + i)]
        assert client.stats()["duplicates"] == 0
        reply_to = client.reply_to("counter")
    assert max(len(keys) for keys in stream_models.STEPS) > 1, "no step of several streams"
    owner = owner_of(redis_cluster, "counter")
    for request_id, _chunks in ran:
        assert owner.ask("GET", protocol.request_key("counter", request_id)) == b"d"
    keys = check_slots(redis_cluster, {"counter"})
    assert all(keys[k] is owner for k in keys if k != protocol.MODELS_KEY)
    assert not [k for k in keys if k.startswith(protocol.inflight_key("counter", ""))
                and owner.ask("LLEN", k)]
    assert not owner.ask("LLEN", reply_to)  # every chunk taken


async def test_closing_a_stream_cancels_it_on_the_models_node(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream closed after two chunks is marked cancelled in the model's slot; its
    worker drops it at the next step (its marker done, no more steps of it) while a
    stream beside it runs to its end."""
    monkeypatch.setattr(stream_models, "STEP_S", 0.02)
    start_worker([counter(size=4)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "counter")
    owner = owner_of(redis_cluster, "counter")
    async with Client(settings=settings) as client:
        stream = client.stream("counter", {"n": 10_000}, 20)
        beside = asyncio.create_task(_collected(client.stream("counter", {"n": 40, "tag": "b"},
                                                              20)))
        assert [await anext(stream), await anext(stream)] == ["0", "1"]
        await stream.aclose()
        marker = protocol.request_key("counter", stream.request_id)
        await until(lambda: owner.ask("GET", marker) == b"d", "the cancelled stream dropped")
        steps = sum(stream.request_id in keys for keys in stream_models.STEPS)
        assert await beside == [f"b{i}" for i in range(40)]
        assert sum(stream.request_id in keys for keys in stream_models.STEPS) == steps
        cancelled = owner.ask("ZRANGE", protocol.cancelled_key("counter"), 0, -1)
        assert stream.request_id.encode() in cancelled
    check_slots(redis_cluster, {"counter"})


async def _collected(stream: AsyncIterator[Any]) -> list[Any]:
    return [chunk async for chunk in stream]


def stalling(stalled: threading.Event, release: threading.Event
             ) -> Callable[[StreamBatch], Iterator[list[Any]]]:
    """``counting``, but the step that finds a member tagged ``late`` in its batch
    waits (``stalled`` set) until ``release``, then returns: the worker is killed while
    that step runs, the late member claimed and joined but sent nothing."""
    def stall(batch: StreamBatch) -> Iterator[list[Any]]:
        steps = counting(batch)
        while not any(value.get("tag") == "late" for value in batch):
            items = next(steps, None)
            if items is None:
                return
            yield items
        stalled.set()
        release.wait(10)

    return stall


async def _ledger(stream: AsyncIterator[Any]) -> tuple[list[tuple[int, Any]], str | None]:
    """A stream's chunks (number, payload) as they came, and the code it ended with."""
    chunks: list[tuple[int, Any]] = []
    try:
        async for chunk in stream:
            chunks.append((chunk.seq, chunk.payload))
    except RedbatchError as exc:
        return chunks, exc.code
    return chunks, None


async def test_a_worker_killed_mid_stream_is_reaped_in_the_models_slot(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker dies (its task cancelled: no reply, no return of its batch, its lease
    left to expire) with four streams past their second chunk, a fifth claimed and
    joined but not started, two more queued.  A second worker reaps it: each started
    stream ends with ``worker_crashed`` after exactly the chunks it had (numbered from
    0 without a gap, none twice: the client fails a final numbered anything but next);
    the claimed one goes back to the queue, a suspect run alone, and streams whole, as
    do the two queued; each by its deadline.  Every key of the recovery (the election,
    the REAP script over the in-flight list, the queue, the markers and reply list, the
    suspect's crashing key) is in the model's slot; nothing left in flight or
    dead-lettered."""
    monkeypatch.setattr(stream_models, "STEP_S", 0.02)
    monkeypatch.setattr(worker_stream, "STEP_GRACE_S", 0.2)  # the dead step's close
    caplog.set_level("WARNING", "redbatch.reaper")
    stalled, release = threading.Event(), threading.Event()
    doomed = Worker([Model("counter", fn=stalling(stalled, release),
                           policy=stream_models.policy(5))], settings, FAST_WORKER)
    task = asyncio.create_task(doomed.run(asyncio.Event()))  # never stopped: killed
    owner = owner_of(redis_cluster, "counter")
    try:
        await wait_live(settings.url, "counter")
        async with Client(settings=settings) as client:
            def open_(tag: str, n: int) -> Any:
                return client.stream("counter", {"n": n, "tag": tag}, 20, chunks=True)

            started = [open_(f"s{i}-", 10_000) for i in range(4)]
            await asyncio.gather(*(s.open() for s in started))
            for stream in started:  # each one under way
                assert [(await anext(stream)).seq for _ in range(2)] == [0, 1]
            late = open_("late", 3)
            await late.open()  # the next step claims it: that step never ends
            assert await asyncio.to_thread(stalled.wait, 10), "the late one never joined"
            queued = [open_(f"q{i}-", 3) for i in range(2)]
            await asyncio.gather(*(q.open() for q in queued))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            inflight = protocol.inflight_key("counter", doomed.worker_id)
            assert late.request_id.encode() in b"".join(owner.ask("LRANGE", inflight, 0, -1))
            assert owner.ask("GET", protocol.request_key("counter", late.request_id)) == b"q"
            survivor = start_worker([counter(size=5)], url=settings.url, config=FAST_WORKER)
            ended = await asyncio.wait_for(asyncio.gather(
                *(_ledger(s) for s in (*started, late, *queued))), 15)
            assert client.stats()["duplicates"] == 0
    finally:
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for i, (chunks, code) in enumerate(ended[:4]):
        assert code == WorkerCrashed.code  # after the chunks it had: 0, 1, then these
        assert chunks == [(j, f"s{i}-{j}") for j in range(2, 2 + len(chunks))]
    assert ended[4:] == [([(j, f"{tag}{j}") for j in range(3)], None)
                         for tag in ("late", "q0-", "q1-")]
    alone = [keys for keys in stream_models.STEPS if late.request_id in keys]
    assert alone and all(keys == [late.request_id] for keys in alone)  # a suspect
    reaped = [r.getMessage() for r in caplog.records if "reaped worker" in r.getMessage()]
    assert reaped == [f"model=counter reaped worker {doomed.worker_id}: requeued 1, "
                      "dead-lettered 0"]
    crashing = protocol.crashing_key("counter", survivor.worker_id)  # named while it ran
    await until(lambda: not owner.ask("EXISTS", crashing), "the suspect's pass over", 5)
    keys = check_slots(redis_cluster, {"counter"})
    assert all(keys[k] is owner for k in keys if k != protocol.MODELS_KEY)
    assert inflight not in keys and not [k for k in keys if k.startswith(
        protocol.inflight_key("counter", "")) and owner.ask("LLEN", k)]
    assert owner.ask("ZSCORE", protocol.workers_key("counter"), doomed.worker_id) is None
    assert protocol.dead_letter_key("counter") not in keys
    assert not [k for k in keys if k.startswith(protocol.reaping_key("counter", ""))
                or k.startswith(protocol.crashing_key("counter", ""))]
    for stream in (*started, late, *queued):
        assert owner.ask("GET", protocol.request_key("counter", stream.request_id)) == b"d"


async def test_http_sse_ndjson_and_v2_generate_on_a_cluster(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker]) -> None:
    """The gateway streams a model's chunks as SSE and NDJSON, and over Triton's
    ``generate_stream`` and ``generate``, all the same text; a model error before the
    first chunk is a 500, after it the last event."""
    start_worker([generate_model(max_batch_size=8), counter()], url=settings.url,
                 config=FAST_WORKER)
    await wait_live(settings.url, "generate")
    await wait_live(settings.url, "counter")
    body = {"prompt": "hello", "max_tokens": 6}
    async with gateway(settings) as http:
        sse = await http.post("/v1/models/generate/predict", json=body,
                              headers={"accept": "text/event-stream"})
        assert sse.status_code == 200, sse.text
        events = _sse(sse.text)
        assert [e["seq"] for e in events[:-1]] == list(range(6))
        assert events[-1]["last"] is True and events[-1]["timings"]["steps"] == 7
        text = "".join(e["text"] for e in events[:-1])
        assert len(text) == 6
        nd = await http.post("/v1/models/generate/predict", json=body)
        assert nd.headers["content-type"].startswith("application/x-ndjson")
        lines = [orjson.loads(line) for line in nd.text.splitlines()]
        assert "".join(e["text"] for e in lines[:-1]) == text  # seeded, greedy
        v2 = await http.post("/v2/models/generate/generate_stream",
                             json={"text_input": "hello", "max_tokens": 6})
        assert v2.status_code == 200, v2.text
        assert "".join(e["text_output"] for e in _sse(v2.text)) == text
        whole = await http.post("/v2/models/generate/generate",
                                json={"text_input": "hello", "parameters": {"max_tokens": 6}})
        assert whole.status_code == 200 and whole.json()["text_output"] == text
        failed = await http.post("/v1/models/counter/predict", json={"n": 3, "fail": 0})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_error"
        late = await http.post("/v1/models/counter/predict", json={"n": 3, "fail": 1})
        assert late.status_code == 200
        assert [orjson.loads(x).get("error", {}).get("code") for x in late.text.splitlines()] \
            == [None, "model_error"]
    check_slots(redis_cluster, {"generate", "counter"})


async def test_a_streaming_model_in_versions_streams_from_its_versions_slot(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker]) -> None:
    """A streaming model served as version 2 only: unpinned, pinned and by its served
    name the client's stream goes to ``gen@2`` (its queue and reply list in that
    slot; the table in ``gen``'s, on another node), and so do the gateway's v1
    predict and Triton's generate routes, which name the version."""
    from tests.stream_models import counting, policy

    assert owner_of(redis_cluster, "gen") is not owner_of(redis_cluster, "gen@2")
    start_worker([Model("gen", fn=counting, policy=policy(4, 0.002), version="2")],
                 url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "gen@2")
    ask = {"n": 3, "tag": "t"}
    async with Client(settings=settings) as client:
        assert await streams_go_to_version_2(client, ask, 5.0) == ["t0", "t1", "t2"]
    async with gateway(settings) as http:
        resp = await http.post("/v1/models/gen/predict", json=ask)
        assert resp.status_code == 200 and resp.headers["x-redbatch-version"] == "2"
        lines = [orjson.loads(line) for line in resp.text.splitlines()]
        assert [e.get("outputs") for e in lines[:-1]] == ["t0", "t1", "t2"], lines
        resp = await http.post("/v2/models/gen/versions/2/generate", json=ask)
        assert resp.status_code == 200, resp.text
        assert (resp.json()["model_name"], resp.json()["model_version"]) == ("gen", "2")
        resp = await http.post("/v2/models/gen/versions/2/generate_stream", json=ask)
        assert resp.status_code == 200 and '"model_version":"2"' in resp.text
        assert [e["text_output"] for e in _sse(resp.text)] == ["t0", "t1", "t2", ""]
    keys = check_slots(redis_cluster, {"gen", "gen@2"})
    assert keys[protocol.versions_key("gen")] is owner_of(redis_cluster, "gen")
    assert keys[protocol.meta_key("gen@2")] is owner_of(redis_cluster, "gen@2")


# --- model versions -------------------------------------------------------------------
def adder(step: int) -> Callable[[list[int]], Any]:
    async def add(xs: list[int]) -> list[int]:
        return [x + step for x in xs]

    return add


def version(number: int) -> Model:
    return Model(VERSIONED, fn=adder(100 * number), version=str(number),
                 policy=BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0.002))


@pytest.fixture
async def two(redis_cluster: ClusterEngine, settings: RedisSettings,
              start_worker: Callable[..., Worker]) -> AsyncIterator[Client]:
    """Versions 1 and 2 of ``vx``, each on its own worker (version 2 registers second:
    a canary), and a client."""
    assert len({owner_of(redis_cluster, t).port for t in VERSION_TAGS}) == 3
    start_worker([version(1)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, f"{VERSIONED}@1")
    start_worker([version(2)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, f"{VERSIONED}@2")
    async with Client(settings=settings) as client:
        yield client


async def test_two_versions_side_by_side_pinned_and_latest(
        redis_cluster: ClusterEngine, two: Client) -> None:
    assert await two.predict(VERSIONED, 1, version="1") == 101
    assert await two.predict(VERSIONED, 1, version="2") == 201
    assert set(await asyncio.gather(*(two.predict(VERSIONED, 1) for _ in range(20)))) \
        == {101}  # version 2 came as a canary: weight 0
    assert await two.predict(f"{VERSIONED}@2", 1) == 201  # a served name
    assert await two.predict_many(VERSIONED, [1, 2, 3], version="2") == [201, 202, 203]
    with pytest.raises(UnknownModel, match="no version '3'"):
        await two.predict(VERSIONED, 1, version="3")
    sync = SyncClient(settings=two.settings)
    try:
        assert await asyncio.to_thread(sync.predict_many, VERSIONED, [1, 2], 5.0,
                                       version="2") == [201, 202]
    finally:
        await asyncio.to_thread(sync.close)
    shown = await two.versions(VERSIONED)
    assert [(r["version"], r["name"], r["latest"], r["live_workers"])
            for r in shown["versions"]] == [("1", "vx@1", True, 1), ("2", "vx@2", False, 1)]
    keys = check_slots(redis_cluster, VERSION_TAGS)
    table = protocol.versions_key(VERSIONED)
    assert keys[table] is owner_of(redis_cluster, VERSIONED)
    assert set(owner_of(redis_cluster, VERSIONED).ask("HKEYS", table)) >= {b"1", b"2"}
    for number in ("1", "2"):
        tag = f"{VERSIONED}@{number}"
        assert keys[protocol.workers_key(tag)] is owner_of(redis_cluster, tag)


async def _answers_become(client: Client, expected: set[int]) -> None:
    """Within 3 s of a change, 40 requests (each routed on its own) answer from
    ``expected`` only."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3.0
    while True:
        answers = set(await asyncio.gather(*(client.predict(VERSIONED, 1)
                                             for _ in range(40))))
        if answers == expected:
            return
        assert loop.time() < deadline, f"still {answers}, want {expected}"
        await asyncio.sleep(0.1)


async def test_weights_and_promotion_change_live(redis_cluster: ClusterEngine,
                                                 two: Client) -> None:
    await two.versions(VERSIONED, weights={"1": 0, "2": 100})
    await _answers_become(two, {201})
    await two.versions(VERSIONED, weights={"1": 50, "2": 50})
    await _answers_become(two, {101, 201})
    shown = await two.versions(VERSIONED, weights={"1": 0, "2": 0}, latest="1")
    assert [(r["version"], r["share"], r["latest"]) for r in shown["versions"]] == \
        [("1", 1.0, True), ("2", 0.0, False)]
    await _answers_become(two, {101})  # no weight above 0: the pinned latest alone
    check_slots(redis_cluster, VERSION_TAGS)


async def test_http_v1_and_v2_pinned_versions(redis_cluster: ClusterEngine,
                                              settings: RedisSettings, two: Client) -> None:
    await two.versions(VERSIONED, latest="2", weights={"1": 0, "2": 100})
    async with gateway(settings) as http:
        resp = await http.post("/v1/models/vx/versions/1/predict", json={"inputs": 5})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"outputs": 105} and resp.headers["x-redbatch-version"] == "1"
        resp = await http.post("/v1/models/vx/predict", json={"inputs": 5})
        assert resp.json() == {"outputs": 205} and resp.headers["x-redbatch-version"] == "2"
        resp = await http.post("/v1/models/vx/versions/7/predict", json={"inputs": 5})
        assert resp.status_code == 404 and "no version '7'" in resp.json()["error"]["message"]
        body = {"inputs": [{"name": "inputs", "datatype": "INT64", "shape": [1], "data": [7]}]}
        resp = await http.post("/v2/models/vx/versions/1/infer", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["outputs"][0]["data"] == [107]
        assert resp.json()["model_version"] == "1"
        listing = await http.get("/v1/models/vx/versions")
        assert listing.status_code == 200, listing.text
        assert [(r["version"], r["live_workers"]) for r in listing.json()["versions"]] == \
            [("1", 1), ("2", 1)]
        models = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
        assert [(r["version"], r["name"]) for r in models[VERSIONED]["versions"]] == \
            [("1", "vx@1"), ("2", "vx@2")]
        assert models[VERSIONED]["live_workers"] == 2
    check_slots(redis_cluster, VERSION_TAGS)


async def test_a_drained_version_stops_and_refuses_late_pushes(
        redis_cluster: ClusterEngine, settings: RedisSettings,
        start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """Draining version 1 closes its queue in one step on its node (its queue, its
    in-flight lists and its closed marker: one script), its worker stops, a late
    push to it is refused with nothing left queued, and version 2 serves on."""
    from redbatch import defaults

    monkeypatch.setattr(defaults, "DRAIN_SETTLE_S", 0.3)
    old = start_worker([version(1)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "vx@1")
    start_worker([version(2)], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "vx@2")
    async with Client(settings=settings) as client:
        assert await client.predict(VERSIONED, 1, version="1") == 101
        await client.versions(VERSIONED, drain="1")
        await until(lambda: old.drained, "the drained worker stopped", 10)
    owner = owner_of(redis_cluster, "vx@1")
    assert owner.ask("EXISTS", protocol.closed_key("vx@1")) == 1
    async with Client(settings=settings, require_workers=False) as late:
        with pytest.raises(NoLiveWorkers, match="no live worker"):  # by the enqueue
            await late.predict("vx@1", 1, 2.0)
        assert owner.ask("LLEN", protocol.queue_key("vx@1")) == 0  # nothing left behind
        assert await late.predict("vx@2", 1, 2.0) == 201
    check_slots(redis_cluster, VERSION_TAGS)


async def test_the_eviction_check_asks_every_primary(redis_cluster: ClusterEngine,
                                                     settings: RedisSettings) -> None:
    """A cluster client sends CONFIG GET to one node: another primary that may evict
    went unwarned."""
    from redbatch.checks import _maxmemory, eviction_warning
    from redbatch.redis_conn import async_client

    risky = redis_cluster.owner("{evict-me}")
    risky.ask("CONFIG", "SET", "maxmemory", "100mb")
    risky.ask("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    client = async_client(settings)
    try:
        assert len(await _maxmemory(client)) == 3  # one answer per primary
        warning = await eviction_warning(client)
        assert warning is not None and "allkeys-lru" in warning
    finally:
        await client.aclose()
