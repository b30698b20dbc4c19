"""A pipeline request's context: what travels with it from stage to stage beside its
payload (stored at each stage under ``context_key``, in the stage's slot)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Any, get_args

import orjson

from redbatch import protocol
from redbatch.codec import Format
from redbatch.protocol import Timings

FORMATS: tuple[Format, ...] = get_args(Format)


@dataclass
class Context:
    pipeline: str
    route: list[str | list[str]]  # the steps ahead of the stage that holds it (a list:
    # a fan-out)
    reply_to: str  # the caller's reply list (in the pipeline's slot)
    deadline_ms: int
    enqueue_ms: int  # when the caller sent it (the first stage's enqueue)
    priority: int = 0  # the level the caller asked for (0: each stage's default)
    trace_id: str = ""
    fmt: Format = "msgpack"  # the caller's encoding: the final reply's too
    stages: list[dict[str, Any]] = field(default_factory=list)  # each stage's timings
    rows: int = 0  # a multi-row request's rows (docs/protocol.md §3.1); 0: one input
    branch: str = ""  # on a fan-out's branch: its stage (its output's name at the merge)
    branches: list[str] = field(default_factory=list)  # ... and every branch's stage

    def to_json(self) -> bytes:
        return orjson.dumps(self)  # (orjson writes a dataclass as its fields)

    @classmethod
    def from_json(cls, raw: bytes) -> Context:
        """The context stored as ``raw``; a field this version does not know (written
        by a newer worker during a rolling upgrade) is ignored.  A bad one raises."""
        data: dict[str, Any] = orjson.loads(raw)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def salvaged(cls, raw: bytes) -> Context | None:
        """What a context that cannot be read whole still tells: its pipeline, reply
        list, deadline and encoding, enough to answer its caller (None: not even that)."""
        with contextlib.suppress(Exception):
            data = orjson.loads(raw)
            fmt: Format = next((f for f in FORMATS if f == data.get("fmt")), "msgpack")
            if isinstance(data["pipeline"], str) and isinstance(data["reply_to"], str):
                return cls(data["pipeline"], [], data["reply_to"], int(data["deadline_ms"]),
                           0, fmt=fmt)
        return None

    def passed(self, stage: str, timings: Timings, branch: str = "",
               branches: list[str] | None = None) -> Context:
        """The context for the next step, once ``stage`` answered with ``timings``
        (``branch``: for one branch of a fan-out among ``branches``)."""
        done = {protocol.F_STAGE: stage, **timings.to_wire()}
        return Context(self.pipeline, self.route[1:], self.reply_to, self.deadline_ms,
                       self.enqueue_ms, self.priority, self.trace_id, self.fmt,
                       [*self.stages, done], self.rows, branch, branches or [])
