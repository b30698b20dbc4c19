"""The shard curve's arithmetic (``redbatch/bench/shards.py``): items and Redis CPU
per primary from the rounds, and the slot ranges a cluster is formed with."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from redbatch.bench import cluster, redis_cost, shards
from redbatch.bench.run import main as bench_main

TWO = shards.Shards(2, (7001, 7002), "redis+cluster://127.0.0.1:7001",
                    {"noop0": 7001, "noop1": 7001, "noop2": 7001, "noop3": 7002,
                     "noop4": 7002, "noop5": 7002})


def a_round(per_model: int, cpu_s: tuple[float, float], calls: tuple[float, float]
            ) -> dict[str, Any]:
    return {"counts": dict.fromkeys(shards.MODELS, per_model), "elapsed_s": 2.0,
            "spent": {port: {redis_cost.CPU_S: cpu, shards.CALLS: n}
                      for port, cpu, n in zip(TWO.ports, cpu_s, calls, strict=True)}}


def test_each_primary_is_charged_for_the_items_of_its_own_models() -> None:
    fig = shards.summary(TWO, [a_round(100, (0.003, 0.006), (600, 900)),
                               a_round(300, (0.009, 0.018), (1800, 2700))])
    assert fig["items_per_s"] == pytest.approx(2400 / 4.0)
    assert fig["rounds_items_per_s"] == [300.0, 900.0]
    first, second = fig["nodes"]["7001"], fig["nodes"]["7002"]
    assert first["items"] == second["items"] == 1200
    assert first["cpu_us_per_item"] == pytest.approx(10.0)
    assert second["cpu_us_per_item"] == pytest.approx(20.0)
    assert second["commands_per_item"] == pytest.approx(3.0)
    assert first["busy"] == pytest.approx(0.012 / 4.0)
    assert fig["redis_cpu_us_per_item"] == pytest.approx(0.036 * 1e6 / 2400)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_the_slot_ranges_cover_every_slot_once(count: int) -> None:
    ranges = cluster.slot_ranges(count)
    assert ranges[0][0] == 0 and ranges[-1][1] == cluster.SLOTS - 1
    assert all(end + 1 == nxt for (_, end), (nxt, _) in itertools.pairwise(ranges))
    sizes = [end - start + 1 for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_the_bench_offers_the_shard_curve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    assert "--shards" in capsys.readouterr().out
