"""The wire protocol: every Redis key, TTL and message field, in one place.

See ``docs/protocol.md`` for the language-neutral description.  All keys of one
model share the Redis Cluster hash tag ``{<model>}``, a client's reply list for the
model's requests included (``reply_key``).  Times are absolute epoch milliseconds
(``*_ms``) or durations with their unit in the name (``*_s``).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

from redbatch.errors import BadRequest, InvalidPayload

log = logging.getLogger("redbatch.protocol")

PROTOCOL_VERSION: Final = 1
PREFIX: Final = "rb"

# --- TTLs and limits ----------------------------------------------------------
# (the tunable defaults, such as the dead letters' TTL, are in ``redbatch.defaults``)
QUEUE_TTL_S: Final = 3600  # refreshed by every push
INFLIGHT_TTL_S: Final = 24 * 3600  # refreshed by every claim
# a reply list's TTL at least, refreshed by every reply pushed to it; a list holding a
# reply whose deadline is further out lives until then (its marker's TTL: lua._HELPERS),
# so a pipeline stage's outbox keeps a hand-off record until its request's deadline
REPLY_TTL_S: Final = 120
META_TTL_S: Final = 24 * 3600  # refreshed by worker heartbeats
WORKERS_TTL_S: Final = 24 * 3600  # refreshed by heartbeats; outlives in-flight lists
DEAD_LETTER_MAX: Final = 10_000  # the list keeps the newest entries only
MAX_TIMEOUT_S: Final = 600.0  # no deadline may be further out than this
CLOCK_SKEW_MS: Final = 60_000  # a producer's clock may run this far ahead of a worker's
MAX_ATTEMPT: Final = 1000  # an entry's ``attempt`` is 0..MAX_ATTEMPT; so is max_attempts
MARKER_GRACE_MS: Final = 5000  # a request marker outlives its deadline by this much
MAX_ENTRY_BYTES: Final = 16 * 1024 * 1024
# the PUBLISH ack of a batch of at most ACK_BY_ENTRIES_MAX entries, or of at most
# ACK_BY_ENTRIES_MAX_LARGE whose mean size is at least ACK_BY_ENTRIES_MIN_MEAN_BYTES,
# together at most
# ACK_BY_ENTRIES_MAX_BYTES, checks the in-flight head against the entries themselves
# (ARGV[3] is this marker, not a SHA-1): Redis compares them in place (one LPOS each),
# where a digest would read the head into Lua and hash it.  Any other batch goes by
# its SHA-1 (many small entries hash faster than they are found one LPOS at a time);
# so does every batch of a worker whose Redis user may not run LPOS (docs/protocol.md
# §11)
ACK_BY_ENTRIES: Final = "="
ACK_BY_ENTRIES_MAX: Final = 8
ACK_BY_ENTRIES_MIN_MEAN_BYTES: Final = 768
ACK_BY_ENTRIES_MAX_LARGE: Final = 128  # entries i is found by scanning i: n(n+1)/2 in all
ACK_BY_ENTRIES_MAX_BYTES: Final = 256 * 1024
MAX_ROWS: Final = 4096  # rows in one multi-row request (F_ROWS)
MAX_MARKER_TTL_MS: Final = int(MAX_TIMEOUT_S * 1000) + MARKER_GRACE_MS
MAX_PRIORITY_LEVELS: Final = 16  # a model's priority levels are 1..L, L at most this
# a sharded model's workers take their homes by rank among its live workers while
# the last heartbeat counted at most this many (each beat then reads their ids); more
# live workers take crc32 homes, and no beat reads the ids (docs/protocol.md §7.2)
RANKED_WORKERS_MAX: Final = 256
MAX_SUB_QUEUES: Final = 64  # a model's sub-queues (``sub_queue_tag``) are 0..S-1, S at most this
CRASHING_TTL_S: Final = 3600  # the entry a worker runs alone outlives the worker this long
REAPING_TTL_MS: Final = 5000  # a reaper's election; past it, a reaper that died is replaced

MODEL_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Takes ``reply_key``'s ``rb:reply:{<model>}:<id>`` and the legacy ``rb:reply:{<id>}``
# alike; unchanged since 1.0, so that workers of 1.0 answer producers of 1.1.
REPLY_TO_RE: Final = re.compile(r"^rb:reply:[A-Za-z0-9{}_.:@-]{1,180}$")
# A model served in several versions: each version is served under the name
# ``<model>@<version>`` (its own keys, its own hash tag); ``@`` is in no model name.
VERSION_SEP: Final = "@"
VERSION_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")

# --- message fields -----------------------------------------------------------
F_VERSION: Final = "v"
F_ID: Final = "id"
F_MODEL: Final = "model"
F_ENQUEUE_MS: Final = "enqueue_ms"
F_DEADLINE_MS: Final = "deadline_ms"
F_REPLY_TO: Final = "reply_to"
F_ATTEMPT: Final = "attempt"
F_TRACE_ID: Final = "trace_id"  # optional: the caller's correlation id (X-Request-ID)
TRACE_ID_RE: Final = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
F_ROWS: Final = "rows"  # optional: the payload is a tensor of this many rows, one item each
F_PRIORITY: Final = "priority"  # optional: the request's priority level (1: most urgent)
F_SUSPECT: Final = "suspect"  # optional: was in a batch that crashed a worker: run it alone
F_ROW_ERRORS: Final = "row_errors"  # reply to a multi-row request: the rows that failed
F_ROW: Final = "row"
F_PAYLOAD: Final = "payload"
F_OK: Final = "ok"
F_ERROR: Final = "error"
F_CODE: Final = "code"
F_MESSAGE: Final = "message"
F_TIMINGS: Final = "timings"
F_QUEUE_WAIT_MS: Final = "queue_wait_ms"
F_BATCH_SIZE: Final = "batch_size"
F_FORWARD_MS: Final = "forward_ms"
F_WORKER_ID: Final = "worker_id"
F_ITEMS_PER_S: Final = "items_per_s"  # worker_info / worker_capacity: measured capacity
F_SERVED_PER_S: Final = "served_per_s"  # worker_capacity: entries served per second lately
# worker_info of a sharded model: the most sub-queues the worker may hold entries of
# (its reaper reads that many in-flight lists); absent for a model of one sub-queue
F_SUB_QUEUES_SEEN: Final = "sub_queues_seen"
TENSOR_TAG: Final = "__tensor__"
# A streaming model's messages on the reply list (``redbatch.stream_wire``): each chunk
# and the final message carry the request's id and ``seq`` (0, 1, ...); the final one
# has ``last`` true, ``ok``, the error if any, and the timings (with ``steps``).
F_SEQ: Final = "seq"
F_LAST: Final = "last"
F_STEPS: Final = "steps"  # final timings: the steps the request was in
F_STREAMING: Final = "streaming"  # a model's meta: its batch function is a generator
STREAM_GRACE_MS: Final = 2000  # a stream's caller waits this long past its deadline
STREAM_MAX_BUFFERED: Final = 4096  # chunks a caller may leave unread before it fails
STREAM_MAX_BUFFERED_BYTES: Final = 32 << 20  # ... and their bytes (on the wire), at most
# A streaming entry's marker (``request_key``): ``q`` queued, ``s<n>`` once chunks
# 0..n-1 went out, ``d`` once its final message went out.
STREAMED_PREFIX: Final = "s"
MAX_REQUEST_ID_CHARS: Final = 128  # a request's id: 1 to this many characters


# --- keys ---------------------------------------------------------------------
def check_model_name(model: str) -> str:
    """Return ``model`` if it is a legal model name (or a version's served name,
    ``served_name``), else raise ``InvalidPayload``."""
    base, _, version = model.partition(VERSION_SEP) if isinstance(model, str) else ("", "", "")
    if not MODEL_NAME_RE.fullmatch(base) or (
            version and not VERSION_RE.fullmatch(version)) or model.endswith(VERSION_SEP):
        raise InvalidPayload(f"invalid model name {model!r}: use 1-64 of [A-Za-z0-9_.-]"
                             " (a version's served name: <model>@<version>)")
    return model


def check_version(version: str) -> str:
    """Return ``version`` if it is a legal version name, else raise ``InvalidPayload``."""
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise InvalidPayload(f"invalid version {version!r}: use 1-32 of [A-Za-z0-9_.-]")
    return version


def check_pin(model: str, version: str | None, *, served_route: bool = True) -> None:
    """``BadRequest`` for a version pinned on a version's served name (``vm@1`` with
    version ``1``): the name names its version already.  The message names the right
    forms: the version route, and the served name alone where the API takes one
    (``served_route``; v2 does not).  An illegal name is ``check_model_name``'s 400."""
    if version is None or VERSION_SEP not in model:
        return
    base = check_model_name(model).partition(VERSION_SEP)[0]
    routed = f"models/{base}/versions/{version}/..."
    if not served_route:
        raise BadRequest(f"model {model!r} is a version's served name: use the model's"
                         f" name with the version route ({routed})")
    raise BadRequest(
        f"model {model!r} is a version's served name: use either the model's name with"
        f" the version route ({routed}, or version={version!r}), or the served name"
        f" without a version (models/{model}/...)")


def served_name(model: str, version: str | None) -> str:
    """The name a model's version is served under (its keys' hash tag):
    ``<model>@<version>``, or ``model`` itself for an unversioned model."""
    return model if version is None else f"{model}{VERSION_SEP}{version}"


def split_name(name: str) -> tuple[str, str | None]:
    """``served_name``'s inverse: the model and its version (None: unversioned)."""
    base, sep, version = name.partition(VERSION_SEP)
    return base, (version if sep else None)


def sub_queue_tag(model: str, index: int) -> str:
    """The hash tag of sub-queue ``index`` of ``model``: the model's own name for
    sub-queue 0 (a model of one sub-queue keeps the keys it always had), ``<model>:<index>``
    for the others.  Every per-queue key (``queue_key``, ``inflight_key``, ``held_key``,
    ``request_key``, ``reply_key``, ``cancelled_key``, ``bell_key``,
    ``dead_letter_key``) takes the tag in place of the model's name, so that each
    sub-queue lives in a hash slot of its own; the model's registry keys (meta,
    workers, config) keep the model's tag.  A model name cannot hold ``:``, so a tag
    never names another model."""
    return f"{model}:{index}" if index else model


def sub_queue_tags(model: str, count: int) -> list[str]:
    """The tags of sub-queues 0..``count``-1 of ``model``."""
    return [sub_queue_tag(model, index) for index in range(count)]


def model_of_tag(tag: str) -> str:
    """The model a sub-queue tag belongs to (``sub_queue_tag``'s inverse)."""
    return tag.split(":", 1)[0]


def queue_key(model: str, level: int = 0) -> str:
    """A model's queue; with priority levels, level ``level``'s queue: the default
    level's (``level`` 0) is the plain queue, the others ``...:queue:p<level>``."""
    if level:
        return f"{PREFIX}:{{{model}}}:queue:p{level}"
    return f"{PREFIX}:{{{model}}}:queue"


def level_queues(model: str, levels: int, default: int) -> list[str]:
    """The queues of a model's priority levels 1..``levels``, most urgent first; level
    ``default`` keeps the plain queue (so foreign producers and autoscalers that know
    only ``queue_key(model)`` still see it)."""
    return [queue_key(model, 0 if level == default else level)
            for level in range(1, levels + 1)]


def bell_key(model: str) -> str:
    """List of one element while a multi-level model's level queues may hold entries:
    its workers block on it (``BLMOVE`` bell to itself, never consumed); every
    multi-level enqueue rings it, a claim that empties every level silences it."""
    return f"{PREFIX}:{{{model}}}:bell"


def inflight_key(model: str, worker_id: str) -> str:
    return f"{PREFIX}:{{{model}}}:inflight:{worker_id}"


def held_key(model: str, worker_id: str) -> str:
    """List: the entries ``worker_id`` holds over for its next batch (an under-filled
    length bucket, ``hold``), moved from its in-flight list's head by the PUBLISH of
    the batch that held them, trimmed off by the next one's; requeued, before the
    in-flight entries, by a reap.  Its TTL is the in-flight list's."""
    return f"{PREFIX}:{{{model}}}:held:{worker_id}"


def closed_key(tag: str) -> str:
    """String, set while a drained version's sub-queue ``tag`` is closed: the last
    worker of a draining version sets it in the step that finds the sub-queue and every
    in-flight list of it empty (``lua.DRAIN_CLOSE``), and the enqueue of a versioned
    name refuses while it exists (503, ``no_workers``), so that nothing is queued
    where no worker will come.  A worker of the version deletes it when it starts.
    Expires after ``CLOSED_TTL_S``."""
    return f"{PREFIX}:{{{tag}}}:closed"


# a version "1" takes over the stored row of a model's workers served without versions
# once they are gone this many of its lease TTLs (a restart of theirs moves no traffic)
BASE_SETTLE_LEASES: Final = 2
CLOSED_TTL_S: Final = 7 * 24 * 3600  # a drained version's sub-queue stays closed this long


def workers_key(model: str) -> str:
    """Sorted set: worker id -> lease expiry (epoch ms)."""
    return f"{PREFIX}:{{{model}}}:workers"


def held_aware_key(model: str) -> str:
    """Sorted set: the members of ``workers_key`` whose worker knows held lists
    (revision 1.4 and later), with the same lease expiry, written in the same heartbeat
    and removed with them.  A worker holds entries over (``hold``) only while every
    live lease of the model is here too: a reaper or drainer of an older revision
    ignores held lists."""
    return f"{PREFIX}:{{{model}}}:workers_held"


def worker_info_key(model: str) -> str:
    """Hash: worker id -> JSON description (device, pid, host)."""
    return f"{PREFIX}:{{{model}}}:worker_info"


def worker_capacity_key(model: str) -> str:
    """Hash: worker id -> compact JSON ``{"items_per_s", "rows"}``, all that admission
    reads of a live worker (the full ``worker_info`` is for ``redbatch status``)."""
    return f"{PREFIX}:{{{model}}}:worker_capacity"


def meta_key(model: str) -> str:
    """String: the model's JSON metadata (input spec, batching policy)."""
    return f"{PREFIX}:{{{model}}}:meta"


def sub_queues_draining_key(model: str) -> str:
    """String: while workers drain the sub-queues above a model's shrunk count, the
    most sub-queues any of them still claims from (more than the count); queue depths
    count that many (``levels.level_keys``).  Written by draining workers, with each
    heartbeat (``lua.PUBLISH_DRAINING``; it expires ``DRAINING_TTL_BEATS`` heartbeat
    intervals after the last one's), and with a shrink notice (``lua.NOTICE_SHRINK``,
    for ``SHRUNK_NOTICE_TTL_S`` until a drainer's beat writes it)."""
    return f"{PREFIX}:{{{model}}}:sub_queues_draining"


DRAINING_TTL_BEATS: Final = 2  # a sub_queues_draining count outlives its last beat


def sub_queues_shrunk_key(model: str) -> str:
    """String ``<S>:<epoch ms>``: written when ``sub_queues`` is lowered live (kept at
    the most of its S while it lasts), the S before; each worker, once per notice,
    drains the sub-queues up to it (a worker that never saw that S, as after a quick
    raise and lower, would leave entries a producer pushed there).  Expires after
    ``SHRUNK_NOTICE_TTL_S``."""
    return f"{PREFIX}:{{{model}}}:sub_queues_shrunk"


SHRUNK_NOTICE_TTL_S: Final = 60


def config_key(model: str) -> str:
    """Hash: knob -> JSON value, the model's live overrides of its batching knobs
    (``redbatch config``, ``PATCH /v1/models/{model}/config``); only the knobs someone
    changed.  No TTL: kept until reset.  Workers read it with every heartbeat."""
    return f"{PREFIX}:{{{model}}}:config"


def versions_key(model: str) -> str:
    """Hash of a model served in versions, in the model's own slot (``{<model>}``, no
    version): ``<version>`` -> JSON ``{"weight": number|null, "draining": bool}``, one
    field per version (a worker adds its version's with ``lua.REGISTER_VERSION``
    when it registers), and ``@latest`` -> JSON version, the pinned ``latest`` if set.  No TTL."""
    return f"{PREFIX}:{{{model}}}:versions"


LATEST_FIELD: Final = "@latest"  # versions_key's field of the pinned latest version


def dead_letter_key(model: str) -> str:
    return f"{PREFIX}:{{{model}}}:dead"


def request_key(model: str, request_id: str) -> str:
    """String marker of one request: ``q`` once enqueued (dedupes retried pushes),
    ``d`` once answered (first writer wins: a request is answered at most once)."""
    return f"{PREFIX}:{{{model}}}:req:{request_id}"


def marker_ttl_ms(deadline_ms: int, now: int) -> int:
    """How long a request's marker must live: until its deadline, plus a grace; never
    longer than the furthest legal deadline allows (a hostile ``deadline_ms`` of 2**64-1
    must not make Redis refuse the ``PX``)."""
    return min(max(deadline_ms - now, 0), MAX_MARKER_TTL_MS - MARKER_GRACE_MS) + \
        MARKER_GRACE_MS


def crashing_key(model: str, worker_id: str) -> str:
    """String: the id of the suspect entry ``worker_id`` is running alone right now."""
    return f"{PREFIX}:{{{model}}}:crashing:{worker_id}"


def reaping_key(model: str, worker_id: str) -> str:
    """String: the id of the live worker elected to reap ``worker_id`` (``SET NX PX
    REAPING_TTL_MS``); only it reads the dead worker's in-flight list."""
    return f"{PREFIX}:{{{model}}}:reaping:{worker_id}"


def unblock_guard_key(tag: str) -> str:
    """A key that is never written: a ``PEXPIRE`` of it goes in the same write before
    each ``CLIENT UNBLOCK`` of a worker's blocking pop (sub-queue ``tag``'s).  That
    ``PEXPIRE`` is a write, so ``CLIENT PAUSE WRITE`` (an operator's, ``FAILOVER``'s,
    a manual ``CLUSTER FAILOVER``'s) holds it, and the unblock behind it, until the
    pause ends: an unblock of a pop that the pause holds unrun makes Redis abort (7.0.15
    does; fixed upstream in 2025, redis/redis#14164)."""
    return f"{PREFIX}:{{{tag}}}:unblock-guard"


def cancelled_key(model: str) -> str:
    """Sorted set: request id -> deadline (epoch ms) of queued requests whose caller
    went away (an HTTP client that disconnected); workers skip them without
    computing.  Trimmed by score and to ``CANCELLED_MAX`` members, and it expires with
    its latest deadline plus ``MARKER_GRACE_MS``: workers look at it only while it exists."""
    return f"{PREFIX}:{{{model}}}:cancelled"


CANCELLED_MAX: Final = 10_000  # members kept in a model's cancelled set (latest deadlines)


def suspects_key(tag: str) -> str:
    """Sorted set: request id -> deadline (epoch ms) of the entries a reaper requeued
    from a worker that died (sub-queue ``tag``), written before it requeues them: a
    worker honours an entry's ``suspect`` flag only for an id it holds.  Trimmed by
    score and to ``SUSPECTS_MAX`` members; it expires with its latest deadline plus
    ``MARKER_GRACE_MS``."""
    return f"{PREFIX}:{{{tag}}}:suspects"


SUSPECTS_MAX: Final = 10_000  # members kept in a suspects set (latest deadlines)
MODELS_KEY: Final = f"{PREFIX}:models"  # sorted set: model -> last heartbeat (epoch ms)


def reply_key(model: str, client_id: str) -> str:
    """List: a client's replies to its requests for ``model``, in the model's slot (a
    worker's reply-and-ack script touches it with the model's keys)."""
    return f"{PREFIX}:reply:{{{model}}}:{client_id}"


def legacy_reply_key(client_id: str) -> str:
    """The reply list of producers before protocol 1.1, tagged by the client: still
    answered on a plain Redis, never on Redis Cluster (``reply_in_model_slot``)."""
    return f"{PREFIX}:reply:{{{client_id}}}"


# --- pipelines (docs/protocol.md §17) -------------------------------------------
PIPELINES_KEY: Final = f"{PREFIX}:pipelines"  # hash: pipeline name -> JSON definition
HANDOFF_LEASE_MS: Final = 5000  # a taken hand-off record not done by then is taken again
HANDOFF_TAKE: Final = 64  # hand-off records taken per step
F_STAGE: Final = "stage"  # error map of a pipeline's reply: the stage that failed
F_STAGES: Final = "stages"  # a pipeline's final reply: each stage's timings, in order
F_PART: Final = "p"  # a merge stage's part: one branch's output
F_PART_TIMINGS: Final = "t"  # ... and that branch stage's timings
# a multi-row payload given as a map name -> rows (a model without a spec): at most
# this many names (a merge stage's branches), so that one entry cannot make a worker
# build millions of maps
MAX_ROW_MAP_NAMES: Final = 64


def outbox_key(stage: str) -> str:
    """List: a stage's replies to pipeline requests (their ``reply_to``), in the
    stage's slot; the hand-off takes them from here to the next stage."""
    return f"{PREFIX}:reply:{{{stage}}}:pipeline"


def handoff_key(stage: str) -> str:
    """Sorted set: hand-off records (outbox replies) being handed on -> lease expiry
    (epoch ms); a record whose lease expired is taken again (its sender died)."""
    return f"{PREFIX}:{{{stage}}}:handoff"


def parts_key(stage: str, request_id: str) -> str:
    """Hash: a merge stage's inputs for one request, branch stage -> its output (each
    written once, ``HSETNX``), until every branch of the fan-out is in."""
    return f"{PREFIX}:{{{stage}}}:parts:{request_id}"


def context_key(stage: str, request_id: str) -> str:
    """String: a pipeline request's context (JSON) while it is at ``stage``: its
    pipeline, remaining route, final reply list, deadline, priority and trace id."""
    return f"{PREFIX}:{{{stage}}}:pctx:{request_id}"


def hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag of ``key`` (between its first ``{`` and the next
    ``}``, if not empty), or None when the whole key is hashed."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else None


def reply_in_model_slot(model: str, reply_to: str) -> bool:
    """Whether a reply list shares ``model``'s hash tag, so that a worker of ``model``
    can answer into it atomically on Redis Cluster too.  A ``reply_to`` tagged
    otherwise (``legacy_reply_key``, a foreign client's own name) is answered in the
    same script on a plain Redis only."""
    return hash_tag(reply_to) == model


# --- time and ids ---------------------------------------------------------------
def now_ms() -> int:
    return time.time_ns() // 1_000_000


def queue_wait_ms(claimed_ms: int, enqueue_ms: int) -> int:
    """How long a request waited in its queue, clamped to [0, MAX_TIMEOUT_S]: a foreign
    producer's clock may be off, and no request waits longer than its deadline.  An
    ``enqueue_ms`` of 0 (unknown) counts as no wait."""
    if not enqueue_ms:
        return 0
    return min(max(claimed_ms - enqueue_ms, 0), int(MAX_TIMEOUT_S * 1000))


def latest_ms(now: int) -> int:
    """The latest epoch ms a worker takes in ``enqueue_ms`` or ``deadline_ms``: the
    longest deadline from ``now``, plus the clock skew allowed between hosts."""
    return now + int(MAX_TIMEOUT_S * 1000) + CLOCK_SKEW_MS


def new_id() -> str:
    """A random 128-bit id in hex (as ``uuid4().hex``, without building a UUID)."""
    return os.urandom(16).hex()


def new_request_id() -> str:
    """A request's id: 128 random bits, so that nobody who can write to a queue or a
    reply list can guess the next id (to claim it first, or forge its reply).  One
    ``getrandom`` call: measured as fast as the per-process counter it replaced, and
    fork-safe with no state to reset."""
    return os.urandom(16).hex()


# --- envelopes ------------------------------------------------------------------
@dataclass(slots=True)
class Request:
    """One inference request, as it sits in a model's queue."""

    id: str
    model: str
    enqueue_ms: int
    deadline_ms: int
    reply_to: str
    payload: Any
    attempt: int = 0
    trace_id: str = ""
    rows: int = 0  # 0: one input; n >= 1: the payload's first dimension, n items
    suspect: bool = False  # in a batch that crashed a worker: run alone
    priority: int = 0  # its priority level (1: most urgent); 0: none given (one level)

    def to_wire(self) -> dict[str, Any]:
        wire = {
            F_VERSION: PROTOCOL_VERSION,
            F_ID: self.id,
            F_MODEL: self.model,
            F_ENQUEUE_MS: self.enqueue_ms,
            F_DEADLINE_MS: self.deadline_ms,
            F_REPLY_TO: self.reply_to,
            F_ATTEMPT: self.attempt,
            F_PAYLOAD: self.payload,
        }
        if self.trace_id:
            wire[F_TRACE_ID] = self.trace_id
        if self.rows:
            wire[F_ROWS] = self.rows
        if self.suspect:
            wire[F_SUSPECT] = True
        if self.priority:
            wire[F_PRIORITY] = self.priority
        return wire


@dataclass(slots=True)
class Timings:
    queue_wait_ms: float = 0.0
    batch_size: int = 0
    forward_ms: float = 0.0
    worker_id: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            F_QUEUE_WAIT_MS: self.queue_wait_ms,
            F_BATCH_SIZE: self.batch_size,
            F_FORWARD_MS: self.forward_ms,
            F_WORKER_ID: self.worker_id,
        }


@dataclass(slots=True)
class Reply:
    """The answer to one request: a payload, or an error code and message."""

    id: str
    ok: bool
    payload: Any = None
    error_code: str = ""
    error_message: str = ""
    timings: Timings = field(default_factory=Timings)
    # a multi-row request's failed rows: row -> (error code, message); their outputs are nil
    row_errors: dict[int, tuple[str, str]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {F_VERSION: PROTOCOL_VERSION, F_ID: self.id, F_OK: self.ok}
        if self.ok:
            wire[F_PAYLOAD] = self.payload
        else:
            wire[F_ERROR] = {F_CODE: self.error_code, F_MESSAGE: self.error_message}
        if self.row_errors:
            wire[F_ROW_ERRORS] = [{F_ROW: row, F_CODE: code, F_MESSAGE: message}
                                  for row, (code, message) in self.row_errors.items()]
        wire[F_TIMINGS] = self.timings.to_wire()
        return wire


def _field(wire: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = wire.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise InvalidPayload(f"field {name!r} is missing or not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _check_version(wire: Any) -> dict[str, Any]:
    if not isinstance(wire, dict):
        raise InvalidPayload("envelope is not a map")
    version = wire.get(F_VERSION)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise InvalidPayload(f"unsupported protocol version {version!r}")
    return wire


def request_from_wire(wire: Any) -> Request:
    """Validate a decoded request envelope; raise ``InvalidPayload`` if it is bad."""
    wire = _check_version(wire)
    reply_to = _field(wire, F_REPLY_TO, str)
    if not REPLY_TO_RE.fullmatch(reply_to):
        raise InvalidPayload("reply_to must match rb:reply:{<model>}:<id> (REPLY_TO_RE)")
    if F_PAYLOAD not in wire:
        raise InvalidPayload("field 'payload' is missing")
    now = now_ms()
    return Request(
        id=_checked_id(_field(wire, F_ID, str)),
        model=check_model_name(_field(wire, F_MODEL, str)),
        enqueue_ms=_epoch_ms(wire, F_ENQUEUE_MS, now),
        deadline_ms=_epoch_ms(wire, F_DEADLINE_MS, now),
        reply_to=reply_to,
        attempt=_attempt(wire),
        payload=wire[F_PAYLOAD],
        trace_id=_trace_id(wire.get(F_TRACE_ID)),
        rows=_rows(wire.get(F_ROWS)),
        suspect=wire.get(F_SUSPECT) is True,
        priority=_priority(wire.get(F_PRIORITY)),
    )


def _priority(value: Any) -> int:
    """The envelope's priority level; informational (the queue an entry sits in is what
    orders it), so a bad one is dropped rather than failing the request."""
    if type(value) is int and 1 <= value <= MAX_PRIORITY_LEVELS:
        return value
    return 0


def _rows(value: Any) -> int:
    if value is None:
        return 0
    if type(value) is not int or not 1 <= value <= MAX_ROWS:
        raise InvalidPayload(f"field 'rows' must be an integer 1-{MAX_ROWS}")
    return value


def _epoch_ms(wire: dict[str, Any], name: str, now: int) -> int:
    """An epoch-ms field, 0 up to ``latest_ms(now)``: a foreign "no deadline" such as
    2**63-1 would otherwise reach Redis as a TTL no command takes."""
    value: int = _field(wire, name, int)
    if not 0 <= value <= latest_ms(now):
        raise InvalidPayload(
            f"field {name!r} is {value}: it must be epoch milliseconds, at most "
            f"{MAX_TIMEOUT_S:g} s (+{CLOCK_SKEW_MS} ms of clock skew) from now")
    return value


def _attempt(wire: dict[str, Any]) -> int:
    value: int = _field(wire, F_ATTEMPT, int)
    if not 0 <= value <= MAX_ATTEMPT:
        raise InvalidPayload(f"field 'attempt' is {value}: it must be 0-{MAX_ATTEMPT} "
                             "(send 0)")
    return value


def _trace_id(value: Any) -> str:
    """The caller's correlation id, or "" when it sent none (``null`` included).  A bad
    one is dropped, never held against the request: it plays no part in routing."""
    if isinstance(value, str) and TRACE_ID_RE.fullmatch(value):
        return value
    if value is not None:
        _warn_bad_trace_id()
    return ""


@functools.cache
def _warn_bad_trace_id() -> None:
    log.warning("dropped a bad trace_id (not 1-128 of [A-Za-z0-9._:/-]); its request goes "
                "on without one (logged once per process)")


def _checked_id(request_id: str) -> str:
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidPayload("field 'id' must be 1-128 characters")
    return request_id


def check_request_id(request_id: Any) -> str:
    """A caller's own request id, as a worker will take it: 1-128 characters of text
    that encodes as UTF-8; else ``InvalidPayload`` (before anything is enqueued)."""
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidPayload(f"request_id must be a str of 1-{MAX_REQUEST_ID_CHARS} "
                             f"characters, got {type(request_id).__name__} "
                             f"{repr(request_id)[:40]}")
    try:
        request_id.encode()
    except UnicodeEncodeError as exc:
        raise InvalidPayload("request_id must encode as UTF-8 (it holds a lone "
                             "surrogate)") from exc
    return request_id


def reply_from_wire(wire: Any) -> Reply:
    """Validate a decoded reply envelope."""
    wire = _check_version(wire)
    timings = wire.get(F_TIMINGS) or {}
    reply = Reply(
        id=_field(wire, F_ID, str),
        ok=bool(wire.get(F_OK)),
        payload=wire.get(F_PAYLOAD),
        timings=Timings(
            queue_wait_ms=float(timings.get(F_QUEUE_WAIT_MS, 0.0)),
            batch_size=int(timings.get(F_BATCH_SIZE, 0)),
            forward_ms=float(timings.get(F_FORWARD_MS, 0.0)),
            worker_id=str(timings.get(F_WORKER_ID, "")),
        ),
    )
    if not reply.ok:
        error = wire.get(F_ERROR) or {}
        reply.error_code = str(error.get(F_CODE, "internal"))
        reply.error_message = str(error.get(F_MESSAGE, ""))
    if F_ROW_ERRORS in wire:
        reply.row_errors = _row_errors(wire[F_ROW_ERRORS])
    return reply


def _row_errors(value: Any) -> dict[int, tuple[str, str]]:
    if not isinstance(value, list) or not all(
            isinstance(e, dict) and type(e.get(F_ROW)) is int for e in value):
        raise InvalidPayload("field 'row_errors' must be a list of {row, code, message}")
    return {e[F_ROW]: (str(e.get(F_CODE, "internal")), str(e.get(F_MESSAGE, "")))
            for e in value}

# A GET predict's input in the query string (``?inputs=1,2``): values read at most.
MAX_QUERY_VALUES: Final = 256
