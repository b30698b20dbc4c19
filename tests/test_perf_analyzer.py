"""Triton's perf_analyzer drives the gateway's v2 routes (scripts/perf_analyzer installs
the real C++ binary from the tritonclient 2.34.0 wheel on first use)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import ROOT, Proc, free_port, redbatch_cmd, test_env, wait_http

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_perf_analyzer_drives_the_demo_mlp(spawn: Callable[..., Proc], redis_url: str) -> None:
    port = free_port()
    proc = spawn(redbatch_cmd("up", "--port", str(port), "--device", "cpu"),
                 env=test_env(REDIS_URL=redis_url), name="up")
    wait_http(f"http://127.0.0.1:{port}/v2/health/ready", 90, proc)
    done = subprocess.run(
        [str(ROOT / "scripts" / "perf_analyzer"), "-m", "mlp", "-u", f"127.0.0.1:{port}",
         "-i", "http", "-b", "4", "--concurrency-range", "2", "--measurement-interval",
         "1000",
         # what is tested is that it runs against us, not how steady this shared 2-core
         # machine is: 3 windows within 50 % of each other are stable enough
         "--stability-percentage", "50", "--max-trials", "20"],
        capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"Concurrency: 2, throughput: ([0-9.]+) infer/sec", done.stdout)
    assert match and float(match.group(1)) > 0, done.stdout
