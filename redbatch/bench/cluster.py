"""A Redis Cluster of primaries only, formed from ``redis-server`` processes that the
caller starts (on 127.0.0.1 for the shard bench, on veth addresses in network
namespaces for ``tests/netns.py``): the nodes' arguments, the slots split and the
nodes introduced, and a wait until every node agrees.

Each node binds only to its own address and announces it (``cluster-announce-ip``),
so clients and the other nodes reach it there and nowhere else.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

T = TypeVar("T")
START_TIMEOUT_S = 20.0
POLL_S = 0.05
NODE_TIMEOUT_MS = 2000
ASK_TIMEOUT_S = 2.0
SLOTS = 16384


def node_args(host: str, port: int, workdir: Path, bus_port: int = 0) -> list[str]:
    """``redis-server`` arguments of one cluster node bound to ``host:port`` only,
    without persistence, its files in ``workdir``; its cluster bus on ``bus_port``
    (0: ``port`` + 10000)."""
    return ["redis-server", "--bind", host, "--port", str(port), "--cluster-port", str(bus_port),
            "--cluster-enabled", "yes", "--cluster-announce-ip", host,
            "--cluster-config-file", str(workdir / f"nodes-{host}-{port}.conf"),
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--loglevel", "warning"]


def ask(address: str, *command: str | int, timeout_s: float = ASK_TIMEOUT_S) -> object:
    """One command to ``host:port`` on a fresh connection."""
    host, port = address.rsplit(":", 1)
    with redis.Redis(host=host, port=int(port), socket_timeout=timeout_s,
                     socket_connect_timeout=timeout_s) as client:
        return client.execute_command(*command)


def wait_answering(addresses: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    for address in addresses:
        poll(f"{address} answering", functools.partial(ask, address, "PING"), timeout_s)


def create(addresses: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Form a cluster of these nodes, all primaries, the slots split evenly in address
    order (as ``redis-cli --cluster create`` does, which wants 3 nodes at least): each
    node takes its range, meets the first, and every node must then say
    ``cluster_state:ok`` and agree on the slots."""
    wait_answering(addresses, timeout_s)
    for (first, last), address in zip(slot_ranges(len(addresses)), addresses, strict=True):
        ask(address, "CLUSTER", "ADDSLOTSRANGE", first, last)
    host, port = addresses[0].rsplit(":", 1)
    bus_port = int(_config(addresses[0], "cluster-port")) or int(port) + 10000
    for address in addresses[1:]:
        ask(address, "CLUSTER", "MEET", host, port, bus_port)
    wait_ok(addresses, timeout_s)


def _config(address: str, name: str) -> str:
    """One setting's value (``CONFIG GET``)."""
    found = ask(address, "CONFIG", "GET", name)  # redis-py makes it a dict
    value = found.get(name.encode(), b"0") if isinstance(found, dict) else b"0"
    return value.decode() if isinstance(value, bytes) else str(value)


def slot_ranges(count: int) -> list[tuple[int, int]]:
    """16384 slots in ``count`` contiguous ranges, as even as can be."""
    bounds = [SLOTS * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(count)]


def wait_ok(addresses: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every node says ``cluster_state:ok`` and all give the same slot map."""
    def agreed() -> bool:
        views = {str(ask(a, "CLUSTER", "SLOTS")) for a in addresses}
        return len(views) == 1 and all(b"cluster_state:ok" in _bytes(ask(a, "CLUSTER", "INFO"))
                                       for a in addresses)
    poll("cluster_state:ok on every node", agreed, timeout_s)


def url(addresses: list[str]) -> str:
    """The ``redis+cluster://`` URL with every node as a seed."""
    return "redis+cluster://" + ",".join(addresses)


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else b""


def poll(what: str, probe: Callable[[], T | None], timeout_s: float = START_TIMEOUT_S) -> T:
    """``probe()`` until it returns something other than None (or False), which is
    returned; connection errors count as not yet.  ``TimeoutError`` naming ``what``
    past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            found = probe()
            if found is not None and found is not False:
                return found
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            last = exc
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not within {timeout_s} s (last error: {last})")
