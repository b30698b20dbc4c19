"""Place models' slots on a Redis Cluster on purpose (``scripts/place-slots``).

Every key of a model carries its hash tag ``{model}``, so a model lives in one slot,
on one primary.  Hashing a few tags is lumpy: 6 models on 3 primaries land 2-2-2 only
by luck.  This spreads the distinct slots of the given models evenly over the
primaries (counts differing by one at most), keeping as many as it can where they
are, and moves the others as ``redis-cli --cluster reshard`` moves a slot:
``SETSLOT IMPORTING`` / ``MIGRATING``, ``MIGRATE`` of the slot's keys, then
``SETSLOT NODE`` on every primary.

    python -m redbatch.placement redis+cluster://h:p MODEL [MODEL ...]          # the plan
    python -m redbatch.placement redis+cluster://h:p MODEL [MODEL ...] --apply  # move
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.crc import key_slot

from redbatch import protocol
from redbatch.config import RedisSettings
from redbatch.errors import ConfigError, RedisUnavailable

MIGRATE_TIMEOUT_MS = 5000
KEYS_PER_MIGRATE = 100


def model_slot(model: str) -> int:
    """The slot of every key of ``model`` (its hash tag ``{model}``)."""
    return int(key_slot(protocol.queue_key(model).encode()))


@dataclass(frozen=True)
class Primary:
    """One primary as the cluster announces it."""

    node_id: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class SlotMap:
    """The primaries (in address order) and which one owns each slot."""

    primaries: tuple[Primary, ...]
    owner: dict[int, Primary]


def plan(slots: Sequence[int], slot_map: SlotMap) -> dict[int, Primary]:
    """Each distinct slot of ``slots`` -> the primary it should live on: the slots
    spread evenly (counts differ by one at most), as many left where they are as the
    spread allows."""
    wanted = sorted(set(slots))
    share = len(wanted) // len(slot_map.primaries)
    placed: dict[int, Primary] = {}
    load = {p.node_id: 0 for p in slot_map.primaries}
    for slot in wanted:  # first keep each slot on its owner while that owner has room
        owner = slot_map.owner[slot]
        if load[owner.node_id] < share:
            placed[slot], load[owner.node_id] = owner, load[owner.node_id] + 1
    for slot in (s for s in wanted if s not in placed):  # the rest to the least loaded
        target = min(slot_map.primaries, key=lambda p: (load[p.node_id], p.address))
        placed[slot], load[target.node_id] = target, load[target.node_id] + 1
    return placed


class Nodes:
    """Connections to the cluster's nodes, with the URL's credentials."""

    def __init__(self, settings: RedisSettings) -> None:
        nodes = settings.topology
        if nodes is None or nodes.mode != "cluster":
            raise ConfigError("slots are placed on a Redis Cluster: give a redis+cluster:// URL")
        self.settings, self.topology = settings, nodes

    def ask(self, host: str, port: int, *command: str | int | bytes) -> object:
        """One command to one node, on a fresh connection."""
        with redis.Redis(host=host, port=port, username=self.topology.username,
                         password=self.topology.password,
                         socket_timeout=self.settings.socket_timeout_s,
                         socket_connect_timeout=self.settings.connect_timeout_s) as client:
            return client.execute_command(*command)

    def slot_map(self) -> SlotMap:
        """From the first seed that answers ``CLUSTER SLOTS``."""
        for host, port in self.topology.seeds:
            try:
                return _parse_slots(self.ask(host, port, "CLUSTER", "SLOTS"))
            except (redis.ConnectionError, redis.TimeoutError):
                continue
        raise RedisUnavailable(f"no seed of {self.settings.safe_url} answered")

    def on(self, node: Primary, *command: str | int | bytes) -> object:
        return self.ask(node.host, node.port, *command)


def _parse_slots(raw: object) -> SlotMap:
    owner: dict[int, Primary] = {}
    for start, end, primary, *_replicas in raw:  # type: ignore[attr-defined]
        node = Primary(_text(primary[2]), _text(primary[0]), int(primary[1]))
        owner.update(dict.fromkeys(range(int(start), int(end) + 1), node))
    primaries = sorted(set(owner.values()), key=lambda p: (p.host, p.port))
    return SlotMap(tuple(primaries), owner)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def move_slot(nodes: Nodes, slot: int, source: Primary, target: Primary,
              primaries: Sequence[Primary]) -> int:
    """Move ``slot`` and its keys from ``source`` to ``target`` (both primaries), as
    ``redis-cli --cluster reshard`` does; the number of keys moved.  Clients get
    ``ASK`` during the move and ``MOVED`` after it, and follow them."""
    nodes.on(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
    nodes.on(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
    moved = 0
    while keys := _keys_in(nodes, source, slot):
        nodes.on(source, "MIGRATE", target.host, target.port, "", 0, MIGRATE_TIMEOUT_MS,
                 *_auth(nodes), "KEYS", *keys)
        moved += len(keys)
    for node in (target, source, *(p for p in primaries if p not in (source, target))):
        nodes.on(node, "CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
    return moved


def _keys_in(nodes: Nodes, node: Primary, slot: int) -> list[bytes]:
    keys = nodes.on(node, "CLUSTER", "GETKEYSINSLOT", slot, KEYS_PER_MIGRATE)
    return list(keys) if isinstance(keys, list) else []


def _auth(nodes: Nodes) -> list[str]:
    """MIGRATE's credentials for the target: the URL's."""
    user, password = nodes.topology.username, nodes.topology.password
    if password is None:
        return []
    return ["AUTH2", user, password] if user else ["AUTH", password]


def place(settings: RedisSettings, models: Sequence[str], apply: bool = False
          ) -> list[tuple[str, int, Primary, Primary]]:
    """(model, slot, owner now, planned owner) for each model; with ``apply``, the
    slots that must move are moved (and the owner then is the planned one)."""
    nodes = Nodes(settings)
    slot_map = nodes.slot_map()
    placed = plan([model_slot(m) for m in models], slot_map)
    if apply:
        for slot, target in placed.items():
            if slot_map.owner[slot] != target:
                move_slot(nodes, slot, slot_map.owner[slot], target, slot_map.primaries)
    return [(m, model_slot(m), slot_map.owner[model_slot(m)], placed[model_slot(m)])
            for m in models]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="place-slots", description="Spread models' slots evenly over a Redis Cluster's "
        "primaries (a model's keys all live in the slot of its hash tag {model}).")
    parser.add_argument("url", help="redis+cluster://[user:password@]host:port[,host:port]")
    parser.add_argument("models", nargs="+", help="model names")
    parser.add_argument("--apply", action="store_true", help="move the slots (else: print "
                        "the plan)")
    args = parser.parse_args(argv)
    try:
        rows = place(RedisSettings(args.url), args.models, args.apply)
    except (ConfigError, RedisUnavailable, redis.RedisError) as exc:
        print(f"place-slots: {exc}", file=sys.stderr)
        return 2
    print(f"{'model':<24} {'slot':>5}  {'owner':<21}  {'planned':<21}")
    for model, slot, owner, planned in rows:
        mark = "" if owner == planned else (" (moved)" if args.apply else " (to move)")
        print(f"{model:<24} {slot:>5}  {owner.address:<21}  {planned.address:<21}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
