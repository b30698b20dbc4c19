"""``redbatch status``'s pipelines: each pipeline's stages in order, with each stage's
queue, throughput, live workers and hand-off backlog (replies not yet handed on)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import redis
from rich.table import Table

from redbatch import protocol
from redbatch.pipelines.definition import parse_registry
from redbatch.status import ModelStatus

log = logging.getLogger("redbatch.status")


@dataclass
class StageStatus:
    stage: str
    queue_depth: int
    items_per_s: float | None
    live_workers: int
    handoff_backlog: int | None  # replies in its outbox or being handed on (None: unreadable)


@dataclass
class PipelineStatus:
    pipeline: str
    stages: list[StageStatus]


def read(client: redis.Redis, models: dict[str, ModelStatus]) -> list[PipelineStatus]:
    """Every registered pipeline, its stages' figures taken from ``models`` (a sample)."""
    raw: Any = client.hgetall(protocol.PIPELINES_KEY)
    return [PipelineStatus(name, [_stage(client, stage, models.get(stage))
                                  for stage in pipe.models])
            for name, pipe in sorted(parse_registry(raw).items())]


def _stage(client: redis.Redis, stage: str, model: ModelStatus | None) -> StageStatus:
    backlog = _backlog(client, stage)
    if model is None:
        return StageStatus(stage, _depth(client, stage), None, 0, backlog)
    return StageStatus(stage, model.queue_depth, model.items_per_s, len(model.workers),
                       backlog)


def _backlog(client: redis.Redis, stage: str) -> int | None:
    """The stage's hand-off backlog; None (logged) when a key of it holds another type
    of value: the other stages and pipelines are still shown."""
    try:
        return int(client.llen(protocol.outbox_key(stage))) + \
            int(client.zcard(protocol.handoff_key(stage)))
    except redis.ResponseError as exc:
        log.warning("pipeline stage %r: its hand-off keys cannot be read (%s)", stage, exc)
        return None


def _depth(client: redis.Redis, stage: str) -> int:
    try:
        return int(client.llen(protocol.queue_key(stage)))
    except redis.ResponseError as exc:
        log.warning("pipeline stage %r: its queue cannot be read (%s)", stage, exc)
        return 0


def as_json(pipes: list[PipelineStatus]) -> list[dict[str, Any]]:
    return [asdict(p) for p in pipes]


def table(pipes: list[PipelineStatus]) -> Table:
    out = Table(title="pipelines")
    for column in ("pipeline", "stage", "queue", "items/s", "workers", "hand-off backlog"):
        out.add_column(column, justify="left" if column in ("pipeline", "stage") else "right")
    for pipe in pipes:
        for i, s in enumerate(pipe.stages):
            rate = "-" if s.items_per_s is None else f"{s.items_per_s:.1f}"
            backlog = "?" if s.handoff_backlog is None else str(s.handoff_backlog)
            out.add_row(pipe.pipeline if i == 0 else "", f"{i + 1}. {s.stage}",
                        str(s.queue_depth), rate, str(s.live_workers), backlog)
    return out
