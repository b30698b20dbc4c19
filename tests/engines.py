"""Real multi-node Redis set-ups for tests: a Redis Cluster (3 primaries, 3 replicas)
and a Sentinel set-up (a primary, a replica, 3 sentinels), each from local
``redis-server`` processes on free ports in temporary directories.

Every node starts at once; start-up polls with short sleeps under an overall
timeout; ``stop()`` kills every process and removes the directories.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from redbatch.bench import cluster
from redbatch.bench.cluster import START_TIMEOUT_S, poll
from redbatch.embedded import free_port

REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NODE_TIMEOUT_MS = 1000  # cluster: a primary this long unreachable is failed over
DOWN_AFTER_MS = 1000  # sentinel: likewise
SERVICE = "svc"


def have_binaries() -> bool:
    return REDIS_BIN is not None and REDIS_CLI is not None


def spawn_redis(port: int, workdir: str | Path, args: list[str]) -> subprocess.Popen[bytes]:
    """A ``redis-server`` on 127.0.0.1:``port`` in ``workdir`` (``args`` first: a
    config file's path must lead)."""
    assert REDIS_BIN, "redis-server is not installed"
    return subprocess.Popen([REDIS_BIN, *args, "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(workdir), "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class PortTaken(Exception):
    """A node's process exited before it answered (its port was taken)."""


@dataclass
class Node:
    """One ``redis-server`` (or sentinel) process."""

    args: list[str]
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rb-engine-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> None:
        """Start the process (``wait_up`` waits for it to answer)."""
        self.proc = spawn_redis(self.port, self.workdir, self.args)

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s)

    def ask(self, *command: Any) -> Any:
        """One command on a fresh connection."""
        with self.client() as client:
            return client.execute_command(*command)

    def wait_up(self) -> None:
        """Wait until it answers; a process that exited at once (another process took
        its free port, or its cluster bus port, meanwhile) is started again on others."""
        for _attempt in range(3):
            try:
                poll(f"node {self.address} answering", self._ping)
                return
            except PortTaken:
                self.port = free_port()
                self._new_bus_port()
                self.launch()
        poll(f"node {self.address} answering", self._ping)

    def _new_bus_port(self) -> None:
        """A cluster node's bus port, chosen again too: that one may be the port taken
        (an ephemeral port of any connection made meanwhile)."""
        if "--cluster-port" in self.args:
            at = self.args.index("--cluster-port") + 1
            self.args[at] = str(free_port())

    def _ping(self) -> Any:
        if self.proc is not None and self.proc.poll() is not None:
            raise PortTaken(f"redis-server on port {self.port} exited: {self.proc.returncode}")
        return self.ask("PING")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_all(nodes: list[Node]) -> None:
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_up()


def data_node(*args: str) -> Node:
    return Node(["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", *args])


@dataclass
class ClusterEngine:
    """3 primaries and 3 replicas formed with ``redis-cli --cluster create``."""

    nodes: list[Node] = field(default_factory=list)

    def start(self) -> ClusterEngine:
        self.nodes = [data_node("--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
                      for _ in range(6)]
        start_all(self.nodes)
        assert REDIS_CLI
        subprocess.run([REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=START_TIMEOUT_S)
        self.wait_ok()
        return self

    @property
    def url(self) -> str:
        """Two seeds: the client discovers the rest."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[:2])

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None]

    def wait_ok(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every live node says ``cluster_state:ok`` and agrees on the slots."""
        cluster.wait_ok([n.address for n in self.live()], timeout_s)

    def owner(self, key: str) -> Node:
        """The primary that serves ``key``'s slot now (as the live nodes see it)."""
        slot = int(self.live()[0].ask("CLUSTER", "KEYSLOT", key))
        for start, end, primary, *_replicas in self.live()[0].ask("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise AssertionError(f"slot {slot} is not served")

    def node_id(self, node: Node) -> str:
        return str(node.ask("CLUSTER", "MYID").decode())

    def migrate(self, key: str, target: Node) -> None:
        """Move ``key``'s slot (and its keys) to ``target``, a primary, as
        ``redis-cli --cluster reshard`` does; clients then get MOVED."""
        self.finish_move(self.begin_move(key, target, []))

    def begin_move(self, key: str, target: Node, first: list[str]) -> SlotMove:
        """Start moving ``key``'s slot to ``target`` and leave it half-moved: the
        target ``IMPORTING``, the source ``MIGRATING``, and of the slot's keys only
        those of ``first`` that exist migrated (clients get ``ASK`` for them, and
        ``TRYAGAIN`` for a multi-key command or script whose keys are split)."""
        source, slot = self.owner(key), int(self.nodes[0].ask("CLUSTER", "KEYSLOT", key))
        move = SlotMove(slot, source, target, self.node_id(source), self.node_id(target))
        target.ask("CLUSTER", "SETSLOT", slot, "IMPORTING", move.source_id)
        source.ask("CLUSTER", "SETSLOT", slot, "MIGRATING", move.target_id)
        if first:
            move.migrate(first)
        return move

    def finish_move(self, move: SlotMove) -> None:
        """Migrate the rest of the slot's keys and give the slot to the target on
        every primary; clients then get ``MOVED``."""
        while keys := move.source.ask("CLUSTER", "GETKEYSINSLOT", move.slot, 100):
            move.migrate(keys)
        for node in (move.target, move.source, *self.primaries()):
            node.ask("CLUSTER", "SETSLOT", move.slot, "NODE", move.target_id)
        self.wait_ok()

    def primaries(self) -> list[Node]:
        ports = {int(primary[1]) for _s, _e, primary, *_r in self.live()[0].ask("CLUSTER",
                                                                                "SLOTS")}
        return [n for n in self.nodes if n.port in ports]

    def fail_over(self, key: str, timeout_s: float = START_TIMEOUT_S) -> Node:
        """Kill the primary of ``key``'s slot; wait until its replica serves the slot."""
        dead = self.owner(key)
        dead.kill()
        poll("a replica promoted", lambda: self.owner(key) is not dead, timeout_s)
        self.wait_ok(timeout_s)
        return self.owner(key)

    def stop(self) -> None:
        for node in self.nodes:
            node.remove()


@dataclass
class SlotMove:
    """A slot on its way from ``source`` to ``target`` (``ClusterEngine.begin_move``)."""

    slot: int
    source: Node
    target: Node
    source_id: str
    target_id: str

    def migrate(self, keys: list[Any]) -> None:
        """``MIGRATE`` those of ``keys`` that the source still holds (it skips the
        others: ``NOKEY``)."""
        self.source.ask("MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys)


def _sentinel_id(index: int) -> str:
    return f"{index + 1:040x}"


@dataclass
class SentinelEngine:
    """A primary, one replica and three sentinels monitoring ``SERVICE`` (quorum 2)."""

    primary: Node = field(default_factory=data_node)
    replica: Node | None = None
    sentinels: list[Node] = field(default_factory=list)

    def start(self) -> SentinelEngine:
        self.replica = data_node("--replicaof", "127.0.0.1", str(self.primary.port))
        self.sentinels = [Node(["--sentinel"]) for _ in range(3)]
        for index, sentinel in enumerate(self.sentinels):
            self._configure(sentinel, index)
        start_all([self.primary, self.replica, *self.sentinels])
        replica = self.replica
        poll("the replica in sync",
             lambda: replica.ask("INFO", "replication").get("master_link_status") == "up")
        for sentinel in self.sentinels:
            poll("the sentinels know the primary, its replica and each other",
                 lambda s=sentinel: self._ready(s))  # type: ignore[misc]
        return self

    def _configure(self, sentinel: Node, index: int) -> None:
        """A config naming the replica and the other sentinels up front, so that none
        waits for the periodic discovery (INFO every 10 s, hellos every 2 s)."""
        assert self.replica is not None
        known = [f"sentinel known-sentinel {SERVICE} 127.0.0.1 {other.port} {_sentinel_id(i)}"
                 for i, other in enumerate(self.sentinels) if other is not sentinel]
        conf = sentinel.workdir / "sentinel.conf"
        conf.write_text("\n".join([
            f"sentinel myid {_sentinel_id(index)}",
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} 5000",
            f"sentinel known-replica {SERVICE} 127.0.0.1 {self.replica.port}", *known, ""]))
        sentinel.args = [str(conf), "--sentinel"]

    @staticmethod
    def _ready(sentinel: Node) -> bool:
        """It knows the replica and the other sentinels, and holds the primary healthy
        (flags ``master`` alone: a client's lookup refuses a primary flagged down or
        disconnected, which a loaded machine's fresh set-up showed once)."""
        info = sentinel.ask("SENTINEL", "MASTER", SERVICE)  # (parsed by redis-py)
        return int(info[b"num-slaves"]) >= 1 and int(info[b"num-other-sentinels"]) >= 2 \
            and info[b"flags"] == b"master"

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(s.address for s in self.sentinels) + \
            f"/{SERVICE}/0"

    def master_port(self) -> int:
        host_port = self.sentinels[0].ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(host_port[1])

    def fail_over(self, timeout_s: float = START_TIMEOUT_S) -> Node:
        """Kill the primary; wait until the sentinels name the replica, which then takes
        writes."""
        replica = self.replica
        assert replica is not None
        self.primary.kill()
        poll("the sentinels promoted the replica",
             lambda: self.master_port() == replica.port, timeout_s)
        poll("the promoted replica takes writes",
             lambda: replica.ask("INFO", "replication")["role"] == "master", timeout_s)
        return replica

    def stop(self) -> None:
        for node in (*self.sentinels, self.replica, self.primary):
            if node is not None:
                node.remove()
