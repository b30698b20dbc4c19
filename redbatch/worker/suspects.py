"""Suspects: the entries a reaper requeued from a worker that died, each run alone.

An entry's ``suspect`` flag alone proves nothing: anyone who can push to a queue can
set it, and a forged flag would make a worker run that entry in passes of its own (an
ordinary model's batch waiting behind it, a streaming model's newcomers kept out for
its whole stream).  So a reaper records the ids it marks in the sub-queue's suspects
set (``protocol.suspects_key``) before it requeues them, and a worker honours the
flag only for an id that set holds; it asks only when a claimed entry carries the
flag, which no request does but after a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from redbatch import protocol
from redbatch.protocol import Request
from redbatch.redis_conn import add_by_deadline

log = logging.getLogger("redbatch.worker")


async def record(redis: aioredis.Redis, tag: str, requests: Iterable[Request]) -> None:
    """Record ``requests`` as suspects of sub-queue ``tag`` until their deadlines (one
    MULTI, ``add_by_deadline``)."""
    marked = {r.id: r.deadline_ms for r in requests}
    if marked:
        await add_by_deadline(redis, protocol.suspects_key(tag), marked,
                              protocol.SUSPECTS_MAX)


async def verify(redis: aioredis.Redis, tag: str, requests: Iterable[Request]) -> None:
    """Clear the ``suspect`` flag of each of ``requests`` that no reaper recorded in
    sub-queue ``tag``'s set (a forged flag: the request runs batched, as any other).
    Where Redis refuses the read (an ACL without ZMSCORE), every flag stands."""
    flagged = [r for r in requests if r.suspect]
    if not flagged:
        return
    try:
        scores = await redis.zmscore(protocol.suspects_key(tag), [r.id for r in flagged])
    except ResponseError as exc:
        log.warning("model=%s cannot read its suspects set (%s): every suspect flag is "
                    "honoured", tag, exc)
        return
    forged = [r for r, score in zip(flagged, scores, strict=True) if score is None]
    for request in forged:
        request.suspect = False
    if forged:
        log.warning("model=%s %d entries flagged suspect that no reaper requeued: run "
                    "batched (the first: %s)", tag, len(forged), forged[0].id)
