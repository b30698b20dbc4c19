"""Replica acknowledgement of an enqueue (opt-in, ``ReplicaWait``).

Redis replicates asynchronously: a primary that fails right after it accepted an
enqueue can lose it when a replica that never received it is promoted.  With
``wait_replicas`` > 0 the enqueue script is followed by ``WAIT numreplicas timeout``
in the same write on the same connection (WAIT counts the writes of the connection
that sends it, so it must not go through another of the pool's connections): no extra
round trip, only the time the replicas take to acknowledge.

The WAIT's timeout is the setting's, cut to the push's earliest deadline.  A WAIT that
ends with fewer acknowledgements than asked does not fail the push: its requests are
queued on the primary and may well be served, so their callers keep waiting for their
replies (a request lost in a failover is answered ``deadline_exceeded`` by its
deadline, as without WAIT).  Such pushes are counted (``unreplicated``) and logged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from redbatch import defaults, protocol
from redbatch.config import ReplicaWait
from redbatch.errors import ConfigError
from redbatch.lean import LeanLink, script_sha
from redbatch.protocol import Request

log = logging.getLogger("redbatch.producer")
Calls = list[tuple[list[str], list[Any]]]  # one script call's keys and arguments each


async def check_replicas(redis: aioredis.Redis, setting: ReplicaWait) -> None:
    """At start, with the WAIT on: ``ConfigError`` if the Redis user may not send WAIT
    (every push would fail after its write), and a warning while fewer replicas are
    connected than asked for (every enqueue would wait its whole timeout)."""
    if not setting.wait_replicas:
        return
    try:
        await redis.wait(0, 0)  # 0 replicas: answers at once
    except ResponseError as exc:
        raise ConfigError(f"wait_replicas={setting.wait_replicas} needs the WAIT command, "
                          f"which Redis refused ({exc}); allow +wait for the redis user, or "
                          "set REDBATCH_WAIT_REPLICAS=0") from exc
    connected = await _connected_replicas(redis)
    if connected is not None and connected < setting.wait_replicas:
        log.warning("wait_replicas=%d but the primary has %d connected replicas: every "
                    "enqueue waits its whole timeout (%d ms) until more connect",
                    setting.wait_replicas, connected, setting.wait_timeout_ms)


async def _connected_replicas(redis: aioredis.Redis) -> int | None:
    """The primary's connected replicas (None where INFO is refused)."""
    try:
        info: Any = await redis.info("replication")
    except ResponseError:
        return None
    return int(info.get("connected_slaves", 0))


class ReplicaWaiter:
    """The enqueue script and its WAIT, on one connection; counts the outcomes."""

    def __init__(self, link: LeanLink, setting: ReplicaWait) -> None:
        self._link = link
        self.setting = setting
        self.waits = 0  # WAITs sent
        self.unreplicated = 0  # requests whose WAIT ended short of wait_replicas
        self._warned_at = -defaults.WAIT_WARN_EVERY_S

    def timeout_ms(self, requests: list[Request]) -> int:
        """The setting's timeout, cut to the requests' earliest deadline (at least 1 ms:
        ``WAIT n 0`` would block without end)."""
        left_ms = min(r.deadline_ms for r in requests) - protocol.now_ms()
        return max(1, min(self.setting.wait_timeout_ms, left_ms))

    async def call(self, source: str, calls: Calls, requests: list[Request]) -> list[Any]:
        """The script's reply to each call, once the WAIT after them has returned.
        Several calls run in one MULTI (the script loaded first in the same write: a
        NOSCRIPT inside EXEC would not be retried); one call is retried once after a
        NOSCRIPT (Redis restarted or flushed its scripts)."""
        commands = _commands(source, calls)
        wait = ("WAIT", self.setting.wait_replicas, self.timeout_ms(requests))
        replies = await self._link.pipeline_replies(*commands, wait)
        if isinstance(replies[0], NoScriptError):
            await self._link.execute("SCRIPT", "LOAD", source)
            replies = await self._link.pipeline_replies(*commands, wait)
        for reply in replies[:-1]:  # the enqueue's own: an error fails the push (a cluster
            if isinstance(reply, Exception):  # pipeline puts connection errors in place)
                raise reply
        self._count(replies[-1], len(requests))
        results: list[Any] = replies[-2] if len(calls) > 1 else replies[:1]
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def stats(self) -> dict[str, int]:
        return {"enqueue_waits": self.waits, "enqueue_unreplicated": self.unreplicated}

    def _count(self, wait_reply: Any, requests: int) -> None:
        """The WAIT's reply: replicas that acknowledged, or an error (a primary demoted
        under the connection, WAIT refused, a connection lost after the push): then
        none did, but the push stands."""
        self.waits += 1
        failed = isinstance(wait_reply, Exception)
        acked = 0 if failed else int(wait_reply)
        if acked >= self.setting.wait_replicas:
            return
        self.unreplicated += requests
        now = time.monotonic()
        if now - self._warned_at >= defaults.WAIT_WARN_EVERY_S:
            self._warned_at = now
            log.warning("enqueue acknowledged by %d of %d replicas within %d ms%s; its "
                        "requests are queued and still wait for replies (%d such requests "
                        "so far)", acked, self.setting.wait_replicas,
                        self.setting.wait_timeout_ms,
                        f" (WAIT failed: {wait_reply})" if failed else "", self.unreplicated)


def _commands(source: str, calls: Calls) -> list[tuple[Any, ...]]:
    sha = script_sha(source)
    scripts = [("EVALSHA", sha, len(keys), *keys, *args) for keys, args in calls]
    if len(scripts) == 1:
        return scripts
    return [("SCRIPT", "LOAD", source), ("MULTI",), *scripts, ("EXEC",)]
