"""A process's reply listeners: one per model (per sub-queue of a sharded model) it
has requests in flight on.

A model's replies come to ``protocol.reply_key(model, client_id)``, in the model's
slot, so a client waits on one list per model; a sharded model's requests name the
reply list of their sub-queue's tag (``protocol.sub_queue_tag``), in that sub-queue's
slot, so a client waits on one list per sub-queue in use.  Every ``model`` argument
below is such a tag (a model's own name for a model of one sub-queue).

The first request for a model starts its listener; a listener that nothing has
waited on for ``idle_s`` stops (freeing its blocked connection), and the next request
for the model starts a new one.  The reply list outlives the listener (its TTL), so a
reply pushed meanwhile is popped by the next one.

The hand-off holds because a listener decides to stop and forgets itself in one step
of the event loop, between two pops, when it has no waiter; and a request's waiter
is added to its model's listener (started if need be) in one step too, never across
an ``await``.  A waiter therefore always sits in a listener that is running.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.errors import RedbatchError
from redbatch.producer.listener import Abandoned, ListenerStats, ReplyListener, RequestFuture


class Listeners:
    """The reply listeners of one client (``client_id``), by model; their ``stats``
    are shared (they add up over every listener, stopped ones included)."""

    def __init__(self, redis: aioredis.Redis, client_id: str, block_timeout_s: float,
                 idle_s: float = defaults.LISTENER_IDLE_S,
                 on_abandoned: Abandoned | None = None) -> None:
        """``on_abandoned``: each listener's (``ReplyListener``)."""
        self._redis = redis
        self._on_abandoned = on_abandoned
        self.client_id = client_id
        self._block_timeout_s = block_timeout_s
        self._idle_s = idle_s
        self._by_model: dict[str, ReplyListener] = {}
        self.stats = ListenerStats()
        self.started = 0  # listeners started, a restart after an idle stop included
        self._closed = False

    def reply_to(self, model: str) -> str:
        return protocol.reply_key(model, self.client_id)

    def of(self, model: str) -> ReplyListener:
        """``model``'s running listener, started if it has none (``RedbatchError`` once
        ``stop`` began: no listener starts for a closing client)."""
        listener = self._by_model.get(model)
        if listener is None:
            if self._closed:
                raise RedbatchError("the client is closed")
            listener = ReplyListener(self._redis, self.reply_to(model), self._block_timeout_s,
                                     self.stats, self._idle_s, self._retired,
                                     self._on_abandoned)
            self._by_model[model] = listener
            listener.start()
            self.started += 1
        return listener

    def _retired(self, listener: ReplyListener) -> None:
        for model, running in self._by_model.items():
            if running is listener:
                del self._by_model[model]
                return

    def expect(self, model: str, request_id: str, deadline_ms: int, want_reply: bool
               ) -> RequestFuture[Any]:
        """A future for ``request_id``, settled by ``model``'s listener."""
        return self.of(model).expect(request_id, deadline_ms, want_reply)

    def route_pack(self, model: str, pack_id: str, member_ids: list[str],
                   deadline_ms: int) -> None:
        """Split the reply to ``pack_id`` for ``member_ids``; with no listener for the
        model, none of them waits any more: nothing to route."""
        listener = self._by_model.get(model)
        if listener is not None:
            listener.route_pack(pack_id, member_ids, deadline_ms)

    def fail(self, request_id: str, exc: BaseException, model: str | None = None) -> None:
        """Settle ``request_id``'s waiter with ``exc`` (looked for in every listener
        when its ``model`` is not given)."""
        if model is None:
            for each in list(self._by_model.values()):
                each.fail(request_id, exc)
        elif (listener := self._by_model.get(model)) is not None:
            listener.fail(request_id, exc)

    @property
    def running(self) -> int:
        return len(self._by_model)

    @property
    def waiting(self) -> int:
        total = 0  # (a loop: a generator's sum costs 3x as much, once per request)
        for listener in self._by_model.values():
            total += listener.waiting
        return total

    async def stop(self) -> None:
        """Stop every listener; their waiters fail."""
        self._closed = True
        listeners, self._by_model = list(self._by_model.values()), {}
        for listener in listeners:
            await listener.stop()
