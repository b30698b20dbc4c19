"""Place models' slots on a Redis Cluster on purpose (``scripts/place-slots``).

Every key of a model's sub-queue carries its hash tag (``{model}``, ``{model:1}`` ..
``{model:S-1}``: ``protocol.sub_queue_tags``), so each sub-queue lives in one slot, on
one primary.  Hashing a few tags is lumpy: 6 models on 3 primaries land 2-2-2 only by
luck, and a hot model's 3 sub-queues may share a primary.  This places every
sub-queue of the given models (S as producers read it: ``LIVE_SUMMARY``; or given):
each model's sub-queues round-robin over the primaries (its counts per primary
differ by one at most), the distinct slots of all evenly too (likewise), moving the
fewest slots that both allow (``placement_flow``); it moves them as ``redis-cli --cluster reshard``
moves a slot: ``SETSLOT IMPORTING`` / ``MIGRATING``, ``MIGRATE`` of the slot's keys,
then ``SETSLOT NODE`` on every primary.

    python -m redbatch.placement redis+cluster://h:p MODEL [MODEL ...]          # the plan
    python -m redbatch.placement redis+cluster://h:p MODEL [MODEL ...] --apply  # move
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis
from redis.crc import key_slot

from redbatch import lua, protocol, registry
from redbatch.config import RedisSettings
from redbatch.errors import ConfigError, InvalidPayload, RedisUnavailable
from redbatch.placement_flow import extras

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

    def of(self, slot: int) -> Primary:
        """The primary that owns ``slot``; ``ConfigError`` when none does."""
        node = self.owner.get(slot)
        if node is None:
            raise ConfigError(f"slot {slot} has no owner: assign every slot first "
                              "(redis-cli --cluster fix)")
        return node


def plan(groups: Sequence[Sequence[int]], slot_map: SlotMap) -> dict[int, Primary]:
    """Each distinct slot of ``groups`` (each a model's sub-queues' slots) -> the
    primary it should live on: each group round-robin over the primaries (its counts
    differ by one at most) and all slots evenly (likewise), moving the fewest slots
    that both spreads allow (``placement_flow``; a slot in two groups counts in the
    first; ties keep the earlier group's slots)."""
    distinct = [group for group in _distinct(groups) if group]
    primaries, width = slot_map.primaries, len(slot_map.primaries)
    keeps = [[_owned(group, slot_map, p) > len(group) // width for p in primaries]
             for group in distinct]
    chosen = extras([len(group) for group in distinct], keeps, width)
    placed: dict[int, Primary] = {}
    for group, picks in zip(distinct, chosen, strict=True):
        counts = {p: len(group) // width + (i in picks) for i, p in enumerate(primaries)}
        _assign(group, counts, slot_map, placed)
    return placed


def _distinct(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each group's slots, each slot in the first group that names it, once."""
    seen: set[int] = set()
    distinct = []
    for group in groups:
        distinct.append([slot for slot in dict.fromkeys(group) if slot not in seen])
        seen.update(group)
    return distinct


def _owned(group: list[int], slot_map: SlotMap, node: Primary) -> int:
    """How many of ``group``'s slots ``node`` owns now."""
    return sum(1 for slot in group if slot_map.of(slot) == node)


def _assign(group: list[int], counts: dict[Primary, int], slot_map: SlotMap,
            placed: dict[int, Primary]) -> None:
    """``counts[p]`` of ``group``'s slots on each primary ``p``: first those it owns
    (in the group's order), then the others where room is left (in address order)."""
    room, rest = dict(counts), []
    for slot in group:
        owner = slot_map.of(slot)
        if room.get(owner, 0) > 0:
            placed[slot], room[owner] = owner, room[owner] - 1
        else:
            rest.append(slot)
    for slot in rest:
        target = next(p for p in slot_map.primaries if room[p] > 0)
        placed[slot], room[target] = target, room[target] - 1


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
                         socket_connect_timeout=self.settings.connect_timeout_s,
                         **dict(self.topology.options.tls)) as client:  # (the URL's TLS)
            return client.execute_command(*command)

    def slot_map(self) -> SlotMap:
        """From the first seed that answers ``CLUSTER SLOTS``."""
        why = "none given"
        for host, port in self.topology.seeds:
            try:
                return _parse_slots(self.ask(host, port, "CLUSTER", "SLOTS"))
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                why = f"{type(exc).__name__}: {exc}"  # (redis-py quotes no password)
        raise RedisUnavailable(f"no seed of {self.settings.safe_url} answered (the last: "
                               f"{why})")

    def on(self, node: Primary, *command: str | int | bytes) -> object:
        return self.ask(node.host, node.port, *command)

    def script(self, node: Primary, source: str, keys: list[str], *args: str | int) -> object:
        """``source`` run on ``node`` by ``SCRIPT LOAD`` and ``EVALSHA``, the two that the
        documented ACL user may run (not ``EVAL``)."""
        sha = _text(self.on(node, "SCRIPT", "LOAD", source))
        return self.on(node, "EVALSHA", sha, len(keys), *keys, *args)


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


Row = tuple[str, int, Primary, Primary]  # (sub-queue tag, slot, owner now, planned owner)


@dataclass(frozen=True)
class Placement:
    """What ``place`` found: a ``Row`` per sub-queue, and the S it placed of each model
    named (read or given; not of a model named by its tags alone)."""

    rows: list[Row]
    sub_queues: dict[str, int]


def sub_queue_count(nodes: Nodes, slot_map: SlotMap, model: str) -> int:
    """``model``'s sub-queues to place, on the primary of the model's own slot: the
    more of what producers read (``LIVE_SUMMARY``: its workers' S, or the stored
    override once their meta names ``sub_queues``) and the stored override itself
    (set before its workers' next beat, or with no worker yet: a slot placed early
    does no harm)."""
    node = slot_map.of(model_slot(model))
    keys = registry.summary_keys(model)
    reply = nodes.script(node, lua.LIVE_SUMMARY, keys, protocol.now_ms())
    stored = nodes.on(node, "HMGET", protocol.config_key(model), "sub_queues")
    return max(registry.summary_of(reply).sub_queues,
               registry.sub_queue_count(stored[0]))  # type: ignore[index]


def groups_of(names: Sequence[str], count: Callable[[str], int]) -> dict[str, list[str]]:
    """Each model's sub-queue tags, each once: a model's name gives its ``count(name)``
    tags, a tag (``MODEL:i``) itself; ``ConfigError`` for a name that is neither."""
    groups: dict[str, list[str]] = {}
    for name in map(_checked, names):
        tags = [name] if ":" in name else protocol.sub_queue_tags(name, count(name))
        group = groups.setdefault(protocol.model_of_tag(name), [])
        group += [tag for tag in tags if tag not in group]
    return groups


def _checked(name: str) -> str:
    """``name`` if it is a model's name or a sub-queue tag, else ``ConfigError``."""
    return _tag(name) if ":" in name else _model(name)


def _model(name: str) -> str:
    """``name`` if it is a model's name, else ``ConfigError``."""
    if not _is_model(name):
        raise ConfigError(f"{name!r} is not a model's name (1-64 of [A-Za-z0-9_.-]) nor a "
                          f"sub-queue tag (MODEL:i, i in 1..{protocol.MAX_SUB_QUEUES - 1})")
    return name


def _tag(name: str) -> str:
    """``name`` if it is the tag of a sub-queue other than a model's first (``MODEL:i``,
    as ``protocol.sub_queue_tag`` writes it: sub-queue 0's tag is the model's name),
    else ``ConfigError``."""
    model, _, index = name.partition(":")
    if not _is_model(model) or not (index.isascii() and index.isdigit()) or \
            not 1 <= int(index) < protocol.MAX_SUB_QUEUES or \
            protocol.sub_queue_tag(model, int(index)) != name:
        raise ConfigError(f"{name!r} is not a sub-queue tag: MODEL:i, i in "
                          f"1..{protocol.MAX_SUB_QUEUES - 1} (sub-queue 0's is MODEL)")
    return name


def place(settings: RedisSettings, names: Sequence[str], apply: bool = False,
          sub_queues: Mapping[str, int] | None = None) -> Placement:
    """A ``Row`` for each sub-queue of the models ``names`` (S read from Redis, or
    ``sub_queues[model]``; a tag ``MODEL:i`` names that sub-queue alone); with
    ``apply``, the slots that must move are moved (and the owner then is the planned
    one)."""
    names = [_checked(name) for name in names]  # before any connection
    nodes = Nodes(settings)
    slot_map = nodes.slot_map()
    counts = dict(sub_queues or {})

    def count(model: str) -> int:
        if model not in counts:
            counts[model] = sub_queue_count(nodes, slot_map, model)
        return counts[model]

    groups = groups_of(names, count)
    placed = plan([[model_slot(t) for t in tags] for tags in groups.values()], slot_map)
    if apply:
        for slot, target in placed.items():
            if slot_map.of(slot) != target:
                move_slot(nodes, slot, slot_map.of(slot), target, slot_map.primaries)
    return Placement([(tag, model_slot(tag), slot_map.of(model_slot(tag)),
                       placed[model_slot(tag)]) for tags in groups.values() for tag in tags],
                     {m: counts[m] for m in names if m in counts})


def given_counts(pairs: Sequence[str]) -> dict[str, int]:
    """``--sub-queues MODEL=S`` values: model -> S; ``ConfigError`` on a bad one."""
    given: dict[str, int] = {}
    for pair in pairs:
        model, _, count = pair.partition("=")
        if not _is_model(model) or not (count.isascii() and count.isdigit()) or \
                not 1 <= int(count) <= protocol.MAX_SUB_QUEUES:
            raise ConfigError(f"--sub-queues takes MODEL=S, S in 1..{protocol.MAX_SUB_QUEUES}"
                              f": not {pair!r}")
        given[model] = int(count)
    return given


def _is_model(name: str) -> bool:
    """Whether ``name`` is a model's name (``protocol.check_model_name``)."""
    try:
        protocol.check_model_name(name)
    except InvalidPayload:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="place-slots", description="Spread models' slots evenly over a Redis Cluster's "
        "primaries: each model's sub-queues (hash tags {MODEL}, {MODEL:1} .. {MODEL:S-1}) "
        "round-robin, and all of them evenly.")
    parser.add_argument("url", help="redis+cluster://[user:password@]host:port[,host:port]")
    parser.add_argument("models", nargs="+", help="model names (S read from Redis: the "
                        "model's sub_queues), or sub-queue tags MODEL:i")
    parser.add_argument("--sub-queues", action="append", default=[], metavar="MODEL=S",
                        help="place S sub-queues of MODEL, whatever Redis says (repeatable)")
    parser.add_argument("--apply", action="store_true", help="move the slots (else: print "
                        "the plan)")
    args = parser.parse_args(argv)
    try:
        given = given_counts(args.sub_queues)
        names = [*args.models, *(m for m in given if m not in args.models)]
        placement = place(RedisSettings(args.url), names, args.apply, given)
    except (ConfigError, RedisUnavailable, redis.RedisError) as exc:
        print(f"place-slots: {exc}", file=sys.stderr)
        return 2
    _print(placement, args.apply)
    return 0


def _print(placement: Placement, applied: bool) -> None:
    counts = " ".join(f"{m}={n}" for m, n in placement.sub_queues.items())
    print(f"sub-queues placed (S): {counts}" if counts else "sub-queues placed: as named")
    print(f"{'sub-queue':<28} {'slot':>5}  {'owner':<21}  {'planned':<21}")
    for tag, slot, owner, planned in placement.rows:
        mark = "" if owner == planned else (" (moved)" if applied else " (to move)")
        print(f"{tag:<28} {slot:>5}  {owner.address:<21}  {planned.address:<21}{mark}")


if __name__ == "__main__":
    sys.exit(main())
