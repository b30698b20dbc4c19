"""redbatch across hosts: a Redis Cluster of 3 primaries, a gateway and two workers,
each in its own network namespace (``tests/netns.py``), every node bound to its veth
address only, and a caller in yet another namespace.  Every loopback there is down:
the answers prove that nothing assumes localhost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from redbatch.bench import cluster
from tests import engines, netns
from tests.conftest import test_env

WHY_NOT = netns.available()
pytestmark = [pytest.mark.engines, pytest.mark.timeout(90),
              pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}"),
              pytest.mark.skipif(not engines.have_binaries(), reason="no redis-server")]
REDIS_PORT, HTTP_PORT = 6379, 8000
PRIMARIES = 3
CALLS = 24

CALLER = """
import json, sys, time
import httpx
base = sys.argv[1]
deadline = time.monotonic() + 40
while True:
    try:
        ready = httpx.get(base + "/readyz", timeout=1).status_code == 200
        listed = httpx.get(base + "/v1/models", timeout=1).json()["models"]
        if ready and sum(m["live_workers"] for m in listed if m["name"] == "adder") >= 2:
            break
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the gateway never had 2 live workers")
    time.sleep(0.1)
outputs = [httpx.post(base + "/v1/models/adder/predict", json={"inputs": n}, timeout=10
                      ).json() for n in range(int(sys.argv[2]))]
try:
    httpx.get("http://127.0.0.1:%d/readyz" % int(sys.argv[3]), timeout=1)
    loopback = "answered"
except httpx.HTTPError as exc:
    loopback = type(exc).__name__
print(json.dumps({"outputs": outputs, "loopback": loopback}))
"""


def _start_cluster(net: netns.Network, logdir: Path) -> str:
    """3 primaries, one per host, bound to the host's address only; their URL."""
    addresses = []
    for index in range(PRIMARIES):
        host = net.add()
        host.spawn(f"redis-{index}", cluster.node_args(host.address, REDIS_PORT, logdir))
        addresses.append(f"{host.address}:{REDIS_PORT}")
    cluster.create(addresses)  # from the root namespace, over the bridge
    return cluster.url(addresses)


def test_a_caller_reaches_workers_through_a_gateway_across_namespaces(tmp_path: Path) -> None:
    with netns.Network(tmp_path) as net:
        env = test_env(REDIS_URL=_start_cluster(net, tmp_path), REDBATCH_LOG_LEVEL="WARNING")
        for index in range(2):
            net.add().spawn(f"worker-{index}", [sys.executable, "-m", "redbatch", "worker",
                                                "tests.models_for_tests:adder"], env)
        gateway = net.add()
        gateway.spawn("gateway", [sys.executable, "-m", "redbatch", "gateway", "--host",
                                  gateway.address, "--port", str(HTTP_PORT), "--workers", "1"],
                      env)
        done = net.add().run([sys.executable, "-c", CALLER, f"http://{gateway.address}:"
                              f"{HTTP_PORT}", str(CALLS), str(HTTP_PORT)], env, timeout_s=60)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(tmp_path.glob("*.log")))
        assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{logs}"
    got = json.loads(done.stdout)
    assert got["outputs"] == [{"outputs": n + 1} for n in range(CALLS)]
    assert got["loopback"] != "answered"  # the caller's only way out is its veth
