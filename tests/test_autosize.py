"""Batch size by measurement (``auto_batch``): the learner picks, per length bucket, the
pass size that gives the most items/s within the pass-time budget; the forward step
cuts each bucket's passes at it; the sizes show in the counters, the metrics and
``redbatch status``; off (the default), nothing changes."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pytest
import redis
from prometheus_client import REGISTRY
from rich.console import Console

from redbatch import TensorSpec, protocol, status, status_view
from redbatch.errors import InvalidKnob
from redbatch.knobs import check
from redbatch.producer import Client
from redbatch.worker import autosize, forward
from redbatch.worker.autosize import AutoSizer, Curve, slot
from redbatch.worker.forward import Forwarder
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.stats import WorkerStats
from tests.conftest import wait_live

Cost = Callable[[int, int], float]  # (items, bucket length) -> pass ms


def run_learner(sizer: AutoSizer, buckets: dict[int | None, int], cost: Cost, cap: int,
                rounds: int, noise: float = 0.0, seed: int = 0) -> list[int]:
    """``rounds`` batches of ``buckets[b]`` items per bucket, each bucket cut into
    passes of the size the learner picks and each pass timed by ``cost`` (times a
    random factor within ``1 +- noise``); the sizes picked, in order."""
    rng, picked = random.Random(seed), []
    for _ in range(rounds):
        for bucket, items in buckets.items():
            size = sizer.size(bucket, cap)
            picked.append(size)
            for start in range(0, items, size):
                n = min(size, items - start)
                ms = cost(n, bucket or 1) * (1 + noise * (2 * rng.random() - 1))
                sizer.observe(bucket, n, ms)
    return picked


def linear(a: float, b: float) -> Cost:
    """Pass time a + b x items x length: a per-pass overhead and a cost per token."""
    return lambda n, length: a + b * n * length


def superlinear(b: float, power: float) -> Cost:
    """Pass time b x (items x length) ** power: each item costs more the more share
    the pass (attention over long padded rows on a CPU)."""
    return lambda n, length: b * (n * length) ** power


# --- the learner ---------------------------------------------------------------------
def test_overhead_per_pass_makes_the_cap_the_best_size() -> None:
    sizer = AutoSizer(seed=1)
    run_learner(sizer, {16: 64}, linear(5.0, 0.001), cap=32, rounds=300)
    assert sizer.sizes() == {"16": 32}


def test_superlinear_cost_makes_batch_one_the_best_size() -> None:
    sizer = AutoSizer(seed=2)
    picked = run_learner(sizer, {512: 32}, superlinear(0.002, 1.3), cap=32, rounds=400)
    assert sizer.sizes() == {"512": 1}
    assert picked[0] == 32  # it starts at the cap
    assert picked[-100:].count(1) >= 80  # and then sticks to 1, exploring now and then


def test_each_bucket_learns_its_own_size() -> None:
    """Short rows gain from batching, long ones lose: both in one worker."""
    def cost(n: int, length: int) -> float:
        return linear(2.0, 0.001)(n, length) if length <= 16 else superlinear(
            0.002, 1.3)(n, length)

    sizer = AutoSizer(seed=3)
    run_learner(sizer, {8: 40, 16: 40, 256: 40}, cost, cap=32, rounds=500, noise=0.1)
    assert sizer.sizes() == {"8": 32, "16": 32, "256": 1}


def test_an_interior_optimum_is_found() -> None:
    """Overhead plus a quadratic term: items/s peaks at 8 (of 1, 2, 4, ..., 32)."""
    def cost(n: int, _length: int) -> float:
        return 2.0 + 0.25 * n + 0.03 * n * n  # items/s at 16: 87 % of 8's

    sizer = AutoSizer(seed=4)
    run_learner(sizer, {None: 64}, cost, cap=32, rounds=600, noise=0.05)
    assert sizer.sizes() == {"all": 8}
    best = max((1, 2, 4, 8, 16, 32), key=lambda n: n / cost(n, 1))
    assert best == 8


def test_the_pass_time_budget_bounds_the_size() -> None:
    """Bigger is faster here, but a pass of 16 takes 36 ms, over a 30 ms budget."""
    sizer = AutoSizer(seed=5, budget_ms=30.0)
    run_learner(sizer, {None: 64}, lambda n, _l: 20.0 + n, cap=32, rounds=400)
    assert sizer.sizes() == {"all": 8}
    unbounded = AutoSizer(seed=5)
    run_learner(unbounded, {None: 64}, lambda n, _l: 20.0 + n, cap=32, rounds=400)
    assert unbounded.sizes() == {"all": 32}


def test_size_one_is_allowed_even_over_the_budget() -> None:
    sizer = AutoSizer(seed=6, budget_ms=1.0)
    run_learner(sizer, {64: 8}, lambda n, _l: 10.0 * n, cap=8, rounds=200)
    assert sizer.sizes() == {"64": 1}


def test_the_cap_before_warmup_and_always_above() -> None:
    sizer = AutoSizer(seed=7, explore_every=0)
    for _ in range(autosize.WARMUP_PASSES):
        assert sizer.size(8, 32) == 32  # today's behaviour until measured
        sizer.observe(8, 32, 40.0)
    for _ in range(autosize.SLOT_PASSES):
        sizer.observe(8, 4, 1.0)  # far better per item
    assert sizer.size(8, 32) == 4
    assert sizer.size(8, 2) == 2  # max_batch_size lowered live: a cap
    assert sizer.sizes() == {"8": 2}
    sizer.forget()
    assert sizer.sizes() == {} and sizer.curve(8) is not None


def test_a_pass_counts_for_its_size_rounded_up_with_its_own_items() -> None:
    assert [slot(n) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
    curve = Curve()
    curve.add(3, 6.0)
    assert curve.items == {4: 3.0} and curve.ms == {4: 6.0}
    curve.add(4, 10.0)
    assert curve.items == {4: 3.5} and curve.ms == {4: 8.0}  # medians


def test_a_pass_slowed_by_another_process_moves_no_choice() -> None:
    """Passes of 32 take 10 ms, of 1 2 ms; two passes of 32 that waited for the core
    (200 ms) do not make batch 1 look better, nor put batch 32 over the budget."""
    sizer = AutoSizer(explore_every=0)
    for _ in range(5):
        sizer.observe(None, 32, 10.0)
        sizer.observe(None, 1, 2.0)
    sizer.observe(None, 32, 200.0)
    sizer.observe(None, 32, 200.0)
    assert sizer.size(None, 32) == 32


def test_exploration_is_rare_seeded_and_tries_the_neighbours() -> None:
    def picks(seed: int) -> list[int]:
        sizer = AutoSizer(seed=seed)
        for _ in range(autosize.WARMUP_PASSES):
            sizer.observe(None, 8, 8.0)
        for _ in range(autosize.SLOT_PASSES):
            sizer.observe(None, 4, 8.0)
            sizer.observe(None, 16, 8.0)  # 16 is best
            sizer.observe(None, 32, 80.0)
        return [sizer.size(None, 32) for _ in range(1600)]

    first = picks(11)
    assert first == picks(11)  # seeded: the same choices
    assert set(first) == {16, 8, 32}
    explored = len(first) - first.count(16)
    assert 50 <= explored <= 150  # about 1 in 16 (100)
    none = AutoSizer(explore_every=0)
    for _ in range(autosize.WARMUP_PASSES):
        none.observe(None, 8, 8.0)
    for _ in range(autosize.SLOT_PASSES):
        none.observe(None, 16, 20.0)  # measured, and worse
    assert {none.size(None, 32) for _ in range(200)} == {8}


def test_sizes_above_the_largest_measured_are_not_ruled_out_while_it_is_the_best() -> None:
    """A bucket whose claims brought it one item at a time: nothing says batching does
    not pay, so its cut is the cap, within the pass budget (10 ms x 8 fits 100 ms, x 16
    does not); a curve that still rose into its largest size grows the same way, and
    so does one that flattened (its largest size ties with the best); one that fell
    stays at its best measured size."""
    lone, slow = AutoSizer(explore_every=0), AutoSizer(explore_every=0)
    for _ in range(autosize.WARMUP_PASSES):
        lone.observe(8, 1, 0.3)
        slow.observe(8, 1, 10.0)
    assert lone.size(8, 32) == 32 and lone.size(8, 24) == 24 and slow.size(8, 32) == 8
    sizers = {name: AutoSizer(explore_every=0) for name in ("rising", "flat", "falling")}
    for size, times in ((1, (1.0, 1.0, 1.0)), (2, (1.4, 1.9, 1.5)), (4, (2.0, 3.7, 3.5))):
        for _ in range(autosize.WARMUP_PASSES):
            for sizer, ms in zip(sizers.values(), times, strict=True):
                sizer.observe(64, size, ms)
    assert sizers["rising"].size(64, 32) == 32  # 2 items/ms at 4 against 1.43 at 2
    assert sizers["flat"].size(64, 32) == 32  # 1.08 against 1.05: a tie, 4 the largest
    assert sizers["falling"].size(64, 32) == 2  # 1.14 at 4 against 1.33 at 2


def test_a_tie_goes_to_the_larger_size_and_a_clear_loss_does_not() -> None:
    """Items/s within 5 % of the best: the larger size wins; 9 % less: it does not."""
    for at_8, want in ((9.9, 8), (10.5, 4)):  # 0.808 items/ms at 8: 97 % of 4's
        sizer = AutoSizer(explore_every=0)
        for _ in range(autosize.WARMUP_PASSES):
            sizer.observe(None, 4, 4.8)  # 0.833 items/ms
            sizer.observe(None, 8, at_8)
            sizer.observe(None, 16, 40.0)  # clearly worse: no growth past 8
        assert sizer.size(None, 32) == want


def test_noisy_passes_of_a_short_bucket_rarely_cut_it_below_its_best() -> None:
    """W3's bucket 32 on a shared CPU: pass time 0.195 + 0.139 n ms (its anchors'
    batch 1 and 32), each pass spread by a log-normal 20 %, claims of 4 to 12 items.
    Cut at 8, a pass is at 89 % of batch 32's items/s: below the 95 % target.  With the
    medians of the last 25 passes per size, 8 is the choice in under a fifth of the
    rounds (medians of 9 made it a third: the test fails with RECENT = 9)."""
    def ms(n: int) -> float:
        return 0.195 + 0.139 * n

    missed = counted = 0
    for seed in range(6):
        rng, sizer = random.Random(seed), AutoSizer(seed=seed)
        for r in range(400):
            items, size = rng.randint(4, 12), sizer.size(32, 32)
            for start in range(0, items, size):
                n = min(size, items - start)
                sizer.observe(32, n, ms(n) * math.exp(rng.gauss(0.0, 0.2)))
            if r >= 50:
                counted += 1
                missed += sizer.target(32, 32) < 16
    assert missed / counted < 0.2


def test_a_size_measured_once_or_twice_neither_wins_nor_holds_the_cut_back() -> None:
    """Passes of 1 item in bucket 8, and two of 2 items, the first of which allocated
    for the new shape (slow): 2 does not count yet, so the cut still grows; a third
    pass of 2 makes it count (its median, 1.2 ms: 1.67 items/ms, 2.5x size 1's)."""
    sizer = AutoSizer(explore_every=0)
    for _ in range(autosize.WARMUP_PASSES):
        sizer.observe(8, 1, 1.5)
    sizer.observe(8, 2, 30.0)
    sizer.observe(8, 2, 1.2)
    assert sizer.size(8, 32) == 32
    lucky = AutoSizer(explore_every=0)
    for _ in range(autosize.WARMUP_PASSES):
        lucky.observe(8, 1, 1.5)
    lucky.observe(8, 4, 0.5)  # one fast pass of 4 alone: no evidence yet
    lucky.observe(8, 1, 1.5)
    assert lucky.curve(8) is not None and lucky.curve(8).measured == [1]  # type: ignore[union-attr]
    sizer.observe(8, 2, 1.2)
    assert sizer.curve(8).measured == [1, 2]  # type: ignore[union-attr]
    assert sizer.size(8, 32) == 32  # 2 is the best measured, and the largest: it grows


def test_an_unmeasured_neighbour_is_explored_first() -> None:
    sizer = AutoSizer(seed=0, explore_every=1)  # explore every time
    for _ in range(autosize.WARMUP_PASSES):
        sizer.observe(None, 8, 8.0)
    for _ in range(autosize.SLOT_PASSES):
        sizer.observe(None, 16, 100.0)  # measured, and worse
    assert {sizer.size(None, 32) for _ in range(50)} == {4}


# --- the forward step ----------------------------------------------------------------
SPEC = TensorSpec("int64", (None,), max_len=64)


def recording(policy: BatchPolicy, passes: list[tuple[int, int]]) -> Model:
    """A list model over token ids (sum of each), noting (longest, items) per pass."""
    def fn(items: list[Any]) -> list[int]:
        passes.append((max(len(x) for x in items), len(items)))
        return [int(np.asarray(x).sum()) for x in items]

    return Model("rec", fn=fn, policy=policy, spec=SPEC)


async def run_forward(model: Model, inputs: list[Any], sizer: AutoSizer | None = None
                      ) -> tuple[list[Any], Forwarder]:
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor, sizer=sizer)
        return await fwd.run_batches(inputs), fwd


def trained(bucket: int, best: int) -> AutoSizer:
    """A learner that has measured ``best`` as by far the best size of ``bucket``."""
    sizer = AutoSizer(explore_every=0)
    for size in (1, 2, 4, 8, 16, 32):
        for _ in range(autosize.WARMUP_PASSES):
            sizer.observe(bucket, size, 1.0 if size == best else 100.0)
    return sizer


@pytest.mark.parametrize(("best", "passes"), [(4, [4, 4, 4]), (1, [1] * 12),
                                              (32, [12])])
async def test_a_bucket_runs_in_passes_of_the_chosen_size(best: int, passes: list[int]
                                                          ) -> None:
    seen: list[tuple[int, int]] = []
    model = recording(BatchPolicy(max_batch_size=32, auto_batch=True), seen)
    inputs = [np.arange(1, 31 + i % 2) for i in range(12)]  # bucket 32
    outputs, fwd = await run_forward(model, inputs, trained(32, best))
    assert outputs == [int(x.sum()) for x in inputs]
    assert fwd.take_passes() == passes
    assert [n for _len, n in seen] == passes


async def test_off_by_default_passes_are_max_batch_size_and_nothing_is_learned() -> None:
    assert BatchPolicy().auto_batch is False
    seen: list[tuple[int, int]] = []
    model = recording(BatchPolicy(max_batch_size=4), seen)
    sizer = trained(32, 1)
    sizer.chosen.clear()
    inputs = [np.arange(1, 31) for _ in range(12)]
    outputs, fwd = await run_forward(model, inputs, sizer)
    assert outputs == [int(x.sum()) for x in inputs]
    assert fwd.take_passes() == [4, 4, 4]
    assert sizer.sizes() == {} and sizer.curve(32).passes == 6 * autosize.WARMUP_PASSES


async def test_passes_are_measured_and_a_failed_one_is_not() -> None:
    def fn(items: list[Any]) -> list[int]:
        if any(int(x[0]) < 0 for x in items):
            raise ValueError("negative")
        return [len(x) for x in items]

    model = Model("m", fn=fn, policy=BatchPolicy(max_batch_size=8, auto_batch=True),
                  spec=SPEC)
    sizer = AutoSizer(explore_every=0)
    good = [np.arange(1, 5) for _ in range(8)]  # bucket 4
    await run_forward(model, good, sizer)
    curve = sizer.curve(4)
    assert curve is not None and curve.passes == 1 and set(curve.ms) == {8}
    outputs, _fwd = await run_forward(model, [np.array([-1, 2, 3, 4]), *good[:7]], sizer)
    assert isinstance(outputs[0], Exception) and outputs[1:] == [4] * 7
    assert curve.passes == 1  # the bisected pass taught nothing


async def test_with_a_cost_budget_the_chosen_size_caps_the_items_too() -> None:
    seen: list[tuple[int, int]] = []
    model = recording(BatchPolicy(max_batch_size=32, max_batch_cost=32 * 6,
                                  auto_batch=True), seen)
    inputs = [np.arange(1, 31) for _ in range(12)]  # cost 32 each: 6 per pass by cost
    _outputs, fwd = await run_forward(model, inputs, trained(32, 4))
    assert fwd.take_passes() == [4, 4, 4]
    _outputs, fwd = await run_forward(model, inputs, trained(32, 32))
    assert fwd.take_passes() == [6, 6]


def test_counters_and_gauge_show_the_sizes_only_while_chosen() -> None:
    stats = WorkerStats("autosize_gauge", 32)
    assert "auto_sizes" not in stats.counters()
    for _ in range(autosize.WARMUP_PASSES):
        stats.sizer.observe(256, 1, 1.0)
        stats.sizer.observe(256, 2, 3.0)  # worse: batch 1 is best
    stats.sizer.explore_every = 0
    stats.sizer.size(256, 32)
    stats.sizer.size(None, 32)  # not warmed up: the cap
    assert stats.counters()["auto_sizes"] == {"all": 32, "256": 1}

    def gauge(bucket: str) -> float | None:
        return REGISTRY.get_sample_value("redbatch_auto_batch_size",
                                         {"model": "autosize_gauge", "bucket": bucket})

    assert (gauge("256"), gauge("all")) == (1.0, 32.0)
    stats.sizer.forget()
    assert "auto_sizes" not in stats.counters()
    assert gauge("256") is None


def test_knob_and_policy() -> None:
    assert check("auto_batch", True) is True
    with pytest.raises(InvalidKnob, match="true or false"):
        check("auto_batch", 1)
    policy = BatchPolicy.from_mapping({"auto_batch": True, "max_batch_size": 8})
    assert policy.auto_batch and policy.to_json()["auto_batch"] is True


def test_status_shows_the_sizes_per_bucket() -> None:
    workers = [{"worker_id": "a", "auto_sizes": {"8": 32, "256": 1}},
               {"worker_id": "b", "auto_sizes": {"8": 16, "256": 1}}, {"worker_id": "c"}]
    assert status.auto_sizes(workers) == {"8": "16-32", "256": "1"}
    on = status.ModelStatus("txt", 0, 0, knobs={"max_batch_size": 32, "auto_batch": True,
                                                "batch_wait_timeout_s": 0.005},
                            auto_sizes={"8": "32", "256": "1"})
    off = status.ModelStatus("mlp", 0, 0, knobs={"max_batch_size": 32,
                                                 "batch_wait_timeout_s": 0.005})
    console = Console(width=400, record=True)
    console.print(status_view.table({"txt": on, "mlp": off}))
    text = console.export_text()
    assert status_view.AUTO_COLUMN in text and "8:32 256:1" in text
    assert "auto 32 / 5.0 ms" in text
    console = Console(width=400, record=True)
    console.print(status_view.table({"mlp": off}))
    assert status_view.AUTO_COLUMN not in console.export_text()


# --- end to end ----------------------------------------------------------------------
def timed(passes: list[tuple[int, int]]) -> Model:
    """Pass time known: short rows (bucket 8) 10 ms + 0.1 ms per item (batching pays),
    long rows (bucket 64) 2 ms x items squared (it does not)."""
    def fn(items: list[Any]) -> list[int]:
        longest = max(len(x) for x in items)
        n = len(items)
        time.sleep((0.010 + 0.0001 * n) if longest <= 8 else 0.002 * n * n)
        passes.append((longest, n))
        return [int(np.asarray(x).sum()) for x in items]

    policy = BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.02, auto_batch=True)
    return Model("autotimed", fn=fn, policy=policy, spec=SPEC)


async def test_a_worker_learns_batch_8_for_short_rows_and_1_for_long_ones(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis
        ) -> None:
    passes: list[tuple[int, int]] = []
    worker = start_worker([replace(timed(passes), name="autotimed")])
    await wait_live(redis_url, "autotimed")
    sizer = worker.runners[0].stats.sizer
    sizer.explore_every = 2  # learn in a few rounds
    rng = random.Random(5)
    # one length per bucket: each side travels as one multi-row entry, so that a
    # claim of 2 entries holds both
    short = [[rng.randrange(1, 100) for _ in range(8)] for _ in range(8)]
    long = [[rng.randrange(1, 100) for _ in range(64)] for _ in range(8)]
    deadline = time.monotonic() + 40
    async with Client(redis_url) as client:
        while sizer.sizes() != {"8": 8, "64": 1}:
            assert time.monotonic() < deadline, f"learned only {sizer.sizes()}"
            outs = await asyncio.gather(client.predict_many("autotimed", short, timeout_s=20),
                                        client.predict_many("autotimed", long, timeout_s=20))
            assert outs == [[sum(x) for x in short], [sum(x) for x in long]]
        sizer.explore_every = 0
        passes.clear()
        outs = await asyncio.gather(client.predict_many("autotimed", short, timeout_s=20),
                                    client.predict_many("autotimed", long, timeout_s=20))
    assert outs == [[sum(x) for x in short], [sum(x) for x in long]]
    assert sorted(passes) == [(8, 8)] + [(64, 1)] * 8
    await _published(raw_redis, {"8": 8, "64": 1})
    assert status.read_model(raw_redis, "autotimed").auto_sizes == {"8": "8", "64": "1"}


async def _published(client: redis.Redis, sizes: dict[str, int]) -> None:
    """Wait for a heartbeat to publish ``sizes`` in the worker's info."""
    for _ in range(100):
        infos = [orjson.loads(v) for v in client.hvals(protocol.worker_info_key("autotimed"))]
        if infos and infos[0].get("auto_sizes") == sizes:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"the heartbeat never published {sizes}")


def test_turning_auto_batch_off_live_clears_the_shown_sizes() -> None:
    import redis.asyncio as aioredis

    from redbatch import batch
    from redbatch.worker.runner import BatchRunner

    model = batch(name="autosize_off", auto_batch=True)(lambda xs: xs)
    with ThreadPoolExecutor(1) as pool:
        runner = BatchRunner(aioredis.Redis(port=1), model, model.fn, "w", pool, 1.0)
        sizer = runner.stats.sizer
        for _ in range(autosize.WARMUP_PASSES):
            sizer.observe(None, 1, 1.0)
        sizer.size(None, 32)
        assert sizer.chosen
        model.policy = replace(model.policy, auto_batch=False)
        runner._use_policy()  # what the next claim does
        assert not sizer.chosen and "auto_sizes" not in runner.stats.counters()


def _busy(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("one_thread", [True, False])
async def test_a_one_thread_cpu_pass_is_timed_by_its_cpu_time(
        monkeypatch: pytest.MonkeyPatch, one_thread: bool) -> None:
    """With one intra-op thread a pass mostly on the CPU counts its thread's CPU time
    (here 30 ms computed, 10 ms off the core, as a pass descheduled by another process
    is); with more threads, its wall time.  A pass mostly off the CPU (it slept, or
    waited on I/O) counts its wall time either way."""
    def fn(items: list[Any]) -> list[int]:
        if len(items[0]) > 4:
            time.sleep(0.05)
        else:
            _busy(0.03)
            time.sleep(0.01)
        return [len(x) for x in items]

    monkeypatch.setattr(forward, "_one_thread", lambda: one_thread)
    model = Model("m", fn=fn, policy=BatchPolicy(max_batch_size=8, auto_batch=True),
                  spec=SPEC)
    sizer = AutoSizer(explore_every=0)
    await run_forward(model, [np.arange(1, 5) for _ in range(8)], sizer)
    await run_forward(model, [np.arange(1, 9) for _ in range(8)], sizer)
    computed, slept = sizer.curve(4), sizer.curve(8)
    assert computed is not None and slept is not None
    assert (computed.ms[8] < 38) if one_thread else (computed.ms[8] >= 40)
    assert slept.ms[8] >= 50


async def test_a_short_pass_is_cpu_timed_however_long_its_hand_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of 2 ms of CPU whose result the event loop picks up 30 ms later (the loop
    was busy, as with a gateway and Redis on the same cores): the share of the CPU is
    read against the call's own wall time in its thread, so it counts its 2 ms."""
    def fn(items: list[Any]) -> list[int]:
        _busy(0.002)
        return [len(x) for x in items]

    async def block_the_loop() -> None:
        await asyncio.sleep(0)
        time.sleep(0.03)

    monkeypatch.setattr(forward, "_one_thread", lambda: True)
    model = Model("m", fn=fn, policy=BatchPolicy(max_batch_size=8, auto_batch=True),
                  spec=SPEC)
    sizer = AutoSizer(explore_every=0)
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor, sizer=sizer)
        assert not fwd.inline  # no pass yet: the first runs in the thread
        blocker = asyncio.create_task(block_the_loop())
        await fwd.run_batches([np.arange(1, 5) for _ in range(8)])
        await blocker
    curve = sizer.curve(4)
    assert curve is not None and fwd.pass_ms is not None and fwd.pass_ms >= 25
    assert curve.ms[8] < 10
