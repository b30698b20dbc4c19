"""Placing models' slots on purpose (``redbatch.placement``, ``scripts/place-slots``):
the plan spreads each model's sub-queues round-robin and all slots evenly, and moves as
few as it can; applied on a real cluster, each primary then serves its share and the
moved keys came along."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import pytest
import redis

from redbatch import placement, protocol
from redbatch.config import RedisSettings
from redbatch.errors import ConfigError
from redbatch.placement import Primary, SlotMap, main, model_slot, place, plan
from tests.engines import ClusterEngine

A, B, C = (Primary(f"id{n}", "10.0.0.1", 7000 + n) for n in range(3))


def slot_map(owners: dict[int, Primary]) -> SlotMap:
    return SlotMap((A, B, C), owners)


def test_all_slots_on_one_primary_are_spread_and_two_stay() -> None:
    slots = [10, 20, 30, 40, 50, 60]
    placed = plan([[s] for s in slots], slot_map(dict.fromkeys(slots, A)))
    assert Counter(p.node_id for p in placed.values()) == {"id0": 2, "id1": 2, "id2": 2}
    assert [placed[s] for s in (10, 20)] == [A, A]  # kept where they were


def test_a_spread_already_even_moves_nothing() -> None:
    owners = {1: A, 2: B, 3: C, 4: A, 5: B, 6: C}
    assert plan([[s] for s in owners], slot_map(owners)) == owners


def test_counts_differ_by_one_at_most_and_shared_slots_count_once() -> None:
    slots = [1, 2, 3, 4, 5, 6, 7, 7]  # two models in slot 7: one slot to place
    placed = plan([[s] for s in slots], slot_map(dict.fromkeys(slots, B)))
    assert len(placed) == 7
    counts = Counter(p.node_id for p in placed.values())
    assert max(counts.values()) - min(counts.values()) <= 1


def spread(slots: list[int], placed: dict[int, Primary]) -> list[int]:
    """How many of ``slots`` each primary got (A, B, C)."""
    counts = Counter(placed[s] for s in slots)
    return [counts[p] for p in (A, B, C)]


def test_a_models_sub_queues_go_to_different_primaries_first() -> None:
    hot = [1, 2, 3]  # two of its sub-queues on A: even in all, but not for the model
    owners = {1: A, 2: A, 3: B, 4: B, 5: C, 6: C}
    placed = plan([hot, [4], [5], [6]], slot_map(owners))
    assert spread(hot, placed) == [1, 1, 1]
    assert spread(list(owners), placed) == [2, 2, 2]
    assert sum(placed[s] != owners[s] for s in owners) == 2  # 2 -> C, and one of C's -> A


def test_a_slot_kept_leaves_room_for_the_next_models_own() -> None:
    owners = {55: A, 42: A, 94: B}  # 42 moves to C: 94 stays on B
    placed = plan([[55], [42], [94]], slot_map(owners))
    assert sum(placed[s] != owners[s] for s in owners) == 1
    assert placed == {55: A, 42: C, 94: B}


def fewest_moves(slots: list[int], owners: dict[int, Primary]) -> int:
    """The fewest slots that move to even out ``slots`` (models of one sub-queue)."""
    evens = (dict(zip(slots, combo, strict=True)) for combo in
             itertools.product((A, B, C), repeat=len(slots)))
    return min(sum(p[s] != owners[s] for s in slots) for p in evens
               if max(spread(slots, p)) - min(spread(slots, p)) <= 1)


def test_models_of_one_sub_queue_move_the_fewest_slots() -> None:
    rng = random.Random(11)
    for _ in range(150):
        slots = rng.sample(range(16384), rng.randint(1, 7))
        owners = {s: rng.choice([A, A, B, C]) for s in slots}
        placed = plan([[s] for s in slots], slot_map(owners))
        assert sum(placed[s] != owners[s] for s in slots) == fewest_moves(slots, owners)


def test_both_spreads_hold_whatever_the_start() -> None:
    rng = random.Random(7)
    for _ in range(300):
        sizes = [rng.choice([1, 1, 2, 3, 4, 5]) for _ in range(rng.randint(1, 6))]
        groups = [[rng.randrange(16384) for _ in range(n)] for n in sizes]
        owners = {s: rng.choice([A, A, B, C]) for g in groups for s in g}
        placed = plan(groups, slot_map(owners))
        assert set(placed) == set(owners)
        firsts: set[int] = set()
        for group in groups:
            mine = [s for s in dict.fromkeys(group) if s not in firsts]
            firsts.update(group)
            assert max(spread(mine, placed)) - min(spread(mine, placed)) <= 1, groups
        total = spread(list(owners), placed)
        assert max(total) - min(total) <= 1, groups


def even(slots: list[int], placed: dict[int, Primary]) -> bool:
    counts = spread(slots, placed)
    return max(counts) - min(counts) <= 1


def fewest_moves_of_groups(groups: list[list[int]], owners: dict[int, Primary]) -> int:
    """The fewest slots that move under both spreads (each group's, and all slots')."""
    slots = list(owners)
    plans = (dict(zip(slots, combo, strict=True)) for combo in
             itertools.product((A, B, C), repeat=len(slots)))
    return min(sum(p[s] != owners[s] for s in slots) for p in plans
               if even(slots, p) and all(even(g, p) for g in groups))


def test_a_hot_model_and_a_lone_one_move_one_slot() -> None:
    """The hot model keeps 2 of its 4 sub-queues on C, the lone model moves off C."""
    owners = {6955: A, 8562: C, 12304: C, 1369: A, 1081: C}
    groups = [[6955, 8562, 12304, 1369], [1081]]
    placed = plan(groups, slot_map(owners))
    assert sum(placed[s] != owners[s] for s in owners) == 1
    assert even(list(owners), placed) and all(even(g, placed) for g in groups)


def test_models_of_several_sub_queues_move_the_fewest_slots_too() -> None:
    rng = random.Random(5)
    for _ in range(300):
        slots = rng.sample(range(16384), rng.randint(2, 7))
        cuts = sorted(rng.sample(range(1, len(slots)), rng.randint(0, len(slots) - 1)))
        groups = [slots[a:b] for a, b in zip([0, *cuts], [*cuts, len(slots)], strict=True)]
        owners = {s: rng.choice([A, B, C, A]) for s in slots}
        placed = plan(groups, slot_map(owners))
        assert even(slots, placed) and all(even(g, placed) for g in groups), groups
        assert sum(placed[s] != owners[s] for s in slots) == fewest_moves_of_groups(
            groups, owners), (groups, owners)


def test_a_model_names_its_sub_queues_and_a_tag_itself() -> None:
    counts = {"hot": 3, "m": 1}
    assert placement.groups_of(["hot", "m", "x:2", "hot:1"], counts.__getitem__) == {
        "hot": ["hot", "hot:1", "hot:2"], "m": ["m"], "x": ["x:2"]}


def test_a_name_that_is_no_model_nor_tag_is_refused(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    for bad in ("hot:0", "hot:", "hot:x", "hot:64", "hot:99", "hot:01", "hot:²", ":1",
                "hot:1:2", "h t"):
        with pytest.raises(ConfigError, match="sub-queue tag"):
            placement.groups_of([bad], lambda _model: 1)
    assert main(["redis+cluster://127.0.0.1:1", "hot:0"]) == 2
    assert "is not a sub-queue tag" in capsys.readouterr().err


def test_sub_queues_given_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert placement.given_counts(["hot=3", "m=1"]) == {"hot": 3, "m": 1}
    for bad in ("hot", "hot=0", "hot=65", "=2", "hot=x", "hot=²", "hot:1=3", "h t=2"):
        with pytest.raises(ConfigError, match="MODEL=S"):
            placement.given_counts([bad])
    for bad in ("hot=0", "hot=²"):  # a message, never a traceback
        assert main(["redis+cluster://127.0.0.1:1", "hot", "--sub-queues", bad]) == 2
        assert "--sub-queues takes MODEL=S" in capsys.readouterr().err


class OneNode:
    """``placement.Nodes`` on one plain Redis: every node's command goes to it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def on(self, _node: Primary, *command: str | int | bytes) -> object:
        return self.client.execute_command(*command)

    script = placement.Nodes.script


def test_s_is_the_stored_override_before_the_workers_publish_it(raw_redis: redis.Redis
                                                                ) -> None:
    raw_redis.hset(protocol.config_key("fresh"), "sub_queues", 3)  # no worker yet
    raw_redis.set(protocol.meta_key("plain"), b'{"name":"plain"}')  # its workers' S = 1
    raw_redis.hset(protocol.config_key("plain"), "sub_queues", 2)  # changed since
    raw_redis.set(protocol.meta_key("live"), b'{"name":"live","sub_queues":4}')
    models = ("fresh", "plain", "live", "cold")
    owners = slot_map({model_slot(m): A for m in models})
    nodes: Any = OneNode(raw_redis)
    assert [placement.sub_queue_count(nodes, owners, m) for m in models] == [3, 2, 4, 1]


def test_a_slot_no_primary_owns_is_a_message(raw_redis: redis.Redis) -> None:
    with pytest.raises(ConfigError, match="slot 5 has no owner"):
        plan([[5]], slot_map({}))
    with pytest.raises(ConfigError, match="has no owner"):
        placement.sub_queue_count(OneNode(raw_redis), slot_map({}), "hot")  # type: ignore[arg-type]


def test_a_plain_redis_url_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["redis://127.0.0.1:1/0", "m"]) == 2
    assert "redis+cluster://" in capsys.readouterr().err


@pytest.mark.engines
@pytest.mark.timeout(90)
def test_applied_on_a_cluster_each_primary_serves_its_share(redis_cluster: ClusterEngine
                                                             ) -> None:
    models = [f"m{n}" for n in range(6)]
    owner = redis_cluster.owner(protocol.queue_key(models[0]))
    for model in models:  # everything on one primary first: the lumpiest start
        if redis_cluster.owner(protocol.queue_key(model)) is not owner:
            redis_cluster.migrate(protocol.queue_key(model), owner)
    for model in models:
        owner.ask("RPUSH", protocol.queue_key(model), model)
    rows = place(RedisSettings(redis_cluster.url), models, apply=True).rows
    redis_cluster.wait_ok()
    assert Counter(planned.port for *_, planned in rows) == \
        {p.port: 2 for p in redis_cluster.primaries()}
    assert sum(before != planned for _m, _s, before, planned in rows) == 4
    for model, slot, _before, planned in rows:
        assert slot == model_slot(model)
        now = redis_cluster.owner(protocol.queue_key(model))
        assert now.port == planned.port
        assert now.ask("LRANGE", protocol.queue_key(model), 0, -1) == [model.encode()]
    assert place(RedisSettings(redis_cluster.url), models).rows == \
        [(m, s, p, p) for m, s, _b, p in rows]  # a second run finds nothing to move


@pytest.mark.engines
@pytest.mark.timeout(90)
def test_a_models_live_sub_queues_are_placed_one_per_primary(
        redis_cluster: ClusterEngine, capsys: pytest.CaptureFixture[str]) -> None:
    tags = protocol.sub_queue_tags("hot", 3)
    owner = redis_cluster.owner(protocol.queue_key("hot"))
    for tag in tags[1:]:  # every sub-queue on one primary first
        if redis_cluster.owner(protocol.queue_key(tag)) is not owner:
            redis_cluster.migrate(protocol.queue_key(tag), owner)
    owner.ask("SET", protocol.meta_key("hot"), '{"sub_queues":2}')  # its workers' S
    owner.ask("HSET", protocol.config_key("hot"), "sub_queues", 3)  # changed live since
    for tag in tags:
        owner.ask("RPUSH", protocol.queue_key(tag), tag)
    planned = place(RedisSettings(redis_cluster.url), ["hot", "cold"])
    assert [tag for tag, *_ in planned.rows] == [*tags, "cold"]
    assert planned.sub_queues == {"hot": 3, "cold": 1}
    assert main([redis_cluster.url, "hot", "cold"]) == 0  # the plan, and the S it used
    assert "sub-queues placed (S): hot=3 cold=1" in capsys.readouterr().out
    given = place(RedisSettings(redis_cluster.url), ["hot"], sub_queues={"hot": 2}).rows
    assert [tag for tag, *_ in given] == tags[:2]  # given, not read
    rows = place(RedisSettings(redis_cluster.url), ["hot", "cold"], apply=True).rows
    redis_cluster.wait_ok()
    assert len({planned.port for tag, _s, _b, planned in rows if tag in tags}) == 3
    for tag, _slot, _before, planned in rows[:3]:
        now = redis_cluster.owner(protocol.queue_key(tag))
        assert now.port == planned.port
        assert now.ask("LRANGE", protocol.queue_key(tag), 0, -1) == [tag.encode()]
