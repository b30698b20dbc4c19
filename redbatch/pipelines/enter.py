"""A producer's side of a pipeline request: it enters the first stage with its
context (the caller's reply list, deadline, priority and trace id)."""

from __future__ import annotations

from typing import Any

from redbatch import defaults, protocol
from redbatch.codec import Format
from redbatch.errors import InvalidPayload
from redbatch.lean import LeanLink
from redbatch.levels import Levels
from redbatch.pipelines import handoff
from redbatch.pipelines.context import Context
from redbatch.pipelines.definition import Pipeline


async def enter(link: LeanLink, levels: Levels, pipeline: Pipeline, request_id: str,
                inputs: Any, *, reply_to: str, deadline_ms: int, trace_id: str = "",
                priority: int = 0, fmt: Format = "msgpack", rows: int = 0,
                cap: int = defaults.MAX_QUEUE_LEN) -> bool:
    """Queue a request of ``pipeline`` at its first stage (of ``levels``); its final
    reply goes to ``reply_to`` (in the pipeline's slot); ``rows``: a batch of that many
    rows, each stage answering all of them at once.  False if a request of this id was
    queued there already (a retried push); ``QueueFull`` if that stage's queue holds
    ``cap`` entries."""
    route = [_route_step(s) for s in pipeline.stages[1:]]
    ctx = Context(pipeline.name, route, reply_to, deadline_ms, protocol.now_ms(), priority,
                  trace_id, fmt, rows=rows)
    return await handoff.send(link, levels, pipeline.first, request_id, inputs, ctx, cap)


def asked_priority(priority: int | None) -> int:
    """The priority a pipeline request carries through its stages (each stage takes it
    where it has that level, else its default): 1..MAX_PRIORITY_LEVELS, or 0 (none)."""
    if priority is None or priority == 0:
        return 0
    if type(priority) is not int or not 1 <= priority <= protocol.MAX_PRIORITY_LEVELS:
        raise InvalidPayload(f"priority must be 1..{protocol.MAX_PRIORITY_LEVELS} (1 most "
                             f"urgent; 0 or none: each stage's default), got {priority!r}")
    return priority


def _route_step(step: str | tuple[str, ...]) -> str | list[str]:
    return step if isinstance(step, str) else list(step)
