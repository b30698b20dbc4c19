"""Which sub-queue a request of a sharded model joins (``Model.sub_queues``).

A model of S > 1 sub-queues has its queue split over the tags ``sub_queue_tag(model,
0..S-1)``.  A choice picks two sub-queues at random and takes the shorter (the power
of two choices), by the lengths this process last learned from its own enqueues: the
ENQUEUE script returns the queue's length after every push, so the choice costs no
round trip.  A length older than ``DEPTH_FRESH_S`` counts as 0 (so a sub-queue that
looked long once is tried again, and its length learned anew), and every request
routed adds one to its sub-queue's length until the next enqueue reply corrects it.

One choice holds for up to ``STICK`` requests of one event-loop tick (the enqueuer's
flush starts a new one): a tick's requests then still travel as one ENQUEUE call and
as multi-row packs (``packing``), as they do for a model of one sub-queue (choosing
per request split a tick's requests over S calls and S smaller packs: the hot-model
bench in ``docs/scaling.md``).  A burst larger than ``STICK`` spreads over several
sub-queues.  A request that carries the caller's own
id goes to the sub-queue its id hashes to, so that a retried push finds its marker
(the dedupe) in the same slot."""

from __future__ import annotations

import random
import time
import zlib
from typing import Final

from redbatch import protocol

DEPTH_FRESH_S: Final = 1.0  # a sub-queue length learned longer ago than this counts as 0
STICK: Final = 32  # requests of one tick that follow one choice (a full pack's rows)


class Router:
    """The sub-queue lengths one process learned, and the choice they drive."""

    def __init__(self) -> None:
        self._depths: dict[str, tuple[int, float]] = {}  # tag -> (length, when learned)
        self._routed: dict[str, int] = {}  # tag -> requests routed since it was learned
        self._stuck: dict[str, tuple[str, int]] = {}  # model -> this tick's tag, room left

    def pick(self, model: str, count: int, request_id: str | None = None) -> str:
        """The tag of the sub-queue a request of ``model`` (of ``count`` sub-queues)
        joins: ``model`` itself for a model of one."""
        if count <= 1:
            return model
        if request_id:
            tag = protocol.sub_queue_tag(model, zlib.crc32(request_id.encode()) % count)
        else:
            tag = self._stuck_to(model, count)
        self._routed[tag] = self._routed.get(tag, 0) + 1
        return tag

    def _stuck_to(self, model: str, count: int) -> str:
        """This tick's choice for ``model`` while it has room, else a new one."""
        tag, room = self._stuck.get(model, ("", 0))
        if room <= 0 or protocol.model_of_tag(tag) != model:
            first = random.randrange(count)
            second = (first + 1 + random.randrange(count - 1)) % count
            tag, room = min((protocol.sub_queue_tag(model, first),
                             protocol.sub_queue_tag(model, second)), key=self._guess), STICK
        self._stuck[model] = (tag, room - 1)
        return tag

    def tick(self) -> None:
        """A new event-loop tick (the enqueuer's flush): the next requests choose anew."""
        if self._stuck:
            self._stuck.clear()

    def _guess(self, tag: str) -> int:
        """The sub-queue's length as learned, with the requests routed there since."""
        return self.depth(tag) + self._routed.get(tag, 0)

    def depth(self, tag: str) -> int:
        """The sub-queue's length as last learned, 0 once stale or never learned."""
        depth, at = self._depths.get(tag, (0, 0.0))
        return depth if time.monotonic() - at <= DEPTH_FRESH_S else 0

    def learned(self, tag: str, depth: int) -> None:
        """An enqueue's reply: the sub-queue's length after it."""
        self._depths[tag] = (depth, time.monotonic())
        self._routed[tag] = 0

    def total(self, model: str, count: int) -> int:
        """The model's queued entries as far as this process knows: the sum over its
        sub-queues of their fresh lengths."""
        return sum(self.depth(tag) for tag in protocol.sub_queue_tags(model, count))


    def others(self, tag: str, count: int) -> int:
        """The entries this process knows in the sub-queues of ``tag``'s model other
        than ``tag`` (with the requests it routed there since it learned them)."""
        return sum(self._guess(other) for other in _others(tag, count))

    def caps(self, tag: str, count: int, caps: tuple[int, int | None], level: int
             ) -> tuple[int, int | None]:
        """A push's caps in sub-queue ``tag`` (of ``count``): the model's queue cap
        and its priority ``level``'s own (if any) of ``caps``, each less what the other
        sub-queues hold as far as this process knows (``room_cap``)."""
        cap, level_cap = caps
        shared = room_cap(cap, self.others(tag, count))
        if level_cap is None:
            return shared, None
        return shared, room_cap(level_cap, sum(self.depth(_at(other, level))
                                               for other in _others(tag, count)))

    def learn(self, tag: str, count: int, level: int, depths: list[int]) -> list[int]:
        """An enqueue's reply (``depths``: the sub-queue's entries after it, and, for a
        priority level, the level's): learned, and returned summed over the sub-queues
        as far as this process knows (what a refusal reports)."""
        self.learned(tag, depths[0])
        model = protocol.model_of_tag(tag)
        summed = [max(self.total(model, count), depths[0])]
        if len(depths) > 1:
            self._depths[_at(tag, level)] = (depths[1], time.monotonic())
            summed.append(depths[1] + sum(self.depth(_at(other, level))
                                          for other in _others(tag, count)))
        return summed


def _others(tag: str, count: int) -> list[str]:
    """The sub-queues of ``tag``'s model (of ``count``) other than ``tag``."""
    return [other for other in protocol.sub_queue_tags(protocol.model_of_tag(tag), count)
            if other != tag]


def _at(tag: str, level: int) -> str:
    """The key of sub-queue ``tag``'s priority ``level`` among the learned lengths."""
    return f"{tag}#{level}"


def room_cap(cap: int, others: int) -> int:
    """The cap that one sub-queue's push is held to, for a model whose queue cap is
    ``cap``: the cap less what the other sub-queues hold as far as this process knows
    (``Router.others``).  A tick's requests and a ``submit_many`` join one sub-queue:
    they go in whole while the model has room.  Producers that do not know each other's
    pushes (lengths older than ``DEPTH_FRESH_S``, sub-queues a process never pushed to)
    can overshoot the model's cap by what they missed, never one sub-queue the cap."""
    return cap - others
