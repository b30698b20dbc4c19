"""Priority levels of a model: its count, its default level and the per-level queue
caps, as workers publish them (the meta's ``priority`` section) and producers read
them (``LIVE_SUMMARY``).  Level 1 is the most urgent; a request that gives no level
(or 0) takes the model's default.  A model of one level has none of this on the wire:
its single queue is ``protocol.queue_key(model)`` and nothing else changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from redbatch import defaults, protocol
from redbatch.errors import ConfigError, InvalidPayload

if TYPE_CHECKING:
    import redis.asyncio as aioredis


@dataclass(frozen=True, slots=True)
class Levels:
    """A model's priority levels ``1..count``."""

    count: int = defaults.PRIORITY_LEVELS
    default: int = defaults.DEFAULT_PRIORITY
    caps: tuple[int, ...] | None = None  # each level's own queue cap; None: none

    @property
    def many(self) -> bool:
        return self.count > 1

    def resolve(self, model: str, priority: int | None) -> int:
        """The level of a request that asks for ``priority`` (None or 0: the default);
        ``InvalidPayload`` naming it when it is not an integer in range."""
        if priority is None or (type(priority) is int and priority == 0):
            return self.default
        if type(priority) is not int:
            raise InvalidPayload(f"priority must be an integer (1..{self.count} for model "
                                 f"{model!r}; 0 or none: its default), got {priority!r}")
        if not 1 <= priority <= self.count:
            raise InvalidPayload(
                f"priority {priority!r} is out of range for model {model!r}: its levels "
                f"are 1..{self.count} (1 most urgent; 0 or none: its default, "
                f"{self.default})")
        return priority

    def cap(self, level: int) -> int | None:
        """Level ``level``'s own queue cap, if it has one."""
        return None if self.caps is None else self.caps[level - 1]

    def queues(self, model: str) -> list[str]:
        """Every level's queue, most urgent first."""
        return protocol.level_queues(model, self.count, self.default)

    def to_json(self) -> dict[str, Any]:
        return {"levels": self.count, "default": self.default,
                "caps": None if self.caps is None else list(self.caps)}


ONE = Levels()


def check_levels(model: str, count: Any, default: Any) -> None:
    """``ConfigError`` unless ``count`` is 1..MAX_PRIORITY_LEVELS and ``default`` 1..count."""
    top = protocol.MAX_PRIORITY_LEVELS
    if type(count) is not int or not 1 <= count <= top:
        raise ConfigError(f"model {model!r}: priority_levels must be 1..{top}, got {count!r}")
    if type(default) is not int or not 1 <= default <= count:
        raise ConfigError(f"model {model!r}: default_priority must be 1..{count} "
                          f"(its priority_levels), got {default!r}")


def from_summary(text: Any) -> Levels:
    """The levels of the meta's ``priority`` section as ``LIVE_SUMMARY`` returns it
    (JSON, "" for a model of one level); one level when it cannot be read."""
    if not text:
        return ONE
    try:
        return from_section(orjson.loads(text))
    except orjson.JSONDecodeError:
        return ONE


def from_section(data: Any) -> Levels:
    """The levels of a meta's ``priority`` section (``{"levels", "default", "caps"}``);
    one level when there is none or it cannot be read."""
    try:
        count, default = int(data["levels"]), int(data["default"])
        check_levels("", count, default)  # a corrupt or foreign meta: one level
        caps = data.get("caps")
        return Levels(count, default, tuple(int(c) for c in caps)
                      if isinstance(caps, list) and len(caps) == count else None)
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError):
        return ONE


def of_meta(raw: bytes | str | None) -> Levels:
    """The levels of a model's raw meta (one level when it has no ``priority``)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if not text or '"priority"' not in text:
        return ONE
    try:
        return from_section(orjson.loads(text).get("priority"))
    except (orjson.JSONDecodeError, AttributeError):
        return ONE


def by_level(depths: list[int]) -> dict[str, int]:
    """Queue depths per level (``{"1": n, ...}``), for listings."""
    return {str(level): depth for level, depth in enumerate(depths, 1)}


def sub_queues_of(raw: bytes | str | None) -> int:
    """A model's sub-queues from its raw meta (``Model.sub_queues``; 1 when none)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if not text or '"sub_queues"' not in text:
        return 1
    try:
        count = orjson.loads(text).get("sub_queues")
    except (orjson.JSONDecodeError, AttributeError):
        return 1
    return count if type(count) is int and 1 <= count <= protocol.MAX_SUB_QUEUES else 1


def queued_sub_queues_of(raw: bytes | str | None, draining: bytes | None = None) -> int:
    """The sub-queues that may hold a model's entries (``raw``: its meta): its count, or
    more while workers drain those above a shrunk count (``draining``: what its
    ``sub_queues_draining_key`` holds, read with the meta: ``read_meta``)."""
    try:
        held = int(draining or 1)
    except ValueError:
        held = 1
    return max(sub_queues_of(raw), held if 1 <= held <= protocol.MAX_SUB_QUEUES else 1)


def level_keys(model: str, raw: bytes | str | None, draining: bytes | None = None
               ) -> list[list[str]]:
    """Each level's queues (most urgent first), one per sub-queue that may hold
    entries (``raw``: the model's meta; ``queued_sub_queues_of``): the keys whose
    lengths add up to a level's depth."""
    tags = protocol.sub_queue_tags(model, queued_sub_queues_of(raw, draining))
    by_tag = [of_meta(raw).queues(tag) for tag in tags]
    return [list(keys) for keys in zip(*by_tag, strict=True)]


def meta_keys(model: str) -> tuple[str, str]:
    """What a queue depth reader GETs first, in one round trip (``read_meta``): the
    model's meta and its ``sub_queues_draining_key`` (one slot, the model's)."""
    return protocol.meta_key(model), protocol.sub_queues_draining_key(model)


async def read_meta(redis: aioredis.Redis, model: str) -> tuple[bytes | None, bytes | None]:
    """A model's raw meta and sub-queues draining count (``meta_keys``), in one round
    trip, for ``level_keys`` and ``queue_depths``."""
    async with redis.pipeline(transaction=False) as pipe:
        for key in meta_keys(model):
            pipe.get(key)
        meta, draining = await pipe.execute()
    return meta, draining


async def queue_depths(redis: aioredis.Redis, model: str, meta: bytes | str | None,
                       draining: bytes | None = None) -> list[int]:
    """Each level's queue length, most urgent first (``meta``, ``draining``: as
    ``read_meta`` returns them), summed over the model's sub-queues, in one round
    trip."""
    levels = level_keys(model, meta, draining)
    async with redis.pipeline(transaction=False) as pipe:
        for keys in levels:
            for key in keys:
                pipe.llen(key)
        lengths = iter(await pipe.execute())
    return [sum(int(next(lengths)) for _key in keys) for keys in levels]
