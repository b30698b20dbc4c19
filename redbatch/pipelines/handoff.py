"""The two writes of a hand-off, each one script in ONE slot: a pipeline request
entering a stage (deduplicated by its marker there), and its final reply (at most once,
by its marker in the pipeline's slot)."""

from __future__ import annotations

from typing import Any

from redbatch import codec, lua, protocol
from redbatch.lean import LeanLink
from redbatch.levels import Levels
from redbatch.pipelines.context import Context
from redbatch.protocol import Reply, Request


def stage_level(levels: Levels, priority: int) -> int:
    """The level a request that asked for ``priority`` takes at a stage of ``levels``:
    its own where the stage has it, else the stage's default (0: one level)."""
    if not levels.many:
        return 0
    return priority if 0 < priority <= levels.count else levels.default


def stage_entry(stage: str, request_id: str, payload: Any, ctx: Context, level: int
                ) -> bytes:
    """The queue entry of a pipeline request at ``stage``: its deadline and trace id,
    answered into the stage's outbox."""
    request = Request(id=request_id, model=stage, enqueue_ms=protocol.now_ms(),
                      deadline_ms=ctx.deadline_ms, reply_to=protocol.outbox_key(stage),
                      payload=payload, trace_id=ctx.trace_id,
                      priority=level or ctx.priority, rows=ctx.rows)
    return codec.encode(request.to_wire(), ctx.fmt)


async def send(link: LeanLink, levels: Levels, stage: str, request_id: str, payload: Any,
               ctx: Context) -> bool:
    """Queue the request at ``stage`` with its context; False if it was queued there
    already (a hand-off sent again)."""
    level = stage_level(levels, ctx.priority)
    keys = [protocol.request_key(stage, request_id), protocol.context_key(stage, request_id)]
    if levels.many:
        keys += [levels.queues(stage)[level - 1], protocol.bell_key(stage)]
    else:
        keys.append(protocol.queue_key(stage))
    ttl_ms = protocol.marker_ttl_ms(ctx.deadline_ms, protocol.now_ms())
    entry = stage_entry(stage, request_id, payload, ctx, level)
    sent = await link.script(lua.HANDOFF_SEND, keys, [
        ttl_ms, ctx.to_json(), entry, protocol.QUEUE_TTL_S * 1000])
    return bool(sent)


def final_wire(reply: Reply, ctx: Context, stage: str) -> dict[str, Any]:
    """The caller's reply: ``reply`` with each stage's timings, and on an error the
    stage that failed, named in the message too (a failed row's as well)."""
    wire = reply.to_wire()
    wire[protocol.F_STAGES] = ctx.stages
    for row in wire.get(protocol.F_ROW_ERRORS, []):
        row[protocol.F_MESSAGE] = f"stage {stage!r} failed: {row[protocol.F_MESSAGE]}"
    if not reply.ok:
        error = wire[protocol.F_ERROR]
        error[protocol.F_STAGE] = stage
        error[protocol.F_MESSAGE] = f"stage {stage!r} failed: {reply.error_message}"
    return wire


async def deliver(link: LeanLink, request_id: str, wire: dict[str, Any], ctx: Context
                  ) -> bool:
    """Push the final reply to the caller, at most once; False if it had one."""
    keys = [protocol.request_key(ctx.pipeline, request_id), ctx.reply_to]
    ttl_ms = protocol.marker_ttl_ms(ctx.deadline_ms, protocol.now_ms())
    sent = await link.script(lua.HANDOFF_DELIVER, keys, [
        ttl_ms, codec.encode(wire, ctx.fmt), protocol.REPLY_TTL_S])
    return bool(sent)
