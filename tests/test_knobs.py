"""Batching knobs changed live (redbatch.knobs): stored in Redis, applied by running
workers with their heartbeat, shown by the gateway, the client and ``redbatch config``."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
import redis
import redis.asyncio

from redbatch import Client, ConfigError, Model, TensorSpec, protocol
from redbatch.cli import main
from redbatch.config import RedisSettings, WorkerConfig
from redbatch.errors import InvalidKnob, UnknownModel
from redbatch.knobs import check, decode_stored
from redbatch.knobs_cli import parse_changes
from redbatch.worker.claim import Claimer
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.test_gateway import gateway

pytestmark = pytest.mark.timeout(60)

# The default heartbeat (1 s): the 2 s promise is checked against it.
BEATING = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=1.0, lease_ttl_s=3.0)


def recording(name: str, passes: list[int]) -> Model:
    """A model that notes the size of each forward pass."""
    def forward(xs: list[int]) -> list[int]:
        passes.append(len(xs))
        return xs

    return Model(name, fn=forward, policy=BatchPolicy(max_batch_size=32,
                                                      batch_wait_timeout_s=0.05))


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


def test_checks_name_the_knob_and_value() -> None:
    assert check("batch_wait_timeout_s", 0) == 0.0 and isinstance(
        check("batch_wait_timeout_s", 0), float)
    for name, value, words in [("max_batch_size", 0, "1..65536"),
                               ("max_batch_size", "16", "an integer"),
                               ("max_batch_size", True, "an integer"),
                               ("adaptive", 1, "true or false"),
                               ("hold_buckets", "no", "true or false"),
                               ("pad_to_longest", 1, "true or false"),
                               ("quiet_s", 0, "> 0 and at most 60 s"),
                               ("max_queue_len", 2**64, f"at most {2**63 - 1}"),
                               ("priority_caps", [5, 2**64], f"at most {2**63 - 1}"),
                               ("max_batch_cost", 10**400, "at most 1.79"),
                               ("max_queue_len", 0, ">= 1"),
                               ("priority_caps", [5, 0], ">= 1, got 0"),
                               ("priority_caps", [5, 1.5], "a list of 1-16 integers"),
                               ("priority_caps", [], "a list of 1-16 integers"),
                               ("priority_caps", 5, "a list of 1-16 integers"),
                               ("max_bach_size", 8, "unknown knob")]:
        with pytest.raises(InvalidKnob, match=re.escape(words)):
            check(name, value)
    with pytest.raises(ConfigError, match=re.escape("max_batch_size must be 1..65536, got 0")):
        BatchPolicy(max_batch_size=0)  # the policy checks its fields with the same table


def test_stored_values_that_no_longer_check_are_reported() -> None:
    good, problems = decode_stored({b"max_batch_size": b"8", b"stride_s": b"lots",
                                    b"adaptive": b"3", b"gone_knob": b"1"})
    assert good == {"max_batch_size": 8}
    assert sorted(p.split("=")[0] for p in problems) == ["adaptive", "gone_knob", "stride_s"]


def test_cli_values_are_json() -> None:
    assert parse_changes(["max_batch_size=16", "batch_wait_timeout_s=0.01", "adaptive=false",
                          "quiet_s="]) == {"max_batch_size": 16, "batch_wait_timeout_s": 0.01,
                                           "adaptive": False, "quiet_s": None}
    with pytest.raises(InvalidKnob, match="KNOB=VALUE"):
        parse_changes(["max_batch_size"])
    assert parse_changes(["priority_caps=[100, 5]"]) == {"priority_caps": [100, 5]}
    assert check("priority_caps", [100, 5]) == [100, 5]


async def test_a_running_worker_applies_max_batch_size_within_2_s(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    passes: list[int] = []
    worker = start_worker([recording("live-size", passes)], config=BEATING)
    await wait_live(redis_url, "live-size")
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("live-size", list(range(40)), timeout_s=10) == \
            list(range(40))
        assert max(passes) > 4  # before: batches larger than the new size
        answer = await client.configure("live-size", max_batch_size=4)
        assert answer["overrides"] == {"max_batch_size": 4}
        assert answer["effective"]["max_batch_size"] == 4
        assert answer["effective"]["batch_wait_timeout_s"] == 0.05  # the model's own
        await asyncio.sleep(2.0)  # the promise: applied within 2 s
        passes.clear()
        assert await client.predict_many("live-size", list(range(40)), timeout_s=10) == \
            list(range(40))
    assert max(passes) == 4 and sum(passes) == 40
    assert worker.runners[0].model.policy.max_batch_size == 4


async def test_a_stride_turned_down_live_ends_the_stride_being_waited_out(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A 60 s stride, then turned back to 0: the request the stride held is served
    within the 2 s of the promise (plus its batch), not once the old stride is over."""
    passes: list[int] = []
    model = recording("live-stride", passes)
    start_worker([model], config=BEATING)
    await wait_live(redis_url, "live-stride")
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict("live-stride", 1, timeout_s=10) == 1
        await client.configure("live-stride", stride_s=60)
        await asyncio.sleep(2.0)  # applied: the worker's idle claims now wait 60 s apart
        waiting = asyncio.ensure_future(client.predict("live-stride", 2, timeout_s=30))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # the stride holds it
        await client.configure("live-stride", stride_s=0)
        assert await asyncio.wait_for(waiting, 4.0) == 2


async def test_a_stride_being_waited_out_ends_at_shutdown(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        claimer = Claimer(client, "paced", "w1", BatchPolicy(stride_s=60),
                          block_timeout_s=0.3)
        claimer.stop = asyncio.Event()
        await claimer.pace()  # the first claim: no stride to wait out
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, claimer.stop.set)
        started = loop.time()
        await asyncio.wait_for(claimer.pace(), 5)  # (it waited the whole 60 s)
        assert loop.time() - started < 1.0
    finally:
        await client.aclose()


async def test_bad_values_get_422_and_store_nothing(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([recording("strict", [])])
    await wait_live(redis_url, "strict")
    path = "/v1/models/strict/config"
    async with gateway(redis_url) as http:
        for body in ({"max_batch_size": 0}, {"max_bach_size": 8}, {"max_bach_size": None},
                     {"max_batch_size": "16"}, {"adaptive": "yes"},
                     {"max_batch_size": 8, "stride_s": 99}):
            resp = await http.patch(path, json=body)
            assert resp.status_code == 422, (body, resp.text)
            assert resp.json()["error"]["code"] == "invalid_knob"
            assert next(iter(body)) in resp.text or "stride_s" in resp.text
        assert (await http.patch(path, json=[1, 2])).status_code == 400
        assert (await http.patch(path, content=b"{not json")).status_code == 400
        assert (await http.patch("/v1/models/nobody/config",
                                 json={"max_batch_size": 8})).status_code == 404
        assert (await http.get("/v1/models/nobody/config")).status_code == 404
    assert not raw_redis.exists(protocol.config_key("strict"))
    async with Client(redis_url, require_workers=False) as client:
        with pytest.raises(ConfigError, match="max_batch_size"):
            await client.configure("strict", max_batch_size=0)
        with pytest.raises(UnknownModel):
            await client.configure("nobody", max_batch_size=8)
    assert not raw_redis.exists(protocol.config_key("strict"))


async def test_a_model_whose_metadata_cannot_be_read_is_unknown_to_the_admin_routes(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Its metadata not JSON, not an object, or of another type: 500 ``internal`` (the
    connection closed), or 503; a repeated key hid a refused value."""
    raw_redis.set(protocol.meta_key("badjson"), b"notjson")
    raw_redis.set(protocol.meta_key("badlist"), b"[1]")
    raw_redis.rpush(protocol.meta_key("badtype"), b"x")
    async with gateway(redis_url) as http:
        for model in ("badjson", "badlist", "badtype"):
            path = f"/v1/models/{model}/config"
            for resp in (await http.get(path),
                         await http.patch(path, json={"max_batch_size": 8}),
                         await http.get(f"/v1/models/{model}/versions")):  # (was: 200)
                assert resp.status_code == 404, (model, resp.text)
                assert resp.json()["error"]["code"] == "unknown_model"
        assert not raw_redis.exists(protocol.config_key("badjson"))
        resp = await http.patch("/v1/models/badjson/config",
                                content=b'{"max_batch_size": 0, "max_batch_size": 16}')
        assert resp.status_code == 400 and "appears twice" in resp.text


async def test_a_repeated_key_in_an_admin_body_is_refused(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([recording("twice", [])])
    await wait_live(redis_url, "twice")
    async with gateway(redis_url) as http:
        for path, text in (("config", b'{"max_batch_size": 0, "max_batch_size": 16}'),
                           ("versions", b'{"latest": "1", "latest": "1"}')):
            resp = await http.patch(f"/v1/models/twice/{path}", content=text)
            assert resp.status_code == 400, resp.text
            assert "'max_batch_size' appears twice" in resp.text or "'latest'" in resp.text
    assert not raw_redis.exists(protocol.config_key("twice"))


def test_a_repeated_key_is_found_in_linear_time() -> None:
    """Each key was counted in the whole list: 20,000 keys took 5.5 s of the gateway's
    event loop, and a 1 MiB body minutes."""
    import time

    from redbatch.api import body
    from redbatch.errors import BadRequest

    keys = [f"k{i}" for i in range(100_000)]
    text = ("{" + ",".join(f'"{k}":1' for k in [*keys, keys[-1]]) + "}").encode()
    started = time.monotonic()
    with pytest.raises(BadRequest, match="'k99999' appears twice"):
        body.refuse_duplicate_keys(text)
    assert time.monotonic() - started < 2.0


async def test_patch_needs_the_api_key_when_one_is_set(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([recording("guarded", [])])
    await wait_live(redis_url, "guarded")
    path = "/v1/models/guarded/config"
    async with gateway(redis_url, api_key="k3y") as http:
        assert (await http.patch(path, json={"max_batch_size": 8})).status_code == 401
        assert (await http.get(path)).status_code == 401
        assert not raw_redis.exists(protocol.config_key("guarded"))
        resp = await http.patch(path, json={"max_batch_size": 8},
                                headers={"Authorization": "Bearer k3y"})
        assert resp.status_code == 200, resp.text
    assert raw_redis.hgetall(protocol.config_key("guarded")) == {b"max_batch_size": b"8"}


async def test_a_method_the_admin_routes_lack_gets_405_listing_get_and_patch(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([recording("allowed", [])])
    await wait_live(redis_url, "allowed")
    async with gateway(redis_url) as http:
        for path in ("/v1/models/allowed/config", "/v1/models/allowed/versions"):
            resp = await http.delete(path)
            assert resp.status_code == 405, resp.text
            allowed = {m.strip() for m in resp.headers["allow"].split(",")}
            assert {"GET", "PATCH"} <= allowed, resp.headers["allow"]
            assert (await http.get(path)).status_code == 200


async def test_models_listing_shows_the_effective_values(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    model = recording("listed", [])
    start_worker([model])
    await wait_live(redis_url, "listed")
    async with gateway(redis_url) as http:
        resp = await http.patch("/v1/models/listed/config",
                                json={"max_batch_size": 12, "max_queue_len": 50})
        assert resp.json()["overrides"] == {"max_batch_size": 12, "max_queue_len": 50}

        async def listed() -> dict[str, object]:
            models = (await http.get("/v1/models")).json()["models"]
            return next(m for m in models if m["name"] == "listed")

        for _ in range(60):
            meta = await listed()
            if meta["policy"]["max_batch_size"] == 12:  # type: ignore[index]
                break
            await asyncio.sleep(0.05)
        assert meta["policy"]["max_batch_size"] == 12  # type: ignore[index]
        assert meta["limits"]["max_queue_len"] == 50  # type: ignore[index]
        assert meta["defaults"]["max_batch_size"] == 32  # type: ignore[index]
        assert meta["defaults"]["hold_buckets"] is True  # type: ignore[index]
        shown = (await http.get("/v1/models/listed/config")).json()
        assert shown["overrides"] == {"max_batch_size": 12, "max_queue_len": 50}
        assert shown["effective"]["max_batch_size"] == 12
        dropped = await http.patch("/v1/models/listed/config", json={"max_queue_len": None})
        assert dropped.json()["overrides"] == {"max_batch_size": 12}
        assert dropped.json()["effective"]["max_queue_len"] is None
    assert model.policy.max_batch_size == 32  # the caller's Model is never changed


async def test_an_override_survives_a_worker_restart(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    first = Worker([recording("kept", [])], RedisSettings(redis_url), BEATING)
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    await wait_live(redis_url, "kept")
    async with Client(redis_url, require_workers=False) as client:
        await client.configure("kept", max_batch_size=6, batch_wait_timeout_s=0)
    stop.set()
    await asyncio.wait_for(task, 10)
    second = Worker([recording("kept", [])], RedisSettings(redis_url), BEATING)
    seen: list[BatchPolicy] = []
    second.on_serving = lambda: seen.append(second.runners[0].model.policy)
    start_worker_task = asyncio.create_task(second.run(stop := asyncio.Event()))
    try:
        await _until(lambda: bool(seen))
        assert (seen[0].max_batch_size, seen[0].batch_wait_timeout_s) == (6, 0.0)
    finally:
        stop.set()
        await asyncio.wait_for(start_worker_task, 10)


async def test_a_corrupted_stored_value_is_logged_and_ignored(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    raw_redis.hset(protocol.config_key("sturdy"), mapping={
        "max_batch_size": "lots", "stride_s": "-1", "batch_wait_timeout_s": "0.02"})
    caplog.set_level(logging.INFO, logger="redbatch.worker")
    worker = start_worker([recording("sturdy", [])])
    await wait_live(redis_url, "sturdy")
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict("sturdy", 7, timeout_s=10) == 7
    policy = worker.runners[0].model.policy
    assert (policy.max_batch_size, policy.stride_s, policy.batch_wait_timeout_s) == \
        (32, 0.0, 0.02)  # the good override applied, the bad ones ignored
    text = caplog.text
    assert "ignoring the stored knob override max_batch_size" in text
    assert "ignoring the stored knob override stride_s" in text
    assert "knob batch_wait_timeout_s: 0.05 -> 0.02" in text


def test_cli_sets_shows_and_resets(redis_url: str, raw_redis: redis.Redis,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    raw_redis.set(protocol.meta_key("clied"), orjson.dumps(recording("clied", []).meta()))
    url = ["--redis-url", redis_url]
    assert main(["config", "clied", "max_batch_size=8", "adaptive=false", *url]) == 0
    out = capsys.readouterr().out
    assert "max_batch_size" in out and "8  (override)" in out
    assert main(["config", "clied", "--json", *url]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert shown["overrides"] == {"max_batch_size": 8, "adaptive": False}
    assert main(["config", "clied", "max_batch_size=0", *url]) == 2  # bad: nothing stored
    assert main(["config", "clied", "max_batch_size=", *url]) == 0
    assert raw_redis.hgetall(protocol.config_key("clied")) == {b"adaptive": b"false"}
    assert main(["config", "clied", "--reset", "--json", *url]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["overrides"] == {}
    assert not raw_redis.exists(protocol.config_key("clied"))
    assert main(["config", "nobody", *url]) == 2


@pytest.mark.parametrize("name", ["max_batch_size", "batch_wait_timeout_s", "adaptive"])
def test_a_policy_refuses_none_for_a_knob_that_is_not_nullable(name: str) -> None:
    from redbatch import BatchPolicy

    with pytest.raises(InvalidKnob, match=f"{name}.* must be .*got None"):
        BatchPolicy(**{name: None})


async def test_buckets_change_live_and_only_for_a_variable_length_model(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    groups: list[list[int]] = []

    def lengths(items: list[Any]) -> list[int]:
        groups.append(sorted(len(x) for x in items))
        return [len(x) for x in items]

    tokens = TensorSpec("int64", (None,), max_len=64)
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.2)
    start_worker([Model("live-buckets", fn=lengths, spec=tokens, policy=policy),
                  recording("fixed-size", [])], config=BEATING)
    await wait_live(redis_url, "live-buckets")
    inputs = [np.zeros(n, np.int64) for n in (3, 60, 5, 33)]
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("live-buckets", inputs, timeout_s=10) == [3, 60, 5, 33]
        assert sorted(groups) == [[3], [5], [33, 60]]  # powers of two: 4, 8, 64
        answer = await client.configure("live-buckets", buckets=[64])
        assert answer["effective"]["buckets"] == [64]
        await asyncio.sleep(2.0)  # applied within 2 s
        groups.clear()
        assert await client.predict_many("live-buckets", inputs, timeout_s=10) == [3, 60, 5, 33]
        assert groups == [[3, 5, 33, 60]]  # one bucket: one pass
        with pytest.raises(InvalidKnob, match="variable-length"):
            await client.configure("fixed-size", buckets=[8])
        with pytest.raises(InvalidKnob, match="increase strictly"):
            await client.configure("live-buckets", buckets=[16, 8])
