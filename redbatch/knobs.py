"""The batching knobs that change live: one table, their checks, and the stored
overrides (``protocol.config_key``) that gateways, clients and ``redbatch config``
write and workers apply with their heartbeat.  Imports neither the worker nor a web
framework.

A knob is one line of ``KNOBS``: its type, its range, and where a worker applies it
(``policy``: a ``BatchPolicy`` field; ``model``: an attribute of the ``Model``).  An
override stores only what someone changed; the effective values are the model's own
(published by its workers as ``defaults`` in its meta) with the overrides on top."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError

from redbatch import levels, lua, protocol, versions
from redbatch.errors import InvalidKnob, UnknownModel
from redbatch.pipelines.definition import meta_stages

log = logging.getLogger("redbatch.knobs")

if TYPE_CHECKING:
    import redis.asyncio as aioredis


MAX_BUCKETS = 64  # boundaries in a live ``buckets`` list
MAX_BUCKET_LEN = 1 << 20  # the longest bucket boundary


@dataclass(frozen=True)
class Knob:
    """One live knob: ``kind`` (int, float or bool), the range ``low..high`` (``low``
    excluded with ``low_open``), whether None is a legal value, and where it applies."""

    kind: type
    low: float | None = None
    high: float | None = None
    unit: str = ""
    low_open: bool = False
    nullable: bool = False
    part: str = "policy"
    label: str = ""
    max_items: int = protocol.MAX_PRIORITY_LEVELS  # a list knob's longest list
    increasing: bool = False  # a list knob's items must increase strictly


MAX_INT = 2**63 - 1  # the largest int a knob may be (what orjson stores)

KNOBS: dict[str, Knob] = {
    "max_batch_size": Knob(int, 1, 65536),
    "batch_wait_timeout_s": Knob(float, 0, 60, " s", label="batch_wait_timeout_s (timeout_s)"),
    "stride_s": Knob(float, 0, 60, " s"),
    "allow_small_batch": Knob(bool),
    "adaptive": Knob(bool),
    "quiet_s": Knob(float, 0, 60, " s", low_open=True, nullable=True),
    "max_batch_cost": Knob(float, 0, low_open=True, nullable=True),
    "auto_batch": Knob(bool),
    # with auto_batch, a variable-length model may hold an under-filled bucket over
    "hold_buckets": Knob(bool),
    # a variable-length model's passes padded to their longest item, not their bucket
    "pad_to_longest": Knob(bool),
    "max_queue_len": Knob(int, 1, nullable=True, part="model"),
    # the model's sub-queues (``protocol.sub_queue_tag``): producers spread over them
    "sub_queues": Knob(int, 1, protocol.MAX_SUB_QUEUES, part="model"),
    # a list of one int per priority level (its length is checked against the model's)
    "priority_caps": Knob(list, 1, nullable=True, part="model"),
    # the length buckets of a variable-length model (its spec's own by default)
    "buckets": Knob(list, 1, MAX_BUCKET_LEN, nullable=True, part="model",
                    max_items=MAX_BUCKETS, increasing=True),
}


def _range_text(knob: Knob) -> str:
    if knob.high is None:
        return f"{'>' if knob.low_open else '>='} {knob.low}"
    if knob.low_open:
        return f"> {knob.low:g} and at most {knob.high:g}{knob.unit}"
    return f"{knob.low:g}..{knob.high:g}{knob.unit}"


def check_range(name: str, value: Any) -> None:
    """Raise ``InvalidKnob`` when ``value`` is outside the knob's range (``BatchPolicy``
    checks its fields with this)."""
    knob = KNOBS.get(name)
    if knob is not None and value is None and not knob.nullable:
        kind = "true or false" if knob.kind is bool else _range_text(knob)
        raise InvalidKnob(f"{knob.label or name} must be {kind}, got None")
    if knob is None or value is None or knob.kind is bool:
        return
    if knob.kind is list:
        for item in value:
            check_range_item(name, knob, item)
        if knob.increasing and list(value) != sorted(set(value)):
            raise InvalidKnob(f"{name} must increase strictly, got {value}")
        return
    check_range_item(name, knob, value)


def check_range_item(name: str, knob: Knob, value: Any) -> None:
    """``InvalidKnob`` when one value (of a list knob: one of its items) is out of range,
    or not a finite number (NaN passes every comparison; JSON stores NaN and inf as
    null)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidKnob(f"{knob.label or name} must be a finite number, got {value}")
    most = sys.float_info.max if knob.kind is float else MAX_INT
    if value > most:
        raise InvalidKnob(f"{knob.label or name} must be at most {most}, got "
                          f"{str(value)[:40]}")
    low_bad = knob.low is not None and (value <= knob.low if knob.low_open else value < knob.low)
    if low_bad or (knob.high is not None and value > knob.high):
        raise InvalidKnob(f"{knob.label or name} must be {_range_text(knob)}, got {value}")


_KIND_TEXT = {int: "an integer", float: "a number", bool: "true or false"}


def _kind_text(knob: Knob) -> str:
    return f"a list of 1-{knob.max_items} integers" if knob.kind is list else \
        _KIND_TEXT[knob.kind]


def _is_kind(value: Any, kind: type, max_items: int = 0) -> bool:
    if kind is list:
        return isinstance(value, list) and 1 <= len(value) <= max_items \
            and all(_is_kind(item, int) for item in value)
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def check(name: str, value: Any) -> Any:
    """The value of knob ``name`` as it is applied (an int given for a float knob
    becomes a float), or ``InvalidKnob`` naming the knob and the value."""
    _known(name)
    knob = KNOBS[name]
    if value is None and knob.nullable:
        return None
    if not _is_kind(value, knob.kind, knob.max_items):
        raise InvalidKnob(f"{name} must be {_kind_text(knob)}, got {value!r}")
    check_range(name, value)
    return float(value) if knob.kind is float else value


def check_all(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every knob of ``values`` checked (``check``)."""
    return {name: check(name, value) for name, value in values.items()}


def changes_from(changes: Mapping[str, Any]) -> dict[str, Any]:
    """A change set checked: knob -> new value, or None to drop its override (the
    knob goes back to the model's own value)."""
    if not isinstance(changes, Mapping):
        raise InvalidKnob("the knobs must be an object of knob -> value")
    return {str(name): _change(str(name), value) for name, value in changes.items()}


def _change(name: str, value: Any) -> Any:
    """None (drop the override) for a known knob, else the checked value."""
    if value is None:
        _known(name)
        return None
    return check(name, value)


def _known(name: str) -> None:
    if name not in KNOBS:
        raise InvalidKnob(f"unknown knob {name!r}; live knobs: {', '.join(KNOBS)}")


def check_caps(caps: list[int] | None, levels: int) -> None:
    """``InvalidKnob`` unless ``priority_caps`` is None or holds one cap per level."""
    if caps is not None and levels == 1:
        raise InvalidKnob("priority_caps is for a model of several priority levels; this "
                          "one has one (its queue cap is max_queue_len)")
    if caps is not None and len(caps) != levels:
        raise InvalidKnob(f"priority_caps must be null or a list of {levels} integers >= 1 "
                          f"(one per priority level of the model), got {caps!r}")


def check_sub_queues(count: int | None, streaming: bool) -> None:
    """``InvalidKnob`` when ``sub_queues`` splits a streaming model's queue (its
    workers claim from one queue)."""
    if streaming and count is not None and count > 1:
        raise InvalidKnob(f"sub_queues must be 1 for a streaming model (it is served "
                          f"from one queue), got {count}")


def check_buckets(buckets: list[int] | None, own: list[int] | None) -> None:
    """``InvalidKnob`` when ``buckets`` is set for a model without a variable length
    (whose own ``buckets`` is None)."""
    if buckets is not None and own is None:
        raise InvalidKnob("buckets is for a model with a variable-length input "
                          "(a TensorSpec with max_len)")


def effective(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The model's own knob values (``base``) with ``overrides`` on top, all checked."""
    return check_all({**{k: v for k, v in base.items() if k in KNOBS}, **overrides})


def parts(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``values`` split by where they apply: ``policy`` and ``model``."""
    split: dict[str, dict[str, Any]] = {"policy": {}, "model": {}}
    for name, value in values.items():
        split[KNOBS[name].part][name] = value
    return split


def decode_stored(raw: Mapping[Any, Any]) -> tuple[dict[str, Any], list[str]]:
    """The overrides of a ``config_key`` hash, and a line per stored override that no
    longer checks (edited by hand, or a knob this version does not know): ignored."""
    good: dict[str, Any] = {}
    problems: list[str] = []
    for field, text in raw.items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        try:
            good[name] = check(name, orjson.loads(text))
        except (InvalidKnob, orjson.JSONDecodeError) as exc:
            problems.append(f"{name}={text!r}: {exc}")
    return good, problems


def published(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The knob values a model's workers run with, from the meta they publish (a value
    that does not check, written by something else, is left out)."""
    values: dict[str, Any] = {}
    for section in ("policy", "limits"):
        if isinstance(part := meta.get(section), dict):
            values.update(part)
    shown: dict[str, Any] = {}
    for name in KNOBS:
        if name in values:
            with contextlib.suppress(InvalidKnob):
                shown[name] = check(name, values[name])
    return shown


def model_defaults(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A model's own knob values (before overrides) from the meta its workers publish."""
    return dict(meta.get("defaults") or published(meta))


async def _load(redis: aioredis.Redis, model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's own knob values and its stored overrides, in one round trip;
    ``UnknownModel`` when no worker registered it."""
    protocol.check_model_name(model)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(protocol.meta_key(model))
        pipe.hgetall(protocol.config_key(model))
        pipe.hgetall(protocol.versions_key(model))
        meta, raw, served = await pipe.execute(raise_on_error=False)
    if isinstance(meta, ResponseError) or isinstance(raw, ResponseError):
        raise _unreadable(model, meta if isinstance(meta, Exception) else raw)
    if not meta:
        names = [] if isinstance(served, Exception) else [
            protocol.served_name(model, v) for v in versions.decode(served).versions]
        raise UnknownModel(f"unknown model {model!r}: no worker serves it" + (
            f"; its versions are models of their own: {', '.join(sorted(names))}"
            if names else ""))
    try:
        return _own_values(orjson.loads(meta)), decode_stored(raw)[0]
    except (ValueError, TypeError, AttributeError) as exc:  # (a meta of another shape)
        raise _unreadable(model, exc) from exc


def _own_values(data: dict[str, Any]) -> dict[str, Any]:
    """A model's own knob values, as its metadata publishes them."""
    return {**model_defaults(data),
            "priority_levels": levels.from_section(data.get("priority")).count,
            "streaming": data.get(protocol.F_STREAMING) is True,
            "stages": meta_stages(data)}


def _unreadable(model: str, exc: Exception) -> UnknownModel:
    """A model whose metadata or stored knobs cannot be read (another type of value, not
    JSON): unknown, as the models' listing leaves it out; the detail is logged."""
    log.warning("model %r: its metadata or knobs in Redis cannot be read (%s: %s)", model,
                type(exc).__name__, exc)
    return UnknownModel(f"unknown model {model!r}: its keys in Redis cannot be read "
                        "(see the log)")


async def show(redis: aioredis.Redis, model: str) -> dict[str, Any]:
    """``{"overrides": ..., "effective": ...}`` of ``model``."""
    base, overrides = await _load(redis, model)
    return {"overrides": overrides, "effective": effective(base, overrides)}


async def configure(redis: aioredis.Redis, model: str, changes: Mapping[str, Any], *,
                    reset: bool = False) -> dict[str, Any]:
    """Check ``changes`` (``changes_from``) against the model's own values and store
    them in one step (after dropping every override with ``reset``); nothing is
    stored when a value is bad (``InvalidKnob``).  Returns ``show``'s answer."""
    checked = changes_from(changes)
    base, stored = await _load(redis, model)
    if base["stages"]:  # no worker reads a pipeline's knobs: its stages have their own
        raise InvalidKnob(f"{model!r} is a pipeline: its knobs are its stages' "
                          f"({', '.join(base['stages'])}); change them there")
    overrides = {} if reset else stored
    overrides = {**overrides, **checked}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    values = effective(base, overrides)
    check_caps(values.get("priority_caps"), base["priority_levels"])
    check_buckets(values.get("buckets"), base.get("buckets"))
    check_sub_queues(values.get("sub_queues"), base["streaming"])
    await _store(redis, model, checked, reset)
    before = effective(base, stored).get("sub_queues", 1)
    if values.get("sub_queues", 1) < before:
        await notice_shrink(redis, model, before)
    return {"overrides": overrides, "effective": values}


async def notice_shrink(redis: aioredis.Redis, model: str, before: int) -> None:
    """Sub-queues up to ``before`` may hold entries above the count (``sub_queues``
    went down from it, or a worker returned a batch there): a notice every worker
    drains by (``sub_queues_shrunk_key``, at the most S of the notices still live), and
    the queue depths count those sub-queues meanwhile (``sub_queues_draining_key``, as
    a draining worker's beat writes it); one script (``lua.NOTICE_SHRINK``)."""
    keys = [protocol.sub_queues_shrunk_key(model), protocol.sub_queues_draining_key(model)]
    await redis.register_script(lua.NOTICE_SHRINK)(keys=keys, args=[
        before, protocol.now_ms(), protocol.SHRUNK_NOTICE_TTL_S, protocol.MAX_SUB_QUEUES])


async def _store(redis: aioredis.Redis, model: str, checked: Mapping[str, Any],
                 reset: bool) -> None:
    key = protocol.config_key(model)
    dropped = [k for k, v in checked.items() if v is None]
    kept = {k: orjson.dumps(v) for k, v in checked.items() if v is not None}
    async with redis.pipeline(transaction=True) as pipe:
        if reset:
            pipe.delete(key)
        if dropped:
            pipe.hdel(key, *dropped)
        if kept:
            pipe.hset(key, mapping=kept)  # type: ignore[arg-type]
        await pipe.execute()
