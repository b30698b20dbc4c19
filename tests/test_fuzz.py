"""Fuzz the gateway over real HTTP: every malformed body gets a 4xx with a JSON
message (never a 500, a traceback or a hang), and memory stays bounded."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Proc, free_port, redbatch_cmd, wait_http

pytestmark = pytest.mark.e2e
ALLOWED = {200, 400, 413, 422}

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=70)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=5), max_leaves=80)
near_valid = st.lists(st.floats(width=32) | st.integers(-10**20, 10**20), min_size=60,
                      max_size=68)


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


bodies = (st.binary(max_size=200)
          | values.map(encode)
          | st.fixed_dictionaries({"x": values}).map(encode)
          | st.fixed_dictionaries({"x": near_valid}).map(encode)
          | st.fixed_dictionaries({"x": near_valid, "timeout_ms": values}).map(encode))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def check(resp: httpx.Response, may_time_out: bool = False) -> None:
    allowed = ALLOWED | {504} if may_time_out else ALLOWED  # a valid, tiny timeout_ms
    assert resp.status_code in allowed, (resp.status_code, resp.text)
    assert "Traceback" not in resp.text
    if resp.status_code != 200:
        error = resp.json()["error"]
        assert error["code"] and error["message"]


def test_fuzzed_bodies_get_4xx(spawn: Callable[..., Proc], redis_url: str) -> None:
    port = free_port()
    spawn(redbatch_cmd("worker", "redbatch.demo:models", "--redis-url", redis_url), name="w")
    gw = spawn(redbatch_cmd("gateway", "--redis-url", redis_url, "--port", str(port),
                            "--max-body-bytes", "4096", "--default-timeout-s", "5",
                            "--workers", "1"), name="gw")  # one process: its RSS is measured
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 60, gw)
    with httpx.Client(base_url=base, timeout=10) as http:
        @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=bodies, model=st.sampled_from(["mlp", "echo"]))
        def post(body: bytes, model: str) -> None:
            check(http.post(f"/v1/models/{model}/predict", content=body,
                            headers={"content-type": "application/json"}),
                  may_time_out=b'"timeout_ms"' in body)

        post()
        before = rss_kib(gw.popen.pid)
        junk = b'{"x": [' + b"1e999," * 600 + b"1]}"
        for _ in range(1500):
            check(http.post("/v1/models/mlp/predict", content=junk))
            check(http.post("/v1/models/echo/predict", content=b'{"x": [1, 2, "three"]}'))
        growth_kib = rss_kib(gw.popen.pid) - before
    assert growth_kib < 30 * 1024, f"gateway RSS grew {growth_kib} KiB"
