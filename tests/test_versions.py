"""Model versions and canaries (redbatch.versions): versions served side by side,
pinned and weighted routing over v1, v2 and the client, live weight changes,
draining, and the listing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from redbatch import (
    Client,
    ConfigError,
    Model,
    batch,
    configfile,
    defaults,
    lua,
    protocol,
    versions,
)
from redbatch.cli import main
from redbatch.errors import BadRequest, NoLiveWorkers, UnknownModel
from redbatch.producer import SyncClient
from redbatch.versions import Table, Version
from redbatch.worker import drain, heartbeat
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.test_gateway import gateway

pytestmark = pytest.mark.timeout(60)

MODEL = "vm"


def adder(step: int, delay_s: float = 0.0) -> Callable[[list[int]], list[int]]:
    """A version's batch function: adds ``step`` (the version tells itself apart)."""
    async def add(xs: list[int]) -> list[int]:
        if delay_s:
            await asyncio.sleep(delay_s)
        return [x + step for x in xs]

    return add


def version(number: int, delay_s: float = 0.0) -> Model:
    return Model(MODEL, fn=adder(100 * number, delay_s), version=str(number),
                 policy=BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0.002))


async def _served(url: str, *names: str) -> None:
    for name in names:
        await wait_live(url, name)


@pytest.fixture
async def two(start_worker: Callable[..., Worker], redis_url: str) -> AsyncIterator[Client]:
    """Versions 1 and 2 of ``vm``, each on its own worker, and a client."""
    start_worker([version(1)])
    await _served(redis_url, "vm@1")  # registered first: version 2 comes as a canary
    start_worker([version(2)])
    await _served(redis_url, "vm@2")
    async with Client(redis_url) as client:
        yield client


# --- the table, without Redis ---------------------------------------------------------
def test_names_keys_and_latest() -> None:
    assert protocol.served_name("textcls", "2") == "textcls@2"
    assert protocol.split_name("textcls@2") == ("textcls", "2")
    assert protocol.split_name("textcls") == ("textcls", None)
    assert protocol.queue_key("textcls@2") == "rb:{textcls@2}:queue"
    assert protocol.versions_key("textcls") == "rb:{textcls}:versions"
    assert protocol.REPLY_TO_RE.fullmatch(protocol.reply_key("textcls@2", "c1"))
    for bad in ("a@", "@2", "a@2@3", "a@-2", "a@" + "9" * 33):
        with pytest.raises(Exception, match="invalid model name"):
            protocol.check_model_name(bad)
    assert Table({"9": Version(), "10": Version()}).latest == "10"  # numeric order
    assert Table({"b": Version(), "a10": Version()}).latest == "b"
    assert Table({"1": Version(), "2": Version(draining=True)}).latest == "1"
    assert Table({"1": Version(), "2": Version()}, pinned_latest="1").latest == "1"


def test_routing_by_weight_pinned_and_unknown() -> None:
    table = Table({"1": Version(100.0), "2": Version(0.0)})
    assert {table.route(MODEL, None) for _ in range(200)} == {"vm@1"}
    table = Table({"1": Version(0.0), "2": Version(100.0)})
    assert {table.route(MODEL, None) for _ in range(200)} == {"vm@2"}
    assert table.route(MODEL, "1") == "vm@1"  # pinned: the split is bypassed
    table = Table({"1": Version(95.0), "2": Version(5.0)})
    rng = random.Random(7)
    picks = [table.route(MODEL, None, rng) for _ in range(2000)]
    assert 40 <= picks.count("vm@2") <= 170  # 5 % of 2000 is 100
    with pytest.raises(UnknownModel, match="has no version '3'; its versions: 1, 2"):
        table.route(MODEL, "3")
    assert versions.EMPTY.route(MODEL, None) == MODEL  # served without versions: as today
    assert versions.EMPTY.route(MODEL, "1") == MODEL
    with pytest.raises(UnknownModel, match="served without versions"):
        versions.EMPTY.route(MODEL, "2")
    draining = Table({"1": Version(0.0, draining=True), "2": Version()})
    with pytest.raises(NoLiveWorkers, match="draining"):
        draining.route(MODEL, "1")
    assert draining.route(MODEL, None) == "vm@2"


def test_stored_rows_decode_loosely() -> None:
    table = versions.decode({b"1": b'{"weight": 95, "draining": false}', b"2": b"junk",
                             b"@latest": b'"1"', b"bad name!": b"{}"})
    assert table.versions == {"1": Version(95.0), "2": Version()}
    assert table.pinned_latest == "1"
    assert versions.decode([b"3", b'{"weight": -1}']).versions == {"3": Version()}


# --- served side by side --------------------------------------------------------------
async def test_two_versions_side_by_side_pinned_and_latest(two: Client,
                                                           raw_redis: redis.Redis) -> None:
    assert await two.predict(MODEL, 1, version="1") == 101
    assert await two.predict(MODEL, 1, version="2") == 201
    assert await two.predict(MODEL, 1) == 101  # version 2 came as a canary: weight 0
    assert two.cached_pick(MODEL) == "1"  # the table just read: the gateway's label
    assert two.cached_pick("vm@2") is None  # a version has no versions
    assert await two.predict("vm@1", 1) == 101  # a served name is a model of its own
    with pytest.raises(UnknownModel, match="no version '3'"):
        await two.predict(MODEL, 1, version="3")
    shown = await two.versions(MODEL)
    assert [(r["version"], r["latest"], r["live_workers"]) for r in shown["versions"]] == \
        [("1", True, 1), ("2", False, 1)]


async def test_weights_change_live_within_two_seconds(two: Client) -> None:
    await two.versions(MODEL, weights={"1": 100, "2": 0})
    await _answers_become(two, {101})
    await two.versions(MODEL, weights={"1": 0, "2": 100})
    await _answers_become(two, {201})
    await two.versions(MODEL, weights={"1": 50, "2": 50})
    await _answers_become(two, {101, 201})


async def _answers_become(client: Client, expected: set[int]) -> None:
    """Within 2 s of a change, 40 requests (each routed on its own: a ``predict_many``
    goes to one version whole) answer from ``expected`` only."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while True:
        answers = set(await asyncio.gather(*(client.predict(MODEL, 1) for _ in range(40))))
        if answers == expected:
            return
        assert loop.time() < deadline, f"still {answers}, want {expected}"
        await asyncio.sleep(0.1)


async def test_http_v1_and_v2_pinned_versions(two: Client, redis_url: str) -> None:
    await two.versions(MODEL, latest="2")  # promoted
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/models/vm/versions/1/predict", json={"inputs": 5})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"outputs": 105}
        assert resp.headers["x-redbatch-version"] == "1"
        resp = await http.post("/v1/models/vm/predict", json={"inputs": 5})
        assert resp.json() == {"outputs": 205} and resp.headers["x-redbatch-version"] == "2"
        resp = await http.post("/v1/models/vm/versions/7/predict", json={"inputs": 5})
        assert resp.status_code == 404 and "no version '7'" in resp.json()["error"]["message"]
        body = {"inputs": [{"name": "inputs", "datatype": "INT64", "shape": [2],
                            "data": [1, 2]}]}
        resp = await http.post("/v2/models/vm/versions/1/infer", json=body)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        assert (doc["model_name"], doc["model_version"]) == ("vm", "1")
        assert doc["outputs"][0]["data"] == [101, 102]
        assert (await http.post("/v2/models/vm/versions/9/infer", json=body)).status_code \
            == 404
        meta = (await http.get("/v2/models/vm/versions/2")).json()
        assert (meta["name"], meta["versions"]) == ("vm", ["1", "2"])
        assert (await http.get("/v2/models/vm/versions/2/ready")).status_code == 200
        scraped = (await http.get("/metrics")).text
        ok = 'redbatch_requests_total{{model="{}",outcome="ok"}} {}.0'
        assert ok.format("vm@1", 2) in scraped, scraped  # pinned, over v1 and v2
        # split by weight: labelled with the version the cached table picked (the model's
        # own name only when its table went stale between the two requests)
        assert ok.format("vm@2", 1) in scraped or ok.format("vm", 1) in scraped
        index = (await http.post("/v2/repository/index")).json()
        assert sorted((m["name"], m["version"]) for m in index) == [("vm", "1"), ("vm", "2")]
        bad = await http.patch("/v1/models/vm/versions", json={"weights": {"1": -5}})
        assert bad.status_code == 422 and "weight of version '1'" in bad.text
        assert (await http.patch("/v1/models/vm/versions", json={"drain": "8"})).status_code \
            == 404
        assert (await http.patch("/v1/models/vm/versions", json={"drain": "1"})).status_code \
            == 200
        resp = await _refused_within_two_seconds(http, "/v1/models/vm/versions/1/predict")
        assert "draining" in resp.json()["error"]["message"]
        assert resp.headers["retry-after"] == "1"


async def _refused_within_two_seconds(http: httpx.AsyncClient, path: str) -> httpx.Response:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while True:
        resp = await http.post(path, json={"inputs": 5})
        if resp.status_code == 503:
            return resp
        assert resp.status_code == 200 and loop.time() < deadline, resp.text
        await asyncio.sleep(0.05)


async def test_listing_gives_each_model_its_versions(two: Client, redis_url: str,
                                                     start_worker: Callable[..., Worker]
                                                     ) -> None:
    start_worker([Model("plain", fn=adder(1))])
    await wait_live(redis_url, "plain")
    async with gateway(redis_url) as http:
        changed = await http.patch("/v1/models/vm/versions", json={"weights": {"1": 95,
                                                                               "2": 5}})
        assert changed.status_code == 200, changed.text
        models = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
    assert set(models) == {"vm", "plain"}
    rows = models["vm"]["versions"]
    assert [(r["version"], r["weight"], r["share"], r["live_workers"]) for r in rows] == \
        [("1", 95.0, 0.95, 1), ("2", 5.0, 0.05, 1)]
    assert all("queue_depth" in r for r in rows) and models["vm"]["live_workers"] == 2
    assert len(models["vm"]["workers"]) == 2  # every version's, not latest's alone
    assert [r["version"] for r in models["plain"]["versions"]] == ["1"]


def test_cli_sets_weights_and_shows_them(two: Client, redis_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["versions", MODEL, "1=95", "2=5", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "95.0%" in out and "5.0%" in out
    assert main(["versions", MODEL, "--drain", "4", "--redis-url", redis_url]) == 2
    assert "no version '4'" in capsys.readouterr().err
    assert main(["config", MODEL, "max_batch_size=2", "--redis-url", redis_url]) == 2
    assert "its versions are models of their own: vm@1, vm@2" in capsys.readouterr().err


# --- draining -------------------------------------------------------------------------
async def test_draining_finishes_the_queue_then_the_worker_stops(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    old = start_worker([version(1, delay_s=0.1)])  # 25 batches: longer than the settle
    start_worker([version(2)])
    await _served(redis_url, "vm@1", "vm@2")
    async with Client(redis_url) as client:
        queued = [await client.submit(MODEL, x, 15.0, version="1") for x in range(100)]
        await client.versions(MODEL, drain="1")
        assert await asyncio.gather(*queued) == [x + 100 for x in range(100)]  # none lost
        await _answers_become(client, {201})  # unpinned traffic goes to version 2
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        with pytest.raises(NoLiveWorkers, match="draining"):  # within 2 s: refused
            while loop.time() < deadline:
                assert await client.predict(MODEL, 1, version="1") == 101
                await asyncio.sleep(0.05)
        deadline = loop.time() + 10
        while raw_redis.zcard(protocol.workers_key("vm@1")):
            assert loop.time() < deadline, "the drained worker never stopped"
            await asyncio.sleep(0.05)
    assert old.drained
    assert raw_redis.llen(protocol.queue_key("vm@1")) == 0
    assert raw_redis.llen(protocol.dead_letter_key("vm@1")) == 0


def test_config_file_serves_a_target_as_a_version(tmp_path: Path) -> None:
    path = tmp_path / "up.toml"
    path.write_text('[[models]]\ntarget = "redbatch.demo:models"\nversion = "2"\n')
    entry = configfile.load(path).models[0]
    served = configfile.with_overrides([Model("m", fn=adder(1))], entry.overrides)
    assert [(m.name, m.version) for m in served] == [("m@2", "2")]
    path.write_text('[[models]]\ntarget = "redbatch.demo:models"\nversion = "2/x"\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.version"):
        configfile.load(path)
    assert batch(name="m", version="4")(adder(1)).name == "m@4"
    with pytest.raises(ConfigError, match="is version '2', not '3'"):
        Model("m@2", fn=adder(1), version="3")


# --- the operators' changes: checked, atomic --------------------------------------------
async def test_unknown_versions_in_a_change_are_404_not_500(two: Client,
                                                            redis_url: str) -> None:
    async with gateway(redis_url) as http:
        for change in ({"weights": {"9": 1}}, {"undrain": "9"}, {"weights": {"x/../y": 1}},
                       {"weights": {"@latest": 3}}, {"latest": "@latest"}):
            resp = await http.patch("/v1/models/vm/versions", json=change)
            assert resp.status_code == 404, (change, resp.text)
            assert "has no version" in resp.json()["error"]["message"]
        resp = await http.get("/v1/models/vm@1/versions")
        assert resp.status_code == 404 and "is version '1' of model 'vm'" in resp.text
    for kwargs in ({"weights": {"9": 1.0}}, {"undrain": "9"}):
        with pytest.raises(UnknownModel, match="no version '9'; its versions: 1, 2"):
            await two.versions(MODEL, **kwargs)  # type: ignore[arg-type]
    assert (await versions.load(two.redis, MODEL)).versions == {"1": Version(),
                                                                "2": Version(0.0)}


def test_a_draining_pinned_latest_takes_no_traffic() -> None:
    table = Table({"1": Version(0.0, draining=True), "2": Version()}, pinned_latest="1")
    assert table.latest == "2"
    assert {table.route(MODEL, None) for _ in range(50)} == {"vm@2"}
    pinned = Table({"1": Version(), "2": Version()}, pinned_latest="1")
    assert versions.edited(pinned, MODEL, {}, None, "1", None).pinned_latest is None
    with pytest.raises(ConfigError, match="is draining: it cannot be latest"):
        versions.edited(Table({"1": Version(0.0, draining=True), "2": Version()}), MODEL,
                        {}, "1", None, None)


async def test_draining_the_pinned_latest_unpins_it(two: Client) -> None:
    await two.versions(MODEL, latest="1")
    await two.versions(MODEL, drain="1")
    table = await versions.load(two.redis, MODEL)
    assert table.pinned_latest is None and table.latest == "2"
    assert table.route(MODEL, None) == "vm@2"


async def test_concurrent_changes_keep_each_others_writes(two: Client, redis_url: str
                                                          ) -> None:
    async with Client(redis_url) as other:
        await other.start()
        for weight in range(1, 11):
            await versions.change(two.redis, MODEL, undrain="1")
            await asyncio.gather(versions.change(two.redis, MODEL, drain="1"),
                                 versions.change(other.redis, MODEL, weights={"2": weight}))
            table = await versions.load(two.redis, MODEL)
            assert table.versions == {"1": Version(0.0, True), "2": Version(float(weight))}


async def test_versions_registered_at_once_all_land_beside_an_operators_change(
        redis_url: str) -> None:
    """Workers registering versions of one model at the same moment, while an operator
    changes a weight, each add their row in one atomic step (``REGISTER_VERSION``): no
    registration is lost, exactly one version (the first) takes unpinned traffic, and
    the operator's weight stays."""
    conns = [aioredis.Redis.from_url(redis_url) for _ in range(8)]
    try:
        await _register(conns[0], "1")
        rounds = [versions.change(conns[0], MODEL, weights={"1": float(w)}) for w in range(5)]
        await asyncio.gather(*(_register(c, str(n)) for n, c in enumerate(conns, 2)),
                             *rounds)
        table = await versions.load(conns[0], MODEL)
    finally:
        for conn in conns:
            await conn.aclose()
    assert set(table.versions) == {str(n) for n in range(1, 10)}
    assert table.versions["1"].weight is not None and table.versions["1"].weight >= 0
    assert all(table.versions[str(n)].weight == 0.0 for n in range(2, 10))  # canaries


async def test_a_version_1_takes_over_a_stored_base_row_once_its_workers_left(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """An operator's change stores the row of the workers served without versions
    (``"base": true``, as version 1, weight 70). A worker of a real version 1 leaves it
    theirs while they are live (no traffic moves to it unasked), then takes it over
    (the operator's weight stays) rather than being masked by it."""
    conn = aioredis.Redis.from_url(redis_url)
    try:
        await _base_row_of_70(conn, raw_redis)
        table = await versions.load(conn, MODEL)
        assert (table.served(MODEL, "1"), table.versions["1"].weight) == ("vm", 70.0)
        raw_redis.delete(protocol.workers_key(MODEL))
        for _ in range(2):  # it saw them gone, then the settle (here 0 ms) passed
            await _register(conn, "1", settle_ms=0)
        assert b"base" not in raw_redis.hget(protocol.versions_key(MODEL), "1")
        table = await versions.load(conn, MODEL)
    finally:
        await conn.aclose()
    assert table.versions["1"] == Version(70.0) and table.served(MODEL, "1") == "vm@1"


async def test_a_version_1_waits_a_settle_before_it_takes_over_a_stored_base_row(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """The workers served without versions gone for less than the settle (a restart):
    version 1 serves the row meanwhile (never absent: a pin on it is no 404), and they
    get it back, the operator's weight too, once live again."""
    conn = aioredis.Redis.from_url(redis_url)
    try:
        await _base_row_of_70(conn, raw_redis)
        raw_redis.delete(protocol.workers_key(MODEL))
        table = await versions.load(conn, MODEL)  # before a beat of version 1
        assert (table.served(MODEL, "1"), table.versions["1"]) == ("vm@1", Version(70.0))
        for _ in range(2):
            await _register(conn, "1")
        table = await versions.load(conn, MODEL)
        assert (table.served(MODEL, "1"), table.versions["1"]) == ("vm@1", Version(70.0))
        _plain_live(raw_redis)
        await _register(conn, "1")
        table = await versions.load(conn, MODEL)
    finally:
        await conn.aclose()
    assert (table.served(MODEL, "1"), table.versions["1"]) == ("vm", Version(70.0, base=True))


async def test_a_version_1_never_takes_the_drain_of_a_stored_base_row(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """An operator drained the workers served without versions: a worker of version 1
    starting meanwhile reads a row not draining (it serves on), and takes the row over
    not draining once they left."""
    _plain_live(raw_redis)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        await _register(conn, "2")
        await versions.change(conn, MODEL, weights={"2": 30}, drain="1")
        assert not drain._draining(version(1), await _register(conn, "1"))  # as it reads
        raw_redis.delete(protocol.workers_key(MODEL))
        for _ in range(2):
            assert not drain._draining(version(1), await _register(conn, "1", settle_ms=0))
        table = await versions.load(conn, MODEL)
    finally:
        await conn.aclose()
    assert table.versions["1"] == Version(0.0) and table.served(MODEL, "1") == "vm@1"


def _plain_live(raw_redis: redis.Redis) -> None:
    """A live worker of ``vm`` served without versions."""
    raw_redis.zadd(protocol.workers_key(MODEL), {"plain": protocol.now_ms() + 60_000})


async def _base_row_of_70(conn: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """Workers of ``vm`` without versions, live; version 2; an operator's change that
    stores their row (base, weight 70); a worker of a real version 1 registers."""
    _plain_live(raw_redis)
    await _register(conn, "2")
    await versions.change(conn, MODEL, weights={"1": 70, "2": 30})
    await _register(conn, "1")


async def _register(conn: aioredis.Redis, number: str, settle_ms: int = 60_000) -> bytes:
    """A heartbeat's registration of version ``number`` of ``vm``; the row it read."""
    await conn.script_load(lua.REGISTER_VERSION)
    async with conn.pipeline(transaction=False) as pipe:
        heartbeat._version_rows(pipe, [version(int(number))], settle_ms)
        row: bytes = (await pipe.execute())[0]
    return row


# --- draining: nothing left behind ----------------------------------------------------
@pytest.fixture
def quick_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "DRAIN_SETTLE_S", 0.3)


async def _drained(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 8
    while not worker.drained:
        assert loop.time() < deadline, "the drained worker never stopped"
        await asyncio.sleep(0.05)


async def _start_1_then_2(start_worker: Callable[..., Worker], redis_url: str) -> Worker:
    """Versions 1 and 2 (a canary: it registers second), each on its own worker; the
    worker of version 1."""
    old = start_worker([version(1)])
    await _served(redis_url, "vm@1")
    start_worker([version(2)])
    await _served(redis_url, "vm@2")
    return old


@pytest.mark.usefixtures("quick_settle")
async def test_a_dead_peers_in_flight_is_served_before_the_drain_ends(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    old = await _start_1_then_2(start_worker, redis_url)
    # a second worker of version 1 died with a request in flight; its lease runs on
    raw_redis.zadd(protocol.workers_key("vm@1"), {"ghost": protocol.now_ms() + 1500})
    raw_redis.rpush(protocol.inflight_key("vm@1", "ghost"), b"junk")
    async with Client(redis_url) as client:
        await client.versions(MODEL, drain="1")
    await _drained(old)
    assert raw_redis.llen(protocol.inflight_key("vm@1", "ghost")) == 0  # reaped, then served
    assert raw_redis.llen(protocol.queue_key("vm@1")) == 0


@pytest.mark.usefixtures("quick_settle")
async def test_a_drained_version_refuses_late_pushes_until_served_again(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    old = await _start_1_then_2(start_worker, redis_url)
    async with Client(redis_url) as client:
        await client.versions(MODEL, drain="1")
        await _drained(old)
    # a producer that routed before the drain pushes now (no cached check stops it)
    async with Client(redis_url, require_workers=False) as late:
        with pytest.raises(NoLiveWorkers, match="no live worker"):
            await late.predict("vm@1", 1, 2.0)
        assert raw_redis.llen(protocol.queue_key("vm@1")) == 0  # nothing left behind
        assert await late.predict("vm@2", 1, 2.0) == 201  # other versions: as before
        async with Client(redis_url) as client:
            await client.versions(MODEL, undrain="1")
        start_worker([version(1)])  # served again: open again
        await _served(redis_url, "vm@1")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while raw_redis.exists(protocol.closed_key("vm@1")):
            assert loop.time() < deadline, "the version was never reopened"
            await asyncio.sleep(0.05)
        assert await late.predict("vm@1", 1, 2.0) == 101


@pytest.mark.usefixtures("quick_settle")
async def test_a_version_of_levels_and_sub_queues_drains_and_closes_each(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    ranked = batch(name="lv", version="3", max_batch_size=8, batch_wait_timeout_s=0,
                   priority_levels=2, default_priority=2, sub_queues=2)(adder(3))
    worker = start_worker([ranked])
    await _served(redis_url, "lv@3")
    tags = protocol.sub_queue_tags("lv@3", 2)
    assert tags == ["lv@3", "lv@3:1"]
    async with Client(redis_url, pack_rows=1) as client:
        for start in range(0, 12, 2):  # both sub-queues, both levels
            assert await asyncio.gather(client.predict("lv", start, priority=1),
                                        client.predict("lv", start + 1, version="3")) == \
                [start + 3, start + 4]
        await client.versions("lv", drain="3")
        await _drained(worker)
    assert all(raw_redis.exists(protocol.closed_key(tag)) for tag in tags)
    async with Client(redis_url, require_workers=False, pack_rows=1) as late:
        for priority in (1, 2, 1, 2):
            with pytest.raises(NoLiveWorkers):
                await late.predict("lv@3", 1, 2.0, priority=priority)
    assert not any(raw_redis.exists(protocol.queue_key(tag, 1), protocol.queue_key(tag))
                   for tag in tags)


async def test_a_served_name_is_refused_while_its_version_drains(two: Client,
                                                                 redis_url: str) -> None:
    await two.versions(MODEL, drain="1")
    with pytest.raises(NoLiveWorkers, match="draining"):
        await two.predict("vm@1", 1)
    assert await two.predict("vm@2", 1) == 201
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/models/vm@1/predict", json={"inputs": 5})
        assert resp.status_code == 503 and "draining" in resp.text


# --- a new version takes no traffic by surprise -----------------------------------------
async def test_a_new_version_is_a_canary_until_promoted(two: Client) -> None:
    table = await versions.load(two.redis, MODEL)
    assert table.versions == {"1": Version(), "2": Version(0.0)} and table.latest == "1"
    assert set(await asyncio.gather(*(two.predict(MODEL, 1) for _ in range(20)))) == {101}
    assert await two.predict(MODEL, 1, version="2") == 201  # pinned: served at once
    sync = SyncClient(two.settings.url)
    try:
        assert await asyncio.to_thread(sync.predict_many, MODEL, [1, 2], 5.0, version="2") \
            == [201, 202]
    finally:
        await asyncio.to_thread(sync.close)
    await two.versions(MODEL, latest="2")  # promoted
    await _answers_become(two, {201})


async def test_an_unversioned_model_counts_as_version_1_beside_a_new_one(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([Model(MODEL, fn=adder(0), policy=BatchPolicy(max_batch_size=4,
                                                                 batch_wait_timeout_s=0.002))])
    await wait_live(redis_url, MODEL)
    start_worker([version(2)])
    await _served(redis_url, "vm@2")
    async with Client(redis_url) as client:
        assert set(await asyncio.gather(*(client.predict(MODEL, 1) for _ in range(20)))) \
            == {1}  # still the workers served without versions
        assert await client.predict(MODEL, 1, version="1") == 1
        assert await client.predict(MODEL, 1, version="2") == 201
        shown = await client.versions(MODEL, weights={"1": 50, "2": 50})
        assert [(r["version"], r["name"], r["share"], r["live_workers"])
                for r in shown["versions"]] == [("1", MODEL, 0.5, 1), ("2", "vm@2", 0.5, 1)]
        await _answers_become(client, {1, 201})
    async with gateway(redis_url) as http:
        models = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
    assert [(r["version"], r["name"]) for r in models[MODEL]["versions"]] == \
        [("1", MODEL), ("2", "vm@2")]
    assert models[MODEL]["live_workers"] == 2


# --- streaming models in versions ---------------------------------------------------------
async def streams_go_to_version_2(client: Client, ask: Any, timeout_s: float) -> list[Any]:
    """Streaming model ``gen``, served as version 2 only: its stream unpinned, pinned
    to 2 and by the served name ``gen@2`` are the same, from ``gen@2``; a version it
    does not have is refused.  The chunks."""
    unpinned = [c async for c in client.stream("gen", ask, timeout_s)]
    assert unpinned and unpinned == [c async for c in client.stream("gen", ask, timeout_s,
                                                                      version="2")]
    assert [c async for c in client.stream("gen@2", ask, timeout_s)] == unpinned
    stream = client.stream("gen", ask, timeout_s)
    await stream.open()
    assert stream.model == "gen@2"
    await stream.aclose()
    with pytest.raises(UnknownModel, match="no version '5'"):
        await client.stream("gen", ask, timeout_s, version="5").open()
    return unpinned


async def test_a_streaming_model_in_versions(start_worker: Callable[..., Worker],
                                             redis_url: str) -> None:
    from tests.stream_models import counting, policy
    start_worker([Model("gen", fn=counting, policy=policy(4, 0.002), version="2")])
    await _served(redis_url, "gen@2")
    ask = {"n": 2, "tag": "t"}
    async with Client(redis_url) as client:
        assert await streams_go_to_version_2(client, ask, 3.0)
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/models/gen/predict", json=ask)
        assert resp.status_code == 200 and resp.headers["x-redbatch-version"] == "2"
        for path in ("/v2/models/gen/generate", "/v2/models/gen/versions/2/generate"):
            resp = await http.post(path, json=ask)
            assert resp.status_code == 200, resp.text
            assert (resp.json()["model_name"], resp.json()["model_version"]) == ("gen", "2")
        resp = await http.post("/v2/models/gen/versions/2/generate_stream", json=ask)
        assert resp.status_code == 200 and '"model_version":"2"' in resp.text
        assert (await http.post("/v2/models/gen/versions/7/generate", json=ask)).status_code \
            == 404


async def test_v2_generate_refuses_the_names_infer_refuses(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Triton's generate routes check the path's name as every v2 route does: a
    served name is no v2 name (404), a pin on one is a 400, an illegal name a 404."""
    from tests.stream_models import counting, policy
    start_worker([Model("gen", fn=counting, policy=policy(4, 0.002), version="2")])
    await _served(redis_url, "gen@2")
    expected = {"gen@2": 404, "gen@2/versions/2": 400, "bad!@x/versions/1": 404,
                "gen/versions/2": 200}
    async with gateway(redis_url) as http:
        for path, status in expected.items():
            for route in ("infer", "generate", "generate_stream"):
                resp = await http.post(f"/v2/models/{path}/{route}", json={"n": 1})
                if route == "infer" and status == 200:  # (gen streams: infer refuses it)
                    assert resp.status_code == 400 and "generate_stream" in resp.text
                    continue
                assert resp.status_code == status, (path, route, resp.text)


async def test_a_request_split_by_a_cold_table_is_counted_under_its_model(
        two: Client, redis_url: str) -> None:
    async with gateway(redis_url) as http:  # its copy of the table: not read yet
        assert (await http.post("/v1/models/vm/predict", json={"inputs": 5})).status_code \
            == 200
        scraped = (await http.get("/metrics")).text
    assert 'redbatch_requests_total{model="vm",outcome="ok"} 1.0' in scraped, scraped


async def test_a_served_name_with_a_version_route_is_refused(two: Client,
                                                            redis_url: str) -> None:
    """``vm@1`` names a version already: pinning one more (route or ``version=``) is a
    clear 400 naming the two right forms, never a 200 from whichever wins."""
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/models/vm@1/versions/1/predict", json={"inputs": 5})
        assert resp.status_code == 400, resp.text
        assert "models/vm/versions/1/" in resp.json()["error"]["message"]
        body = {"inputs": [{"name": "inputs", "datatype": "INT64", "shape": [1],
                            "data": [1]}]}
        resp = await http.post("/v2/models/vm@1/versions/1/infer", json=body)
        assert resp.status_code == 400 and "models/vm/versions/1/" in resp.text, resp.text
        assert "models/vm@1/" not in resp.text  # v2 takes no served name: not a fix there
        assert (await http.post("/v2/models/vm@1/infer", json=body)).status_code == 404
        assert (await http.get("/v2/models/vm@1/versions/1/ready")).status_code == 400
        assert (await http.post("/v1/models/vm@1/predict", json={"inputs": 5})).json() \
            == {"outputs": 105}
    with pytest.raises(BadRequest, match="served name"):
        await two.submit("vm@1", 5, version="1")
    assert await (await two.submit("vm@1", 5)) == 105


async def test_a_pin_on_a_name_that_is_no_name_says_so(two: Client, redis_url: str) -> None:
    """An illegal name with a version route is refused for its name, not as a
    served name: a 404 over v2 (as any non-name), a 422 naming the bad name over v1."""
    async with gateway(redis_url) as http:
        resp = await http.post("/v2/models/bad!@x/versions/1/infer", json={"inputs": []})
        assert resp.status_code == 404 and "served name" not in resp.text, resp.text
        resp = await http.post("/v1/models/bad!@x/versions/1/predict", json={"inputs": 5})
        assert resp.status_code == 422, resp.text  # v1's answer to a bad model name
        assert "invalid model name" in resp.json()["error"]["message"]


async def test_a_pin_on_a_served_name_is_refused_before_any_read() -> None:
    """The pure-input 400 costs no Redis call: a client whose Redis is unreachable
    still answers it (never the 503 of the read it would have made)."""
    client = Client("redis://127.0.0.1:1/0")
    with pytest.raises(BadRequest, match="served name"):
        await client.route("vm@1", "1")


async def test_a_versions_error_answers_name_the_version(two: Client, redis_url: str) -> None:
    """Every answer of a version carries ``x-redbatch-version``, errors too: the model
    raising (500), a bad timeout (400); an unknown version's 404 names none."""
    async with gateway(redis_url) as http:
        path = "/v1/models/vm/versions/2/predict"
        for payload, status in (({"inputs": "a"}, 500), ({"inputs": 5, "timeout_ms": "x"}, 400),
                                ({"inputs": 5}, 200)):
            resp = await http.post(path, json=payload)
            assert resp.status_code == status, resp.text
            assert resp.headers.get("x-redbatch-version") == "2", (payload, resp.headers)
        resp = await http.post("/v1/models/vm/versions/7/predict", json={"inputs": 5})
        assert resp.status_code == 404 and "x-redbatch-version" not in resp.headers


async def test_v2_config_and_stats_of_each_version(two: Client, redis_url: str) -> None:
    """``versions/{v}/config`` (tritonclient's ``get_model_config(m, "1")``) exists and
    names the model, not its served name; stats without a version cover every one."""
    await two.versions(MODEL, latest="2")
    async with gateway(redis_url) as http:
        for path in ("/v2/models/vm/config", "/v2/models/vm/versions/1/config"):
            resp = await http.get(path)
            assert resp.status_code == 200 and resp.json()["name"] == "vm", resp.text
        assert (await http.get("/v2/models/vm/versions/7/config")).status_code == 404
        body = {"inputs": [{"name": "inputs", "datatype": "INT64", "shape": [1],
                            "data": [1]}]}
        for _ in range(3):
            assert (await http.post("/v2/models/vm/versions/1/infer",
                                    json=body)).status_code == 200
        stats = (await http.get("/v2/models/vm/stats")).json()["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [("vm", "1"), ("vm", "2")]
        one = (await http.get("/v2/models/vm/versions/1/stats")).json()["model_stats"]
        assert [(s["name"], s["version"]) for s in one] == [("vm", "1")]


async def test_the_versions_of_a_model_without_versions_and_of_no_model(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([Model("plainm", fn=adder(1), policy=BatchPolicy(batch_wait_timeout_s=0))])
    await wait_live(redis_url, "plainm")
    async with gateway(redis_url) as http:
        doc = (await http.get("/v1/models/plainm/versions")).json()
        assert doc["latest"] == "1" and [(r["version"], r["name"], r["live_workers"])
                                         for r in doc["versions"]] == [("1", "plainm", 1)]
        resp = await http.get("/v1/models/nosuch/versions")
        assert resp.status_code == 404, resp.text


def test_a_pick_leaves_out_the_versions_known_to_have_no_live_worker() -> None:
    table = Table({"1": Version(50.0), "2": Version(50.0), "3": Version(0.0)})
    assert {table.choose(random.Random(seed), dead={"2"}) for seed in range(20)} == {"1"}
    assert table.choose(dead={"1", "2"}) == "3"  # latest of the rest: a canary serves
    with pytest.raises(NoLiveWorkers, match="no version of model 'vm'"):
        table.pick("vm", dead={"1", "2", "3"})


async def test_a_version_with_a_weight_and_no_live_worker_takes_no_requests(
        two: Client, redis_url: str, raw_redis: redis.Redis) -> None:
    """Its share was answered 503 (16 of 40 requests at 50 %) while another version
    served; a request that pins no version now goes to a version with a live worker."""
    import orjson

    raw_redis.hset(protocol.versions_key(MODEL), "1", orjson.dumps({"weight": 1.0}))
    raw_redis.hset(protocol.versions_key(MODEL), "3", orjson.dumps({"weight": 1e6}))
    await asyncio.sleep(1.1)  # the cached table is stale
    assert [await two.predict(MODEL, 1, timeout_s=5) for _ in range(10)] == [101] * 10
    async with gateway(redis_url) as http:  # past its caches' lives: picks by stale ones
        statuses: list[int] = []
        ended = asyncio.get_running_loop().time() + 1.5
        while asyncio.get_running_loop().time() < ended:
            statuses.append((await http.post(f"/v1/models/{MODEL}/predict",
                                             json={"inputs": 1})).status_code)
            statuses.append((await http.post(f"/v2/models/{MODEL}/infer", json={
                "inputs": [{"name": "inputs", "datatype": "INT64", "shape": [1],
                            "data": [1]}]})).status_code)
    assert set(statuses) == {200}, statuses


def test_a_change_after_the_pinned_latest_lost_its_row_unpins_it() -> None:
    """A base row pinned as latest whose workers left is dropped from the table: a
    change then raised ``KeyError`` (a 500 on PATCH, a traceback from the CLI)."""
    table = Table({"2": Version(5.0)}, pinned_latest="1")
    assert versions.edited(table, "bm", {"2": 7}, None, None, None) == \
        Table({"2": Version(7.0)}, None)


def test_a_weight_stored_past_the_limit_reads_as_none() -> None:
    """As a change refuses it: two weights of 1e308 broke the weighted pick (500)."""
    table = versions.decode({b"1": b'{"weight": 1e308}', b"2": b'{"weight": 1e308}'})
    assert table.versions["1"].weight is None and table.choose() in {"1", "2"}


async def test_a_draining_versions_v2_metadata_stays_readable_and_it_is_not_ready(
        two: Client, redis_url: str) -> None:
    """An operator watching a drain reads the version's metadata, config and
    statistics (they were 503 while it drained); its ``ready`` is 503."""
    await two.versions(MODEL, drain="2")
    async with gateway(redis_url) as http:
        for path in ("", "/config", "/stats"):
            resp = await http.get(f"/v2/models/vm/versions/2{path}")
            assert resp.status_code == 200, (path, resp.text)
        assert (await http.get("/v2/models/vm/versions/2/ready")).status_code == 503
        assert (await http.get("/v2/models/vm/versions/1/ready")).status_code == 200
