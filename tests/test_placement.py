"""Placing models' slots on purpose (``redbatch.placement``, ``scripts/place-slots``):
the plan spreads slots evenly and moves as few as it can; applied on a real cluster,
each primary then serves its share and the moved keys came along."""

from __future__ import annotations

from collections import Counter

import pytest

from redbatch import protocol
from redbatch.config import RedisSettings
from redbatch.placement import Primary, SlotMap, main, model_slot, place, plan
from tests.engines import ClusterEngine

A, B, C = (Primary(f"id{n}", "10.0.0.1", 7000 + n) for n in range(3))


def slot_map(owners: dict[int, Primary]) -> SlotMap:
    return SlotMap((A, B, C), owners)


def test_all_slots_on_one_primary_are_spread_and_two_stay() -> None:
    slots = [10, 20, 30, 40, 50, 60]
    placed = plan(slots, slot_map(dict.fromkeys(slots, A)))
    assert Counter(p.node_id for p in placed.values()) == {"id0": 2, "id1": 2, "id2": 2}
    assert [placed[s] for s in (10, 20)] == [A, A]  # kept where they were


def test_a_spread_already_even_moves_nothing() -> None:
    owners = {1: A, 2: B, 3: C, 4: A, 5: B, 6: C}
    assert plan(list(owners), slot_map(owners)) == owners


def test_counts_differ_by_one_at_most_and_shared_slots_count_once() -> None:
    slots = [1, 2, 3, 4, 5, 6, 7, 7]  # two models in slot 7: one slot to place
    placed = plan(slots, slot_map(dict.fromkeys(slots, B)))
    assert len(placed) == 7
    counts = Counter(p.node_id for p in placed.values())
    assert max(counts.values()) - min(counts.values()) <= 1


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
    rows = place(RedisSettings(redis_cluster.url), models, apply=True)
    redis_cluster.wait_ok()
    assert Counter(planned.port for *_, planned in rows) == \
        {p.port: 2 for p in redis_cluster.primaries()}
    assert sum(before != planned for _m, _s, before, planned in rows) == 4
    for model, slot, _before, planned in rows:
        assert slot == model_slot(model)
        now = redis_cluster.owner(protocol.queue_key(model))
        assert now.port == planned.port
        assert now.ask("LRANGE", protocol.queue_key(model), 0, -1) == [model.encode()]
    assert place(RedisSettings(redis_cluster.url), models) == \
        [(m, s, p, p) for m, s, _b, p in rows]  # a second run finds nothing to move
