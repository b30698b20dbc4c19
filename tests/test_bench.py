"""The benchmark suite's own plumbing (the figures themselves come from `redbatch bench`)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from redbatch.bench import run
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
    run.report(res)
    out = capsys.readouterr().out
    assert "w1: throughput x1.20 of naive; p50@1 +0.50 ms" in out
    assert "w2: throughput x10.00 of ray; p50@1 -10.50 ms" in out
    assert "ray_w1" not in out  # not measured in this run: no row, no ratio
    assert "1 replica   predict x64 14000 (50%); predict_many 8x128 16800 (60%)" in out
    assert "2 replicas  predict x64 11200 (40%); predict_many 8x128 21000 (75%)" in out
