"""One stage's hand-off: takes its replies to pipeline requests from its outbox (under a
lease), and hands each one on: to the next stage's queue, or to the caller as the final
reply.  Every write is idempotent, so a record whose taker died is simply taken again
once its lease expires (``docs/protocol.md`` §17)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
import redis.asyncio as aioredis

from redbatch import codec, lua, protocol
from redbatch.errors import ConfigError, DeadlineExceeded, RedbatchError
from redbatch.lean import LeanLink
from redbatch.pipelines import handoff
from redbatch.pipelines.context import Context
from redbatch.protocol import Reply
from redbatch.redis_conn import REDIS_ERRORS, check_cancelled
from redbatch.registry import LiveCache

log = logging.getLogger("redbatch.pipelines")
BACKOFF_CAP_S = 2.0
# Redis out of reach: the whole step is retried (its records' leases keep them); any
# other error planning one record (a refusal of its own keys included) costs it alone
UNREACHABLE = tuple(e for e in REDIS_ERRORS if e is not redis.ResponseError)


class Mover:
    """Hands on the replies of ``stage`` (a model of this worker) to pipeline requests."""

    def __init__(self, redis: aioredis.Redis, stage: str, live: LiveCache,
                 blocking: aioredis.Redis | None, wait_s: float) -> None:
        self._redis = redis
        self._link = LeanLink(redis)
        self._blocking = blocking or redis
        self.stage = stage
        self._live = live
        self._wait_s = wait_s
        self._outbox = protocol.outbox_key(stage)
        self._handoff = protocol.handoff_key(stage)
        self.handed = 0  # records handed on by this mover
        # the last step's records, handed on: marked done with the next take (one write)
        self.done: handoff.Command | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Hand on until ``stop``, then once more (what the last batches left); an error
        is logged and retried after a (capped) back-off, never the end of the hand-off."""
        backoff_s = 0.05
        while True:
            check_cancelled()  # (a cancel that redis-py swallowed ends the hand-off too)
            try:
                if not await self.step() and not stop.is_set():
                    await self._wait(stop)
                backoff_s = 0.05
            except Exception as exc:
                _log_failure(self.stage, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, BACKOFF_CAP_S)
            if stop.is_set():
                await self._last_step()
                return

    async def _last_step(self) -> None:
        try:
            while await self.step():
                pass
        except Exception as exc:
            log.warning("stage=%s: hand-off records left for the other workers (%s)",
                        self.stage, exc)

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until the outbox holds a record (a rotation onto itself: nothing taken), or
        ``wait_s`` (then expired leases are looked at again), or ``stop`` (the rotation
        is then cancelled: the last step comes at once, not after ``wait_s``)."""
        rotation = asyncio.ensure_future(self._blocking.blmove(
            self._outbox, self._outbox, self._wait_s, "LEFT", "RIGHT"))  # type: ignore[arg-type]
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({rotation, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (rotation, stopping):
                task.cancel()
            await asyncio.gather(rotation, stopping, return_exceptions=True)
        if not rotation.cancelled() and (error := rotation.exception()) is not None:
            raise error

    async def step(self) -> int:
        """Take up to ``HANDOFF_TAKE`` records and hand them on (one write per slot they
        go to); they are marked done with the next step's take."""
        records = await self._take()
        if not records:
            return 0
        replies = [_reply(record) for record in records]
        keys = [protocol.context_key(self.stage, r.id if r else "") for r in replies]
        contexts: list[Any] = await self._redis.mget(keys)
        commands: list[handoff.Command] = []
        for reply, raw in zip(replies, contexts, strict=True):
            if reply is not None and raw is not None:  # else handed on already (expired)
                commands += await self._plan_one(reply, raw)
        await self._run_all(commands)
        self.done = handoff.Command(lua.HANDOFF_DONE, [self._handoff, *keys], list(records),
                                    self.stage)
        self.handed += len(records)
        return len(records)

    async def _plan_one(self, reply: Reply, raw: bytes) -> list[handoff.Command]:
        """``_plan`` of one record (``raw``: its context).  A record that cannot be
        planned (a bad context, an input too large for the next stage) is logged and
        answered with its error where its context names the caller; it is marked done
        with the others, never holding them up."""
        try:
            return await self._plan(reply, Context.from_json(raw))
        except UNREACHABLE:
            raise
        except Exception as exc:
            log.exception("stage=%s: could not hand on request %s", self.stage, reply.id)
            return handoff.refusal_commands(reply.id, raw, exc, self.stage)

    async def _take(self) -> list[bytes]:
        """The take script, after the last step's done in the same write."""
        take = handoff.Command(lua.HANDOFF_TAKE, [self._outbox, self._handoff], [
            protocol.HANDOFF_TAKE, protocol.now_ms(), protocol.HANDOFF_LEASE_MS], self.stage)
        commands = [take] if self.done is None else [self.done, take]
        replies = await handoff.run_group(self._link, commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        self.done = None
        records, dropped = replies[-1]
        for key in dropped:
            log.error("stage=%s: deleted %s, which held another type of value (no record "
                      "could be read from it, and every hand-off failed)", self.stage,
                      key.decode(errors="replace") if isinstance(key, bytes) else key)
        return list(records)

    async def _run(self, commands: list[handoff.Command]) -> None:
        """One slot's commands; a Redis refusal of a request's own keys (another type
        of value) drops that request alone, logged."""
        try:
            results = await handoff.run_group(self._link, commands)
        except redis.ResponseError as exc:  # a cluster link raises a lone command's error
            if len(commands) == 1:
                results = [exc]
            else:  # ... for the whole group: each command alone then, refused alone
                for command in commands:
                    await self._run([command])
                return
        for command, result in zip(commands, results, strict=True):
            if isinstance(result, redis.ResponseError):
                log.error("stage=%s: could not hand on a request (keys %s): %s",
                          self.stage, command.keys[:2], result)
        await self._run_all([handoff.refusal(c.request_id, c.ctx, handoff.stage_full(
            c, result), c.tag) for c, result in zip(commands, results, strict=True)
            if result in handoff.REFUSED and c.ctx is not None])  # a full stage's: answered

    async def _run_all(self, commands: list[handoff.Command]) -> None:
        """``commands``, one write per slot, side by side."""
        groups: dict[str, list[handoff.Command]] = {}
        for command in commands:
            groups.setdefault(command.tag, []).append(command)
        await asyncio.gather(*(self._run(group) for group in groups.values()))

    async def _plan(self, reply: Reply, ctx: Context) -> list[handoff.Command]:
        """Where this reply goes: the caller (the last stage, or an error: the stage
        named), the next stage's queue, each branch of a fan-out, or a merge stage's
        parts; a request past its deadline is answered ``deadline_exceeded`` here,
        never computed further."""
        if not reply.ok or reply.row_errors or not ctx.route:  # the final reply
            if reply.row_errors and ctx.route:  # (this stage's outputs are not the answer)
                reply = handoff.rows_stopped(reply)
            done = ctx.passed(self.stage, reply.timings)
            return [handoff.deliver_command(
                reply.id, handoff.final_wire(reply, done, self.stage), ctx)]
        nxt = ctx.route[0]
        if protocol.now_ms() >= ctx.deadline_ms:  # dropped where it is: not computed
            late = Reply(reply.id, False, error_code=DeadlineExceeded.code,
                         error_message="deadline passed before the stage was reached")
            named = nxt if isinstance(nxt, str) else ",".join(nxt)
            return [handoff.deliver_command(reply.id, handoff.final_wire(late, ctx, named),
                                            ctx)]
        if isinstance(nxt, list):  # a fan-out: each branch gets the output
            return [await self._send(branch, reply.id, reply.payload,
                                     ctx.passed(self.stage, reply.timings, branch, nxt))
                    for branch in nxt]
        if ctx.branch:  # the end of a branch: its part of the merge stage's input
            return await self._part(reply, ctx, nxt)
        return [await self._send(nxt, reply.id, reply.payload,
                                 ctx.passed(self.stage, reply.timings))]

    async def _send(self, stage: str, request_id: str, payload: Any, ctx: Context
                    ) -> handoff.Command:
        """The request's entry at ``stage``, under that stage's levels and own queue
        cap (its live summary, cached)."""
        summary = await self._live.get(stage)
        return handoff.send_command(summary.levels, stage, request_id, payload, ctx,
                                    handoff.hop_cap(summary.max_queue_len))

    async def _part(self, reply: Reply, ctx: Context, merge: str) -> list[handoff.Command]:
        """Keep this branch's output at the merge stage (once); the branch that brings
        the last part sends the merge stage's input, a map branch -> output (sent
        again, after a death, it is deduplicated as any hand-off)."""
        ttl_ms = protocol.marker_ttl_ms(ctx.deadline_ms, protocol.now_ms())
        passed = ctx.passed(self.stage, reply.timings)
        part = {protocol.F_PART: reply.payload, protocol.F_PART_TIMINGS: passed.stages[-1]}
        got: list[bytes] = await self._link.script(
            lua.HANDOFF_PART, [protocol.parts_key(merge, reply.id)],
            [ctx.branch, codec.encode(part), len(ctx.branches), ttl_ms])
        if not got:
            return []  # the other branches are still on their way
        parts = {got[i].decode(): codec.decode(got[i + 1]) for i in range(0, len(got), 2)}
        merged = {branch: parts[branch][protocol.F_PART] for branch in ctx.branches}
        passed.stages[-1:] = [parts[branch][protocol.F_PART_TIMINGS] for branch in ctx.branches
                              if protocol.F_PART_TIMINGS in parts[branch]]  # every branch's
        send = await self._send(merge, reply.id, merged, passed)
        return [send, handoff.Command(lua.HANDOFF_FORGET, [protocol.parts_key(merge, reply.id)],
                                      [], merge)]  # sent (same write, after it): dropped


def _log_failure(stage: str, exc: Exception, backoff_s: float) -> None:
    """A failed step: Redis or a known error briefly, anything else (a bug) in full."""
    if isinstance(exc, (*REDIS_ERRORS, RedbatchError)):
        log.warning("stage=%s hand-off: %s: %s; retrying in %.2f s", stage,
                    type(exc).__name__, exc, backoff_s)
    else:
        log.exception("stage=%s hand-off failed; retrying in %.2f s", stage, backoff_s,
                      exc_info=exc)


def _reply(record: bytes) -> Reply | None:
    try:
        wire = codec.decode(record)
        if isinstance(wire, dict) and protocol.F_SEQ in wire:
            return _streamed(wire)
        return protocol.reply_from_wire(wire)
    except Exception:  # not a reply: nothing to hand on
        log.exception("undecodable hand-off record dropped")
        return None


STREAMED = ("the stage is a streaming model, which answers in chunks: a pipeline stage "
            "must give one reply")


def _streamed(wire: dict[str, Any]) -> Reply:
    """A streaming model's chunk (a stage served by one: workers refuse to front such
    a pipeline, but another process may serve the stage): the request fails with
    ``config_error``.  Only its first record is handed on (the context is gone then)."""
    if wire.get(protocol.F_SEQ) == 0:  # (its later chunks are dropped unlogged)
        log.warning("a streaming model's chunk reached a pipeline's hand-off: %s", STREAMED)
    return Reply(str(wire.get(protocol.F_ID, "")), False, error_code=ConfigError.code,
                 error_message=STREAMED)
