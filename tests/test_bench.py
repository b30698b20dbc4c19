"""The benchmark suite's own plumbing (the figures themselves come from `redbatch bench`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import pytest

from redbatch.bench import redis_cost, run, w3
from redbatch.bench.servers import cpu_seconds


def test_cpu_seconds_counts_this_process() -> None:
    before = cpu_seconds([os.getpid()])
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds([os.getpid()]) - before >= 0.15
    assert cpu_seconds([2**22 + 7]) == 0.0  # a process that is gone counts nothing


def _case(rps: float, p50_us: float) -> dict[str, Any]:
    c = {"rps": rps, "lat_p50_us": p50_us, "lat_p99_us": 2 * p50_us, "errors": 0,
         "server_cpu_ms_per_request": 0.25}
    return {"c64": c, "c1": c, "batching": {"mean_batch": 20.0, "fill_ratio": 0.625,
                                             "forward_ms_per_batch": 1.0,
                                             "queue_wait_ms_per_entry": 2.0,
                                             "items_per_entry": 1.5}}


def test_report_compares_with_each_baseline_of_the_run(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    res = {"redbatch_w1": _case(6000, 1000), "naive_w1": _case(5000, 500),
           "redbatch_w2": _case(4000, 1500), "naive_w2": _case(2000, 500),
           "ray_w2": _case(400, 12000),
           "bare_model": {"batch32_items_per_s": 28000.0, "batch1_items_per_s": 8000.0},
           "producer": {"1 replica": {"predict": 14000.0, "predict_many": 16800.0},
                        "2 replicas": {"predict": 11200.0, "predict_many": 21000.0}}}
    res["redbatch_w2"]["c64"] = {**res["redbatch_w2"]["c64"], "redis_cpu_us_per_request": 37.04}
    res["producer_redis"] = {"1 replica": {"predict": {"redis_cpu_us_per_item": 23.0},
                                           "predict_many": {"redis_cpu_us_per_item": 2.5}}}
    run.report(res)
    out = capsys.readouterr().out
    assert "   0.250      37.0      0" in out  # redbatch_w2: Redis µs per request
    assert "   0.250         -      0" in out  # the naive server: no Redis
    assert "1 replica   Redis CPU per item: predict x64 23.0 µs; predict_many 8x128 2.5 µs" in out
    assert "w1: throughput x1.20 of naive; p50@1 +0.50 ms" in out
    assert "w2: throughput x10.00 of ray; p50@1 -10.50 ms" in out
    assert "ray_w1" not in out  # not measured in this run: no row, no ratio
    assert "1 replica   predict x64 14000 (50%); predict_many 8x128 16800 (60%)" in out
    assert "2 replicas  predict x64 11200 (40%); predict_many 8x128 21000 (75%)" in out


def _wrk_result(rps: float, p50_us: float, errors: int = 0) -> dict[str, Any]:
    return {"requests": int(rps * 2), "duration_us": 2_000_000, "rps": rps,
            "lat_p50_us": p50_us, "lat_p99_us": 3 * p50_us, "err_read": errors,
            "errors": errors, "cpu_s": rps * 2 * 0.0001}


def test_merge_adds_up_rounds_and_takes_median_latencies() -> None:
    merged = run.merge([_wrk_result(1000, 900), _wrk_result(3000, 500, 2),
                        _wrk_result(2000, 700)])
    assert merged["requests"] == 12000 and merged["duration_us"] == 6_000_000
    assert merged["rps"] == pytest.approx(2000)  # all requests over all the time
    assert merged["rps_rounds"] == [1000, 3000, 2000]
    assert merged["lat_p50_us"] == 700 and merged["lat_p99_us"] == 2100
    assert merged["errors"] == 2 and merged["err_read"] == 2
    assert merged["server_cpu_ms_per_request"] == pytest.approx(0.1)
    assert "cpu_s" not in merged


def test_interleaved_rounds_take_the_servers_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []

    def fake_wrk(url: str, lua: str, connections: int, duration_s: float) -> dict[str, Any]:
        calls.append((url, connections))
        return _wrk_result(100.0, 1000)

    monkeypatch.setattr(run, "wrk", fake_wrk)
    monkeypatch.setattr(run, "cpu_seconds", lambda pids: 0.0)
    args = argparse.Namespace(rounds=2, duration_s=1.0, warmup_s=1.0)
    targets = [run.Target("a", "A", "w1.lua", []), run.Target("b", "B", "w1.lua", [])]
    cases = run.interleaved(targets, args, lambda: calls.append(("sweep", 0)))
    assert calls == [("A", 64), ("B", 64),  # warm-up
                     ("A", 64), ("B", 64), ("sweep", 0), ("A", 64), ("B", 64), ("sweep", 0),
                     ("A", 1), ("B", 1), ("A", 1), ("B", 1)]
    assert cases["a"]["c64"]["rps_rounds"] == [100.0, 100.0]
    assert set(cases["b"]) == {"c64", "c1"}  # no batching counters without Redis


def test_batching_counters_cover_the_64_connection_rounds_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    served = {"batches": 0.0, "items": 0.0}

    def fake_wrk(url: str, lua: str, connections: int, duration_s: float) -> dict[str, Any]:
        batch = 20 if connections == 64 else 1  # lone requests at one connection
        served["batches"] += 10
        served["items"] += 10 * batch
        return _wrk_result(100.0, 1000)

    def counters(redis_url: str, model: str) -> dict[str, float]:
        return {**dict.fromkeys(("entries", "forward_ms", "queue_wait_ms"), 0.0), **served}

    spent = {redis_cost.CPU_S: 0.0}

    def snapshot(redis_url: str) -> dict[str, float]:
        spent[redis_cost.CPU_S] += 0.001  # 1 ms of Redis CPU between two snapshots
        return dict(spent)

    monkeypatch.setattr(run, "wrk", fake_wrk)
    monkeypatch.setattr(run, "cpu_seconds", lambda pids: 0.0)
    monkeypatch.setattr(run, "batch_counters", counters)
    monkeypatch.setattr(redis_cost, "snapshot", snapshot)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    args = argparse.Namespace(rounds=2, duration_s=1.0, warmup_s=1.0)
    cases = run.interleaved([run.Target("r", "R", "w2.lua", [], "redis://x", "mlp")], args)
    assert cases["r"]["batching"]["mean_batch"] == 20.0
    # two runs of 200 requests, 1 ms of Redis CPU each: 5 µs per request
    assert cases["r"]["c64"]["redis_cpu_us_per_request"] == pytest.approx(5.0)


def test_the_bare_model_counts_at_its_faster_measurement() -> None:
    before = {"batch32_items_per_s": 22000.0, "batch1_items_per_s": 8000.0}
    after = {"batch32_items_per_s": 28000.0, "batch1_items_per_s": 7000.0}
    bare = run.faster_of(before, after)
    assert bare["batch32_items_per_s"] == 28000.0 and bare["batch1_items_per_s"] == 8000.0
    assert bare["runs"] == [before, after]


def test_w3_buckets_hold_each_body_in_the_smallest_power_of_two() -> None:
    buckets = w3.buckets()
    assert sum(len(rows) for rows in buckets.values()) == 64
    assert list(buckets) == [8, 16, 32, 64, 128, 256, 512]
    for length, rows in buckets.items():
        assert all(length // 2 < len(ids) <= length for ids in rows)


def test_w3_bare_sweep_takes_each_buckets_best_batch(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    lengths: list[int | None] = []

    def fake_rate(model: Any, rows: list[list[int]], length: int | None, batch: int,
                  duration_s: float) -> float:
        lengths.append(length)
        # padded to each pass's longest (None): rated as its bucket, for this test
        length = length or next(b for b, bodies in w3.buckets().items() if bodies == rows)
        best = 1 if length >= 256 else 8  # long buckets best alone, short ones at 8
        return 1000.0 * length / (1 + abs(batch - best))

    monkeypatch.setattr(w3, "_rate", fake_rate)
    monkeypatch.setattr(w3, "_exact", lambda model, duration_s: 5.0)
    bare = w3.bare_sweep(0.01)
    assert lengths.count(None) == len(lengths) // 3  # one strategy of three to the longest
    for name in ("plain", "served", "served_longest"):
        assert {k: v["best_batch"] for k, v in bare[name]["buckets"].items()} == {
            "8": 8, "16": 8, "32": 8, "64": 8, "128": 8, "256": 1, "512": 1}
    seconds = sum(sum(map(len, rows)) / (1000.0 * length)
                  for length, rows in w3.buckets().items())
    assert bare["plain"]["best_tokens_per_s"] == pytest.approx(7167 / seconds)
    assert bare["batch1_exact_tokens_per_s"] == 5.0


def test_w3_sweep_interleaves_the_sizes_and_takes_each_ones_median(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    plain: list[Any] = []

    def fake_rate(model: Any, rows: list[list[int]], length: int | None, batch: int,
                  duration_s: float) -> float:
        if model is not plain[0] or length != 8:
            return 100.0 * batch
        calls.append(batch)  # one round slowed batch 4 down (the machine drifted)
        return 1.0 if batch == 4 and calls.count(4) == 2 else 100.0 * batch

    monkeypatch.setattr(w3, "_rate", fake_rate)
    monkeypatch.setattr(w3, "_exact", lambda model, duration_s: 5.0)
    sweep = w3.BareSweep(0.3)
    plain.append(sweep.models["plain"])
    sweep.round()  # (a bench run takes one after each serving round)
    assert calls == [1, 2, 4, 8, 16, 32]
    rates = sweep.result()["plain"]["buckets"]["8"]["tokens_per_s"]  # the rounds still due
    assert rates == {b: 100.0 * b for b in w3.BATCH_SIZES}
    assert calls == [1, 2, 4, 8, 16, 32, 2, 4, 8, 16, 32, 1, 4, 8, 16, 32, 1, 2]
    sweep.round()  # (no round past the last)
    assert sweep.rounds == w3.SWEEP_ROUNDS and len(calls) == 18


def test_w3_report_gives_tokens_per_second_and_the_targets(
        capsys: pytest.CaptureFixture[str]) -> None:
    ours, naive = _case(1200, 2000), _case(1000, 1000)
    ours["batching"].update(real_per_forward_s=40000.0, real_per_forward_cpu_s=45000.0,
                            pad_ratio=1.3)
    res = {"redbatch_w3": w3.tokens(ours), "naive2_w3": w3.tokens(naive),
           "naive2_w3_served": w3.tokens(_case(1500, 1000)),
           "bare_w3": {"plain": {"buckets": {"8": {"best_batch": 32,
                                                   "tokens_per_s": {32: 90000.0}}},
                                 "best_tokens_per_s": 60000.0},
                       "served": {"buckets": {}, "best_tokens_per_s": 50000.0},
                       "served_longest": {"buckets": {}, "best_tokens_per_s": 60000.0},
                       "batch1_exact_tokens_per_s": 40000.0}}
    run.report(res)
    out = capsys.readouterr().out
    assert f"{1200 * 7167 / 64:.0f}" in out  # tokens/s = req/s x mean length
    assert "x1.20 the tokens/s of naive2_w3 (target x1.1: met)" in out
    assert "ray_w3" not in out
    assert "8:32 (90000)" in out
    assert "x0.80 the naive server running the forward textcls serves" in out
    assert ("45000 real tokens per forward CPU-second, 90% of the served forward's best "
            "strategy (target 90%: met); 40000 per forward wall-second (80%") in out
    assert "with each pass padded to its longest body: 75% (like for like" in out


def test_batching_counts_real_tokens_per_forward_second() -> None:
    zero = dict.fromkeys(("batches", "items", "entries", "forward_ms", "forward_cpu_ms",
                          "queue_wait_ms", "padded", "real"), 0.0)
    after = {**zero, "batches": 10.0, "items": 40.0, "entries": 40.0, "forward_ms": 500.0,
             "forward_cpu_ms": 400.0, "padded": 6000.0, "real": 4000.0}
    b = run.batching(zero, after)
    assert b["real_per_forward_s"] == pytest.approx(8000.0)
    assert b["real_per_forward_cpu_s"] == pytest.approx(10000.0)
    assert b["pad_ratio"] == pytest.approx(1.5)


INFO = {"used_cpu_user": 9.0, "used_cpu_sys": 9.0, "used_cpu_user_main_thread": 1.5,
        "used_cpu_sys_main_thread": 0.5,
        "cmdstat_evalsha": {"calls": 10, "usec": 300, "usec_per_call": 30.0},
        "cmdstat_lrange": {"calls": 10, "usec": 40, "usec_per_call": 4.0}}


def test_redis_cost_per_request_from_two_info_snapshots() -> None:
    before = redis_cost.parse(INFO)
    assert before == {redis_cost.CPU_S: 2.0, redis_cost.CALLS: 20.0,
                      "redis_cmd_us:evalsha": 300.0,
                      "redis_cmd_us:lrange": 40.0}  # the main thread's CPU
    later = {**INFO, "used_cpu_user_main_thread": 1.6,
             "cmdstat_evalsha": {"calls": 30, "usec": 1300},
             "cmdstat_lrange": {"calls": 10, "usec": 40},
             "cmdstat_blmove": {"calls": 5, "usec": 100}}
    spent = redis_cost.spent(before, redis_cost.parse(later))
    assert spent[redis_cost.CPU_S] == pytest.approx(0.1)
    assert spent[redis_cost.CALLS] == 25.0
    assert "redis_cmd_us:lrange" not in spent  # unchanged
    rounds = [{"requests": 500, **spent}, {"requests": 500, **spent}]
    cost = redis_cost.per_request(redis_cost.total(rounds), 1000)
    assert cost["redis_cpu_us_per_request"] == pytest.approx(200.0)
    assert cost["redis_cmd_us_per_request"] == {"evalsha": 2.0, "blmove": 0.2}
    assert redis_cost.shown(cost) == "200.0" and redis_cost.shown({}) == "-"
    process_only = {k: v for k, v in INFO.items() if "main_thread" not in k}
    assert redis_cost.parse(process_only)[redis_cost.CPU_S] == 18.0  # an older Redis


def test_redis_cost_snapshot_reads_a_real_server(raw_redis: Any, redis_url: str) -> None:
    before = redis_cost.snapshot(redis_url)
    for i in range(2000):
        raw_redis.set("bench-cost", i)
    spent = redis_cost.spent(before, redis_cost.snapshot(redis_url))
    assert spent["redis_cmd_us:set"] > 0
    assert spent[redis_cost.CPU_S] > 0  # 2000 round trips cost the server CPU


def test_merge_gives_redis_cpu_per_request_for_redis_targets_only() -> None:
    plain = run.merge([_wrk_result(1000, 900)])
    assert "redis_cpu_us_per_request" not in plain
    merged = run.merge([{**_wrk_result(1000, 900), redis_cost.CPU_S: 0.05},
                        {**_wrk_result(1000, 900), redis_cost.CPU_S: 0.03,
                         "redis_cmd_us:evalsha": 800.0}])
    assert merged["redis_cpu_us_per_request"] == pytest.approx(20.0)  # 80 ms / 4000
    assert merged["redis_cmd_us_per_request"] == {"evalsha": 0.2}
    assert redis_cost.CPU_S not in merged


def test_w3_size_check_rates_each_workers_chosen_size_against_batch1_and_32() -> None:
    served = {"buckets": {"8": {"tokens_per_s": {1: 10.0, 2: 20.0, 4: 40.0, 8: 60.0,
                                                  16: 80.0, 32: 100.0}},
                          "512": {"tokens_per_s": {1: 100.0, 2: 90.0, 4: 80.0, 8: 70.0,
                                                    16: 60.0, 32: 50.0}}}}
    ratios = w3.size_check(served, [{"8": 32, "512": 1}, {"8": 12, "512": 4}])
    assert ratios == {"8/w0": 1.0, "512/w0": 1.0, "8/w1": 0.6, "512/w1": 0.8}


def test_w3_report_says_when_a_bucket_falls_below_the_floor(
        capsys: pytest.CaptureFixture[str]) -> None:
    served = {"buckets": {"8": {"tokens_per_s": {1: 10.0, 2: 20.0, 4: 40.0, 8: 60.0,
                                                  16: 80.0, 32: 100.0}}}}
    w3._report_sizes(served, [{"8": 16}])
    out = capsys.readouterr().out
    assert "8:16; worst bucket 80% of the better of batch 1 and 32" in out
    assert "(target 95%: NOT met)" in out


@pytest.mark.parametrize(("longest", "worst"), [(False, "80%"), (True, "50%")])
def test_w3_sizes_are_checked_against_the_sweep_padded_as_the_passes_are(
        capsys: pytest.CaptureFixture[str], longest: bool, worst: str) -> None:
    rates = {1: 10.0, 2: 20.0, 4: 40.0, 8: 60.0, 16: 80.0, 32: 100.0}
    ours = w3.tokens(_case(1000, 1000))
    ours.update(auto_sizes=[{"8": 16}], pad_to_longest=longest)
    ours["batching"].update(real_per_forward_s=1.0, real_per_forward_cpu_s=1.0)
    res = {"redbatch_w3": ours, "bare_w3": {
        "plain": {"buckets": {}, "best_tokens_per_s": 1.0},
        "served": {"buckets": {"8": {"tokens_per_s": rates, "best_batch": 32}},
                   "best_tokens_per_s": 1.0},
        "served_longest": {"buckets": {"8": {"tokens_per_s": {**rates, 16: 50.0},
                                             "best_batch": 32}},
                           "best_tokens_per_s": 1.0},
        "batch1_exact_tokens_per_s": 1.0}}
    w3.report(res)
    assert f"8:16; worst bucket {worst} of the better" in capsys.readouterr().out


def test_replica_wait_report_shows_each_setting_and_the_ratios(
        capsys: pytest.CaptureFixture[str]) -> None:
    from redbatch.bench import replication

    def fig(rate: float, p50: float) -> dict[str, float]:
        return {"items_per_s": rate, "enqueue_p50_ms": p50, "enqueue_p99_ms": 4 * p50}

    median = {"off x64": fig(10000, 1.0), "on x64": fig(9000, 1.25),
              "off x1": fig(800, 0.3), "on x1": fig(700, 0.5),
              "on x64, replica paused": fig(320, 200.0), "on x1, replica paused": fig(5, 200.0)}
    replication.report({"median": median})
    out = capsys.readouterr().out
    assert "x64 on/off: throughput x0.90, enqueue p50 +0.25 ms" in out
    assert "x1 on/off: throughput x0.88, enqueue p50 +0.20 ms" in out
    assert "on x64, replica paused" in out and "200.00" in out
    assert replication._median([fig(1, 1.0), fig(3, 3.0), fig(2, 2.0)]) == fig(2, 2.0)


def test_w3_ab_sets_each_arm_knob_before_its_run_and_reports_the_ratio(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--w3-ab pad_to_longest=false``: redbatch_w3 sets the knob back to its value
    before the rounds before each of its runs, redbatch_w3_ab sets it before each of its
    own; the report gives the arm's tokens/s against the other's, round by round."""
    args = run.main_parser().parse_args(["--w3-ab", "pad_to_longest=false"])
    assert args.w3_ab == ("pad_to_longest", False)
    with pytest.raises(SystemExit):
        run.main_parser().parse_args(["--w3-ab", "pad_to_longest"])
    procs = argparse.Namespace(pids=lambda *names: [1])
    targets = run.w3_targets(procs, args, "redis://r", "http://ours",  # type: ignore[arg-type]
                             "http://naive", [], {"pad_to_longest": True})
    assert [t.name for t in targets] == ["redbatch_w3", "redbatch_w3_ab", "naive2_w3",
                                         "naive2_w3_served"]
    configured: list[dict[str, Any]] = []
    monkeypatch.setattr(w3, "configure", lambda url, values, model: configured.append(values))
    monkeypatch.setattr(run, "wrk", lambda *a: {"rps": 1.0})
    monkeypatch.setattr(run, "cpu_seconds", lambda pids: 0.0)
    monkeypatch.setattr(run.redis_cost, "snapshot", lambda url: {})
    monkeypatch.setattr(run.redis_cost, "spent", lambda a, b: {})
    for target in targets[:2] * 2:
        run.measured(target, 64, 1.0)
    assert configured == [{"pad_to_longest": True}, {"pad_to_longest": False}] * 2

    ours, ab = _case(1000, 1000), _case(1100, 1000)
    ours["c64"]["rps_rounds"], ab["c64"]["rps_rounds"] = [900, 1100], [1000, 1000]
    res = {"redbatch_w3": w3.tokens(ours), "redbatch_w3_ab": w3.tokens(ab),
           "w3_ab": ["pad_to_longest", False],
           "bare_w3": {"plain": {"buckets": {}, "best_tokens_per_s": 1.0},
                       "served": {"buckets": {}, "best_tokens_per_s": 1.0},
                       "batch1_exact_tokens_per_s": 1.0}}
    w3.report(res)
    out = capsys.readouterr().out
    assert "redbatch_w3_ab" in out
    assert ("w3 A/B: pad_to_longest=False x1.100 the tokens/s of redbatch_w3 (higher in "
            "1 of 2 rounds)") in out
