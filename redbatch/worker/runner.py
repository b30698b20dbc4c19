"""One model's batch loop: claim -> decode -> forward -> encode -> publish."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from redbatch import codec, protocol
from redbatch.codec import Format
from redbatch.errors import DeadlineExceeded, InvalidPayload, ModelError, RedbatchError
from redbatch.protocol import Reply, Request, Timings
from redbatch.worker.claim import Claimer
from redbatch.worker.model import BatchFn, Model

log = logging.getLogger("redbatch.worker")


@dataclass(slots=True)
class Item:
    request: Request
    fmt: Format
    value: Any


@dataclass
class Decoded:
    """A claimed batch after decoding: items to compute, and replies already known."""

    items: list[Item] = field(default_factory=list)
    early: list[tuple[Request, Format, RedbatchError]] = field(default_factory=list)
    dead: list[bytes] = field(default_factory=list)


def _loose_reply_target(raw: bytes) -> tuple[str, str, Format] | None:
    """Find (id, reply_to) in an entry that failed validation, to tell its sender."""
    try:
        wire = codec.decode(raw)
        request_id, reply_to = wire[protocol.F_ID], wire[protocol.F_REPLY_TO]
    except Exception:  # any shape of garbage: there is simply no one to tell
        return None
    if isinstance(request_id, str) and isinstance(reply_to, str) and \
            protocol.REPLY_TO_RE.fullmatch(reply_to) and 0 < len(request_id) <= 128:
        return request_id, reply_to, codec.sniff_format(raw)
    return None


class BatchRunner:
    """Serves one model for one worker: forms batches and answers every request."""

    def __init__(self, redis: aioredis.Redis, model: Model, fn: BatchFn, worker_id: str,
                 executor: Executor, block_timeout_s: float) -> None:
        self._redis = redis
        self.model = model
        self._fn = fn
        self._worker_id = worker_id
        self._executor = executor
        self.claimer = Claimer(redis, model.name, worker_id, model.policy, block_timeout_s)
        self.batches = 0
        self.items = 0

    async def run_batch(self) -> int:
        """Serve one batch; return how many entries it claimed (0 on an idle timeout)."""
        raws = await self.claimer.claim()
        if not raws:
            return 0
        claimed_ms = protocol.now_ms()
        decoded = self.decode(raws, claimed_ms)
        started = time.perf_counter()
        result = await self.forward([item.value for item in decoded.items])
        fwd_ms = (time.perf_counter() - started) * 1000
        replies = self.encode(decoded, result, claimed_ms, fwd_ms)
        published = time.perf_counter()
        await self.publish(replies, len(raws), decoded.dead)
        reply_ms = (time.perf_counter() - published) * 1000
        self._log_batch(decoded, len(raws), claimed_ms, fwd_ms, reply_ms)
        return len(raws)

    # --- decode -------------------------------------------------------------
    def decode(self, raws: list[bytes], now_ms: int) -> Decoded:
        decoded = Decoded()
        for raw in raws:
            self._decode_one(raw, now_ms, decoded)
        return decoded

    def _decode_one(self, raw: bytes, now_ms: int, out: Decoded) -> None:
        fmt = codec.sniff_format(raw)
        try:
            request = protocol.request_from_wire(codec.decode(raw))
            if request.model != self.model.name:
                raise InvalidPayload(f"entry for model {request.model!r} in the queue of "
                                     f"{self.model.name!r}")
        except InvalidPayload as exc:
            self._reject(raw, exc, out)
            return
        if request.deadline_ms <= now_ms:
            late_ms = now_ms - request.deadline_ms
            out.early.append((request, fmt, DeadlineExceeded(
                f"deadline passed {late_ms} ms before a worker took the request")))
            return
        try:
            value = self.model.spec.check(request.payload) if self.model.spec else \
                request.payload
        except InvalidPayload as exc:
            out.early.append((request, fmt, exc))
            return
        out.items.append(Item(request, fmt, value))

    def _reject(self, raw: bytes, exc: InvalidPayload, out: Decoded) -> None:
        log.warning("model=%s dead-lettered a malformed entry (%d bytes): %s",
                    self.model.name, len(raw), exc)
        out.dead.append(raw)
        target = _loose_reply_target(raw)
        if target is not None:
            request_id, reply_to, fmt = target
            stub = Request(request_id, self.model.name, 0, 0, reply_to, None)
            out.early.append((stub, fmt, exc))

    # --- forward ------------------------------------------------------------
    async def forward(self, inputs: list[Any]) -> list[Any] | RedbatchError:
        """Run the batch function off the event loop; check the batch contract."""
        if not inputs:
            return []
        try:
            arg: Any = np.stack(inputs) if self.model.stack else inputs
            if self.model.is_async:
                outputs = await self._fn(arg)
            else:
                loop = asyncio.get_running_loop()
                outputs = await loop.run_in_executor(self._executor, self._fn, arg)
            return self._check_outputs(outputs, len(inputs))
        except RedbatchError as exc:
            return exc
        except Exception as exc:
            log.exception("model=%s forward failed on a batch of %d", self.model.name,
                          len(inputs))
            return ModelError(f"model {self.model.name!r} raised {type(exc).__name__}: {exc}")

    def _check_outputs(self, outputs: Any, n: int) -> list[Any]:
        if outputs is None or isinstance(outputs, str | bytes | dict):
            raise ModelError(f"model {self.model.name!r} must return a list, array or tensor "
                             f"of {n} outputs, got {type(outputs).__name__}")
        if hasattr(outputs, "shape") and len(outputs.shape) == 0:
            raise ModelError(f"model {self.model.name!r} returned a scalar for a batch of {n}")
        rows = list(outputs)
        if len(rows) != n:
            raise ModelError(f"model {self.model.name!r} returned {len(rows)} outputs for a "
                             f"batch of {n} inputs; a batch function must return one output "
                             "per input")
        return rows

    # --- encode -------------------------------------------------------------
    def encode(self, decoded: Decoded, result: list[Any] | RedbatchError, claimed_ms: int,
               fwd_ms: float) -> list[tuple[str, bytes]]:
        n = len(decoded.items)
        out = [self._encode_error(req, fmt, exc, claimed_ms) for req, fmt, exc in decoded.early]
        for index, item in enumerate(decoded.items):
            timings = Timings(claimed_ms - item.request.enqueue_ms, n, fwd_ms, self._worker_id)
            if isinstance(result, RedbatchError):
                reply = Reply(item.request.id, False, error_code=result.code,
                              error_message=str(result), timings=timings)
            else:
                reply = Reply(item.request.id, True, payload=result[index], timings=timings)
            out.append((item.request.reply_to, self._encode_reply(reply, item.fmt)))
        return out

    def _encode_error(self, request: Request, fmt: Format, exc: RedbatchError,
                      claimed_ms: int) -> tuple[str, bytes]:
        wait_ms = max(0, claimed_ms - request.enqueue_ms) if request.enqueue_ms else 0
        reply = Reply(request.id, False, error_code=exc.code, error_message=str(exc),
                      timings=Timings(wait_ms, 0, 0.0, self._worker_id))
        return request.reply_to, self._encode_reply(reply, fmt)

    def _encode_reply(self, reply: Reply, fmt: Format) -> bytes:
        try:
            return codec.encode(reply.to_wire(), fmt)
        except InvalidPayload as exc:
            failed = Reply(reply.id, False, error_code=ModelError.code,
                           error_message=f"model {self.model.name!r} returned an output that "
                                         f"cannot be encoded: {exc}", timings=reply.timings)
            return codec.encode(failed.to_wire(), fmt)

    # --- publish ------------------------------------------------------------
    async def publish(self, replies: list[tuple[str, bytes]], claimed: int,
                      dead: list[bytes]) -> None:
        """All replies, dead letters and the ack in one MULTI/EXEC transaction."""
        grouped: defaultdict[str, list[bytes]] = defaultdict(list)
        for reply_to, data in replies:
            grouped[reply_to].append(data)
        async with self._redis.pipeline(transaction=True) as pipe:
            for reply_to, datas in grouped.items():
                pipe.rpush(reply_to, *datas)
                pipe.expire(reply_to, protocol.REPLY_TTL_S)
            if dead:
                self._dead_letter(pipe, dead)
            pipe.ltrim(self.claimer.inflight, claimed, -1)
            await pipe.execute()

    def _dead_letter(self, pipe: Any, dead: list[bytes]) -> None:
        key = protocol.dead_letter_key(self.model.name)
        pipe.rpush(key, *dead)
        pipe.ltrim(key, -protocol.DEAD_LETTER_MAX, -1)
        pipe.expire(key, protocol.DEAD_LETTER_TTL_S)

    def _log_batch(self, decoded: Decoded, claimed: int, claimed_ms: int, fwd_ms: float,
                   reply_ms: float) -> None:
        self.batches += 1
        self.items += claimed
        waits = [claimed_ms - item.request.enqueue_ms for item in decoded.items] or [0]
        log.info("model=%s n=%d computed=%d rejected=%d wait_ms=%.1f fwd_ms=%.2f "
                 "reply_ms=%.2f", self.model.name, claimed, len(decoded.items),
                 len(decoded.early), max(waits), fwd_ms, reply_ms)
