"""Claims for a model of several priority levels (``Model.priority_levels``).

Each level has a queue of its own (``Levels.queues``); producers ring the model's bell
(``protocol.bell_key``, a list of one element) with every push.  A worker waits with
``BLMOVE bell bell`` (it returns at once while the bell rings and consumes nothing;
the precise window's ``CLIENT UNBLOCK`` ends it as it ends a queue pop) followed, in
the same write, by the ``CLAIM_LEVELS`` script, which moves entries from the level
queues, most urgent first, into the in-flight list and silences the bell once they are
all empty.  The script runs after every wait, timed out or not, so an entry pushed
without ringing (a producer that knows only ``queue_key``) waits one block timeout at
most.

The starvation guard: a worker earns ``priority_share`` of a slot for every entry it
claims, and spends its whole slots on the levels below the most urgent one that waits
(one entry at a time, taking those levels in turn); entries it claimed from there
anyway pay the credit back.  Under saturating urgent load the lower levels still get
``priority_share`` of the claims.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import NoScriptError

from redbatch import lua, protocol
from redbatch.lean import script_sha
from redbatch.levels import Levels
from redbatch.worker.claim import MIN_BLOCK_S, Claimer

_SHA = script_sha(lua.CLAIM_LEVELS)


class LevelClaimer(Claimer):
    """A ``Claimer`` over a multi-level model's level queues (see the module doc)."""

    script = lua.CLAIM_LEVELS

    def __init__(self, *args: Any, levels: Levels, share: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bell = protocol.bell_key(self.tag)
        self.queues = levels.queues(self.tag)
        self.share = share
        self.credit = 0.0  # slots owed to the lower levels
        self._turn = 0  # which lower level the next reserved slot goes to first

    def _claim(self, count: int) -> tuple[Any, ...]:
        return ("EVALSHA", _SHA, 2 + len(self.queues), self.bell, self.inflight,
                *self.queues, count, protocol.INFLIGHT_TTL_S * 1000, int(self.credit),
                self._turn)

    def _claimed(self, reply: Any, exists: Any) -> list[bytes]:
        low, left, items, self._turn = reply
        ceiling = self.share * self._policy.max_batch_size + 1  # kept while none waits
        self.credit = max(0.0, min(ceiling, self.credit + self.share * len(items)) - low)
        self._drained = left == 0
        self.cancels = self.cancels or exists == 1
        return list(items)

    async def _take(self, count: int) -> list[bytes]:
        reply, exists = await self._link.pipeline_loading(self.script, self._claim(count),
                                                          ("EXISTS", self.cancelled))
        return self._claimed(reply, exists)

    async def _steal(self, count: int) -> list[bytes]:
        return await self._take(count)  # the level script: one command

    async def _block(self, timeout_s: float, count: int, wake_at_ms: int | None = None
                     ) -> list[bytes]:
        """Wait on the bell, then claim from the level queues (one write).  A bell that
        rang for entries another worker claimed first waits again for the time left
        (an empty answer would read as a quiet gap and close the batch window)."""
        until = time.monotonic() + timeout_s
        while True:
            timeout: Any = max(until - time.monotonic(), MIN_BLOCK_S)
            try:
                rang, reply, exists = await self._blocking(
                    wake_at_ms, ("BLMOVE", self.bell, self.bell, "LEFT", "RIGHT", timeout),
                    self._claim(count), ("EXISTS", self.cancelled))
            except NoScriptError:  # the wait ran, the claim did not: claim now
                await self._link.execute("SCRIPT", "LOAD", self.script)
                return await self._take(count)
            items = self._claimed(reply, exists)
            if items or rang is None or time.monotonic() >= until or self._woken(wake_at_ms):
                return items

    @staticmethod
    def _woken(wake_at_ms: int | None) -> bool:
        return wake_at_ms is not None and protocol.now_ms() >= wake_at_ms
