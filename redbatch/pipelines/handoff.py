"""The two writes of a hand-off, each one script in ONE slot: a pipeline request
entering a stage (deduplicated by its marker there), and its final reply (at most once,
by its marker in the pipeline's slot)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import NoScriptError

from redbatch import codec, defaults, lua, protocol
from redbatch.errors import InvalidPayload, ModelError, NoLiveWorkers, QueueFull, RedbatchError
from redbatch.lean import LeanLink, script_sha
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
    entry = codec.encode(request.to_wire(), ctx.fmt)
    if len(entry) > protocol.MAX_ENTRY_BYTES:  # no worker would take it: the caller is told
        raise InvalidPayload(f"the input of stage {stage!r} is {len(entry)} bytes, over the "
                             f"{protocol.MAX_ENTRY_BYTES}-byte limit of a queue entry")
    return entry


@dataclass(frozen=True, slots=True)
class Command:
    """One hand-off script call: its keys all in the slot of ``tag``."""

    source: str
    keys: list[str]
    args: list[Any]
    tag: str
    ctx: Context | None = None  # a send's: its caller is answered if the stage refuses it
    request_id: str = ""  # ... and its request
    level: int = 0  # ... and its level at the stage (0: one level)

    def wire(self) -> tuple[Any, ...]:
        return ("EVALSHA", script_sha(self.source), len(self.keys), *self.keys, *self.args)


def send_command(levels: Levels, stage: str, request_id: str, payload: Any, ctx: Context,
                 cap: int | None = None) -> Command:
    """Queue the request at ``stage`` (of ``levels``) with its context, under the caps
    of a direct enqueue: ``cap`` (None: ``MAX_QUEUE_LEN``, a gateway's default; 0: no
    cap) of the entries at its level and the more urgent ones, and its level's own cap
    (``levels.cap``): the script answers 0 if it was queued there already (a hand-off
    sent again), ``REFUSED`` if refused."""
    cap = defaults.MAX_QUEUE_LEN if cap is None else cap
    level = stage_level(levels, ctx.priority)
    keys = [protocol.request_key(stage, request_id), protocol.context_key(stage, request_id)]
    if levels.many:
        queues = levels.queues(stage)
        keys += [queues[level - 1], protocol.bell_key(stage), *queues[:level - 1]]
    else:
        keys.append(protocol.queue_key(stage))
    ttl_ms = protocol.marker_ttl_ms(ctx.deadline_ms, protocol.now_ms())
    entry = stage_entry(stage, request_id, payload, ctx, level)
    level_cap = (levels.cap(level) or 0) if levels.many else 0
    args = [ttl_ms, ctx.to_json(), entry, protocol.QUEUE_TTL_S * 1000, cap, level_cap]
    if protocol.VERSION_SEP in stage:  # a version's stage: refused once drained
        keys.append(protocol.closed_key(stage))
        args.append("1")
    return Command(lua.HANDOFF_SEND, keys, args, stage, ctx, request_id, level)


def hop_cap(own: int | None) -> int:
    """The cap of a stage's queue for a hand-off: the stage's own ``max_queue_len``
    (None: none) where lower than ``MAX_QUEUE_LEN``, a gateway's default."""
    return defaults.MAX_QUEUE_LEN if own is None else min(defaults.MAX_QUEUE_LEN, own)


REFUSED: Final = (-1, -2, -3)  # HANDOFF_SEND's refusals: the stage's cap, its level's,
# its drain (a version's stage, closed)


def stage_full(command: Command, refused: int) -> RedbatchError:
    """The error of a send that its stage refused (``refused``: the script's answer,
    one of ``REFUSED``)."""
    if refused == -3:
        return NoLiveWorkers(f"pipeline stage {command.tag!r} is a drained version: "
                             "nothing serves it")
    if refused == -2:
        return QueueFull(f"queue of pipeline stage {command.tag!r} at priority "
                         f"{command.level} is full (cap {command.args[5]})",
                         defaults.RETRY_AFTER_S)
    return QueueFull(f"queue of pipeline stage {command.tag!r} is full (cap "
                     f"{command.args[4]})", defaults.RETRY_AFTER_S)


async def send(link: LeanLink, levels: Levels, stage: str, request_id: str, payload: Any,
               ctx: Context, cap: int | None = None) -> bool:
    """``send_command``, run: False if the request was queued at ``stage`` already;
    ``QueueFull`` if its queue holds ``cap``."""
    command = send_command(levels, stage, request_id, payload, ctx, cap)
    sent = await link.script(command.source, command.keys, command.args)
    if sent in REFUSED:
        raise stage_full(command, sent)
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


def rows_stopped(reply: Reply) -> Reply:
    """The pipeline's answer to a multi-row request some of whose rows a stage before
    the last failed: the request ends there, and no row's output is given (each is that
    stage's, not the pipeline's); the failed rows keep their errors, the others say
    that they were not computed further."""
    if not isinstance(reply.payload, list):  # (a multi-row reply's payload is its rows)
        return Reply(reply.id, False, error_code=ModelError.code, timings=reply.timings,
                     error_message=next(iter(reply.row_errors.values()))[1])
    failed = sorted(reply.row_errors)
    named = ", ".join(map(str, failed[:8])) + (", ..." if len(failed) > 8 else "")
    stopped = (ModelError.code, f"not computed further: row(s) {named} of this request "
                                "failed here, and its other rows stop with them")
    rows = len(reply.payload)
    return dataclasses.replace(reply, payload=[None] * rows, row_errors={
        row: reply.row_errors.get(row, stopped) for row in range(rows)})


def deliver_command(request_id: str, wire: dict[str, Any], ctx: Context) -> Command:
    """Push the final reply to the caller, at most once: the script answers 0 if the
    request had its reply already."""
    keys = [protocol.request_key(ctx.pipeline, request_id), ctx.reply_to]
    ttl_ms = protocol.marker_ttl_ms(ctx.deadline_ms, protocol.now_ms())
    data = codec.encode(wire, ctx.fmt)
    if len(data) > protocol.MAX_ENTRY_BYTES:  # no reader would take it: say so instead
        data = codec.encode(_too_large(wire, len(data)), ctx.fmt)
    return Command(lua.HANDOFF_DELIVER, keys, [ttl_ms, data, protocol.REPLY_TTL_S],
                   ctx.pipeline)


def _too_large(wire: dict[str, Any], size: int) -> dict[str, Any]:
    """In place of a final reply over ``MAX_ENTRY_BYTES`` (the last stage's reply fits,
    its stages' timings and messages added may not): ``model_error`` saying so."""
    failed = Reply(str(wire[protocol.F_ID]), False, error_code=ModelError.code,
                   error_message=f"the pipeline's reply takes {size} bytes, over the "
                                 f"{protocol.MAX_ENTRY_BYTES}-byte limit (send fewer rows "
                                 "per request)").to_wire()
    failed[protocol.F_STAGES] = wire.get(protocol.F_STAGES, [])
    failed[protocol.F_TIMINGS] = wire.get(protocol.F_TIMINGS, failed[protocol.F_TIMINGS])
    return failed


def refusal_commands(request_id: str, raw: bytes, exc: Exception, stage: str
                     ) -> list[Command]:
    """The caller's error reply to a request that ``stage`` could not hand on (``raw``:
    its context there; ``exc``: why), if its context still names the caller."""
    ctx = Context.salvaged(raw)
    return [] if ctx is None else [refusal(request_id, ctx, exc, stage)]


def refusal(request_id: str, ctx: Context, exc: Exception, stage: str) -> Command:
    """The caller's error reply (``exc``) to its request at ``stage`` (of ``ctx``)."""
    error = exc if isinstance(exc, RedbatchError) else RedbatchError(
        f"could not hand the request on: {type(exc).__name__}: {exc}")
    reply = Reply(request_id, False, error_code=error.code, error_message=str(error))
    return deliver_command(request_id, final_wire(reply, ctx, stage), ctx)


async def run_group(link: LeanLink, commands: list[Command]) -> list[Any]:
    """Commands of one slot in one write; their replies, errors in place (a key of
    another type refuses its own request alone).  Sent once more after loading the
    scripts if Redis lost them."""
    try:  # (a cluster link raises a lone command's error rather than return it)
        replies = await link.pipeline_replies(*(c.wire() for c in commands))
        if not any(isinstance(r, NoScriptError) for r in replies):
            return replies
    except NoScriptError:
        pass
    for source in {c.source for c in commands}:
        await link.execute("SCRIPT", "LOAD", source)
    return await link.pipeline_replies(*(c.wire() for c in commands))
