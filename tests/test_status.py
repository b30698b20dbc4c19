"""`redbatch status`: per-model figures read from Redis and the workers' heartbeats."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable

import pytest
import redis
from rich.console import Console

from redbatch import Client, protocol, status_view
from redbatch.status import HISTS, ModelStatus, quantile, sample
from redbatch.worker.model import batch
from redbatch.worker.process import Worker
from tests.conftest import free_port, redbatch_cmd, test_env


@batch(name="tripler", max_batch_size=8, batch_wait_timeout_s=0.005)
def tripler(xs: list[int]) -> list[int]:
    return [3 * x for x in xs]


def test_quantile_interpolates_within_buckets() -> None:
    bounds = (1.0, 2.0, 4.0)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(1.5)
    assert quantile(0.99, bounds, [10, 0, 0, 0]) == pytest.approx(0.99)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 4.0  # +Inf: the last finite bound
    assert quantile(0.5, bounds, [10, 0, 0, 0], upper=True) == 1.0  # batch sizes: bounds


def test_rate_counts_only_workers_seen_twice() -> None:
    from redbatch.status import _served

    before = [{"worker_id": "a", "items": 100}, {"worker_id": "gone", "items": 900}]
    after = [{"worker_id": "a", "items": 160}, {"worker_id": "new", "items": 50}]
    assert _served(before, after) == 60


async def test_status_reads_queues_workers_and_distributions(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([tripler])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("tripler", list(range(40))) == [3 * i for i in
                                                                        range(40)]
        raw_redis.rpush(protocol.dead_letter_key("tripler"), b"junk")
        stop = asyncio.Event()
        load = asyncio.create_task(_keep_busy(client, stop))
        snap = await asyncio.to_thread(sample, raw_redis, 1.5)
        stop.set()
        await load  # not cancelled mid-command: it finishes its last call
    s = snap["tripler"]
    assert 0 <= s.queue_depth <= 16 and s.dead_letters == 1  # the load has 16 in flight
    assert len(s.workers) == 1 and s.workers[0]["device"] == "cpu"
    assert s.items >= 40 and 1 <= s.mean_batch <= 8
    assert s.items_per_s is not None and s.items_per_s > 0
    assert s.batch_size_p50 is not None and 1 <= s.batch_size_p50 <= max(HISTS["batch_size"])
    assert s.forward_ms_p99 is not None and s.queue_wait_ms_p50 is not None
    assert sum(s.batch_sizes.values()) == s.workers[0]["passes"] == s.passes
    assert s.entries_p50 is not None and 1 <= s.mean_entries <= 8


async def _keep_busy(client: Client, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await client.predict_many("tripler", list(range(16)))


def test_cli_prints_json_and_a_table(redis_url: str, raw_redis: redis.Redis) -> None:
    raw_redis.zadd(protocol.MODELS_KEY, {"idle": 0})
    raw_redis.rpush(protocol.queue_key("idle"), b"x", b"y")
    args = ["status", "--redis-url", redis_url, "--interval-s", "0.1"]
    out = subprocess.run(redbatch_cmd(*args, "--json"), capture_output=True, text=True,
                         env=test_env(), timeout=30, check=True).stdout
    (idle,) = json.loads(out)["models"]
    assert idle["model"] == "idle" and idle["queue_depth"] == 2 and idle["workers"] == []
    table = subprocess.run(redbatch_cmd(*args), capture_output=True, text=True,
                           env={**test_env(), "COLUMNS": "200"}, timeout=30, check=True).stdout
    assert "idle" in table and "queue wait p50 / p99" in table


def test_cli_without_redis_fails_with_a_message() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    done = subprocess.run(redbatch_cmd("status", "--redis-url", dead), check=False,
                          capture_output=True,
                          text=True, env=test_env(), timeout=30)
    assert done.returncode == 2 and "cannot read redis" in done.stderr


def test_the_table_shows_every_live_change() -> None:
    """Knobs changed live that no other column shows (cost budget, buckets, queue cap)
    get a column of their own; the starred columns show the others."""
    changed = ModelStatus("m", 0, 0, knobs={"max_batch_size": 16, "batch_wait_timeout_s": 0.01},
                          overrides={"max_batch_size": 16, "max_batch_cost": 4096,
                                     "buckets": [8, 64, 512], "max_queue_len": 100})
    plain = ModelStatus("p", 0, 0)
    console = Console(width=400, record=True)
    console.print(status_view.table({"m": changed, "p": plain}))
    text = console.export_text()
    assert status_view.LIVE_COLUMN in text and "16* / 10.0 ms" in text
    assert "buckets=[8, 64, 512] max_batch_cost=4096 max_queue_len=100" in text
    assert "max_batch_size=" not in text
    console = Console(width=400, record=True)
    console.print(status_view.table({"p": plain}))
    assert status_view.LIVE_COLUMN not in console.export_text()
    off = ModelStatus("o", 0, 0, knobs={"auto_batch": False},
                      overrides={"auto_batch": False})
    assert status_view._live(off) == "auto_batch=false"  # the batching column shows no "auto"


def test_status_leaves_out_a_model_whose_keys_are_odd_and_shows_the_rest(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Data written by something else (a worker's info that is no JSON object, counters
    that are no numbers, metadata that is no object, knobs of the wrong type) made
    ``redbatch status`` end in a traceback."""
    now = protocol.now_ms()
    raw_redis.zadd(protocol.MODELS_KEY, {"fine": 0, "badinfo": 0, "badcount": 0,
                                         "badmeta": 0, "badknob": 0})
    for model in ("badinfo", "badcount"):
        raw_redis.zadd(protocol.workers_key(model), {"w1": now + 60_000})
    raw_redis.hset(protocol.worker_info_key("badinfo"), "w1", "not json")
    raw_redis.hset(protocol.worker_info_key("badcount"), "w1",
                   '{"worker_id": "w1", "batches": "abc", "items_per_s": "x"}')
    raw_redis.set(protocol.meta_key("badmeta"), "[1]")
    raw_redis.set(protocol.meta_key("badknob"), '{"name": "badknob", "policy": '
                  '{"max_batch_size": 8, "batch_wait_timeout_s": "5"}}')
    args = ["status", "--redis-url", redis_url, "--interval-s", "0.1"]
    result = subprocess.run(redbatch_cmd(*args, "--json"), capture_output=True, text=True,
                            env=test_env(), timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    shown = {m["model"]: m for m in json.loads(result.stdout)["models"]}
    assert {"fine", "badinfo", "badknob"} <= set(shown)
    assert "badcount" not in shown and "badmeta" not in shown
    assert "left out" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("model 'badmeta' left out") == 1  # (was: once per sample)
    table = subprocess.run(redbatch_cmd(*args), capture_output=True, text=True,
                           env={**test_env(), "COLUMNS": "200"}, timeout=30, check=False)
    assert table.returncode == 0 and "badknob" in table.stdout, table.stderr


def test_the_table_keeps_model_names_whole_on_a_narrow_output() -> None:
    """Printed to a pipe (80 columns), names came out as ``dou…``: a grep of the output
    for a model found nothing."""
    names = ["doubler", "a-rather-long-model-name@12"]
    console = Console(width=80, record=True)
    console.print(status_view.table({n: ModelStatus(n, 0, 0) for n in names}))
    text = console.export_text()
    assert all(name in text for name in names), text
