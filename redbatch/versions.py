"""Model versions and canaries: the routing table of a model served in several
versions (``protocol.versions_key``), how a request picks its version, and the
operators' changes (weights, the pinned latest, draining).  Imports neither the
worker nor a web framework.

Each version is served as its own model, ``<model>@<version>`` (``protocol.served_name``),
with its own queue, workers and metrics.  A request that names no version goes to
one by weight: among the versions with a weight above 0 that are not draining, in
proportion to it; when none has one, to ``latest`` (``Table.latest``: the pinned one,
else the highest version that is not a canary).  A version registered while the
model is served already is a canary (weight 0, ``lua.REGISTER_VERSION``): pinned
requests only until promoted.  Live workers of the model served without versions
count as version "1" (``Version.base``).  A request that pins a version goes to it,
unless it is unknown (``UnknownModel``, 404) or draining (``NoLiveWorkers``, 503).
Producers read the table with the model's live summary (``registry.LiveCache``, at
most once a second per model): never once per request."""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson

from redbatch import lua, protocol
from redbatch.errors import InvalidKnob, NoLiveWorkers, RedisUnavailable, UnknownModel

if TYPE_CHECKING:
    import redis.asyncio as aioredis

UNVERSIONED = "1"  # the one version of a model served without versions (v2's "1")
MAX_WEIGHT = 1e9  # a version's weight: 0..this
RNG = random.Random()  # the weighted pick's; tests seed it


@dataclass(frozen=True)
class Version:
    """One version's row of the table: its weight (None: never set; 0: no share of
    the requests that pin no version), whether it is draining (no new traffic; its
    workers stop once its queue is empty), and whether it is the model's unversioned
    workers (``base``: version "1" of a model with live workers served without
    versions, reached under the model's own name)."""

    weight: float | None = None
    draining: bool = False
    base: bool = False
    # a base row's mark by a real version "1" that waits to take it over: 0 while they
    # are live, else when it first saw none live (``lua.REGISTER_VERSION``)
    heir: int | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"weight": self.weight, "draining": self.draining}
        if self.heir is not None:  # (a base row, whoever it routes to now)
            return {**row, "base": True, "heir": self.heir}
        return {**row, "base": True} if self.base else row


@dataclass(frozen=True)
class Table:
    """A model's versions (version -> ``Version``) and its pinned latest, if any."""

    versions: dict[str, Version] = field(default_factory=dict)
    pinned_latest: str | None = None

    def __bool__(self) -> bool:
        return bool(self.versions)

    @property
    def latest(self) -> str | None:
        """The pinned latest unless it is draining, else the highest version not
        draining whose weight is not 0 (a version registered while another served
        has weight 0 until promoted: ``NEW_ROW``), else the highest not draining
        (numeric order when every version is a number), else None."""
        return self.latest_of(frozenset())

    def latest_of(self, dead: Collection[str]) -> str | None:
        """``latest`` among the versions not in ``dead`` (those known to have no live
        worker)."""
        pinned = self.versions.get(self.pinned_latest or "")
        if pinned is not None and not pinned.draining and self.pinned_latest not in dead:
            return self.pinned_latest
        open_ = [v for v, row in self.versions.items() if not row.draining and v not in dead]
        promoted = [v for v in open_ if self.versions[v].weight != 0.0] or open_
        return max(promoted, key=_order_key(promoted)) if promoted else None

    def weights(self, dead: Collection[str] = frozenset()) -> dict[str, float]:
        """The versions that take unpinned traffic and their weights: those with a
        weight above 0 that are not draining (nor in ``dead``: known to have no live
        worker); else latest alone."""
        weighted = {v: row.weight for v, row in self.versions.items()
                    if row.weight and not row.draining and v not in dead}
        if weighted:
            return weighted
        latest = self.latest_of(dead)
        return {latest: 1.0} if latest is not None else {}

    def pick(self, model: str, rng: random.Random = RNG,
             dead: Collection[str] = frozenset()) -> str:
        """A version for a request that pins none, by weight (``dead``: left out)."""
        chosen = self.choose(rng, dead)
        if chosen is None:
            raise NoLiveWorkers(f"no version of model {model!r} is open with a live "
                                "worker; retry shortly")
        return chosen

    def choose(self, rng: random.Random = RNG, dead: Collection[str] = frozenset()
               ) -> str | None:
        """``pick``'s version, or None when there is none to pick."""
        weights = self.weights(dead)
        if len(weights) <= 1:
            return next(iter(weights), None)
        versions = list(weights)
        return rng.choices(versions, weights=[weights[v] for v in versions])[0]

    def route(self, model: str, version: str | None, rng: random.Random = RNG) -> str:
        """The served name of ``model`` for a request that pins ``version`` (None:
        by weight); ``UnknownModel`` for a version the table lacks, ``BadRequest`` for
        one pinned on a served name (``protocol.check_pin``)."""
        protocol.check_pin(model, version)
        if not self.versions:  # a model without versions answers as version "1"
            if version not in (None, UNVERSIONED):
                raise UnknownModel(f"model {model!r} has no version {version!r}: it is "
                                   f"served without versions (as version {UNVERSIONED!r})")
            return model
        if version is None:
            version = self.pick(model, rng)
        elif version not in self.versions:
            raise UnknownModel(f"model {model!r} has no version {version!r}; its versions: "
                               f"{', '.join(self.ordered())}")
        elif self.versions[version].draining:
            raise NoLiveWorkers(f"version {version!r} of model {model!r} is draining; "
                                f"send to another version ({', '.join(self.ordered())})")
        return self.served(model, version)

    def served(self, model: str, version: str) -> str:
        """The served name of a version in the table: ``<model>@<version>``, or the
        model's own name for its unversioned workers (``Version.base``)."""
        row = self.versions.get(version)
        return model if row is not None and row.base else protocol.served_name(model, version)

    def ordered(self) -> list[str]:
        """The versions, lowest first (numeric order when all are numbers)."""
        return sorted(self.versions, key=_order_key(list(self.versions)))

    def to_json(self) -> dict[str, Any]:
        return {"latest": self.latest, "pinned_latest": self.pinned_latest,
                "versions": {v: self.versions[v].to_json() for v in self.ordered()}}


EMPTY = Table()


def _order_key(versions: list[str]) -> Any:
    if all(v.isdigit() for v in versions):
        return int
    return str


def decode(raw: Mapping[Any, Any] | list[Any] | None, base_live: bool = False) -> Table:
    """The table from a ``versions_key`` hash (a mapping, or ``HGETALL``'s flat list
    as a script returns it); unreadable rows count as a version without a weight.
    ``base_live``: the model has live workers served without versions, which count as
    version "1" (``Version.base``) unless a worker registered a version "1"; without
    them, a stored base row is version "1"'s while it waits to take it over
    (``Version.heir``), else left out."""
    if not raw:
        return EMPTY
    table = _decoded(raw)
    rows = {v: _routed(row, base_live) for v, row in table.versions.items()
            if base_live or not row.base or row.heir is not None}
    if base_live and UNVERSIONED not in rows:
        rows[UNVERSIONED] = Version(base=True)
    return Table(rows, table.pinned_latest)


def _routed(row: Version, base_live: bool) -> Version:
    """A row as routed: a base row without live workers is its heir's, version "1"
    served as its own (``<model>@1``) with the row's weight, until it takes the row
    over (``lua.REGISTER_VERSION``): never absent meanwhile."""
    return row if base_live or not row.base else replace(row, base=False)


def _decoded(raw: Mapping[Any, Any] | list[Any]) -> Table:
    pairs = raw.items() if isinstance(raw, Mapping) else zip(raw[::2], raw[1::2], strict=True)
    rows: dict[str, Version] = {}
    latest: str | None = None
    for key, value in pairs:
        name = _text(key)
        if name == protocol.LATEST_FIELD:
            latest = _loads(value) if isinstance(_loads(value), str) else None
        elif protocol.VERSION_RE.fullmatch(name):
            rows[name] = _row(_loads(value))
    return Table(rows, latest)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _loads(value: Any) -> Any:
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return None


def _row(data: Any) -> Version:
    if not isinstance(data, dict):
        return Version()
    weight = data.get("weight")
    ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and \
        0 <= weight <= MAX_WEIGHT  # (as ``check_weight``: an edit by hand past it is none)
    heir = data.get("heir")
    return Version(float(weight) if ok and weight is not None else None,
                   data.get("draining") is True, data.get("base") is True,
                   int(heir) if isinstance(heir, (int, float)) and not
                   isinstance(heir, bool) and data.get("base") is True else None)


# --- the operators' changes ---------------------------------------------------------
def check_weight(version: str, weight: Any) -> float:
    """A weight as stored: a number >= 0 (``InvalidKnob`` otherwise)."""
    ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not ok or not 0 <= weight <= MAX_WEIGHT:
        raise InvalidKnob(f"the weight of version {version!r} must be a number "
                          f"0..{MAX_WEIGHT:g}, got {weight!r}")
    return float(weight) + 0.0  # never -0.0


async def load(redis: aioredis.Redis, model: str) -> Table:
    """The model's table as stored, with its unversioned workers if live (one round
    trip)."""
    protocol.check_model_name(model)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(protocol.versions_key(model))
        _base_live(pipe, model)
        raw, live = await pipe.execute()
    return decode(raw, int(live) > 0)


def _base_live(redis: Any, model: str) -> Any:
    """The live workers of ``model`` served without versions (a pipeline's command)."""
    return redis.zcount(protocol.workers_key(model), protocol.now_ms(), "+inf")


async def change(redis: aioredis.Redis, model: str, *,
                 weights: Mapping[str, Any] | None = None, latest: str | None = None,
                 drain: str | None = None, undrain: str | None = None) -> Table:
    """Set weights (version -> weight; the versions named only), the pinned latest
    (``""`` unpins it), drain a version (weight 0, draining; a pinned latest drained is
    unpinned) or take it back; checked against the stored table (a version must exist:
    its workers registered it; a draining one cannot be pinned), then stored only if
    the table was not changed meanwhile (``lua.CHANGE_VERSIONS``; retried, so that
    concurrent changes never lose each other's writes).  Returns the new table."""
    check_base(model)
    key = protocol.versions_key(model)
    script = redis.register_script(lua.CHANGE_VERSIONS)
    for _ in range(CHANGE_TRIES):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            _base_live(pipe, model)
            raw, live = await pipe.execute()
        new = edited(decode(raw, int(live) > 0), model, weights or {}, latest, drain,
                     undrain)
        if int(await script(keys=[key], args=_change_args(raw, new))):
            return new
    raise RedisUnavailable(f"the versions of model {model!r} kept changing; try again")


def _change_args(raw: Mapping[bytes, bytes], table: Table) -> list[Any]:
    """``CHANGE_VERSIONS``'s arguments: the hash as read, then ``table`` to store."""
    seen = [item for pair in raw.items() for item in pair]
    rows = [item for v, row in table.versions.items()
            for item in (v, orjson.dumps(row.to_json()))]
    latest = b"" if table.pinned_latest is None else orjson.dumps(table.pinned_latest)
    return [len(raw), *seen, latest, *rows]


CHANGE_TRIES = 20  # a change retried this often when others change the table meanwhile


def edited(table: Table, model: str, weights: Mapping[str, Any], latest: str | None,
           drain: str | None, undrain: str | None) -> Table:
    """``table`` with a change applied (``change``'s arguments), every version named
    checked first (``UnknownModel``), then every weight (``InvalidKnob``)."""
    for version in (*weights, drain, undrain, latest or None):
        if version is not None:
            _known(table, model, version)
    rows = dict(table.versions)
    for version, weight in weights.items():
        rows[version] = replace(rows[version], weight=check_weight(version, weight))
    if undrain is not None:
        rows[undrain] = replace(rows[undrain], draining=False)
    if drain is not None:
        rows[drain] = replace(rows[drain], weight=0.0, draining=True)
    pinned = table.pinned_latest if latest is None else (latest or None)
    return Table(rows, _pinned(rows, pinned, model, latest))


def _pinned(rows: dict[str, Version], pinned: str | None, model: str, latest: str | None
            ) -> str | None:
    """The pinned latest after a change: None once its row is gone (a base row whose
    workers left, an edit by hand) or it drains (latest is the highest again);
    ``InvalidKnob`` for a change that pins a draining version."""
    row = rows.get(pinned or "")
    if row is None or not row.draining:
        return pinned if row is not None else None
    if latest:
        raise InvalidKnob(f"version {pinned!r} of model {model!r} is draining: it "
                          "cannot be latest (undrain it first)")
    return None


def check_base(model: str) -> None:
    """``UnknownModel`` for a version's served name (``m@v`` has no versions of its
    own: its model's table is ``m``'s), and for a name that is none."""
    protocol.check_model_name(model)
    base, version = protocol.split_name(model)
    if version is not None:
        raise UnknownModel(f"{model!r} is version {version!r} of model {base!r}, which "
                           "holds the table of its versions")


def _known(table: Table, model: str, version: str) -> str:
    if version not in table.versions:
        raise UnknownModel(f"model {model!r} has no version {version!r}"
                           + (f"; its versions: {', '.join(table.ordered())}" if table
                              else ": no worker registered a version of it"))
    return version


CHANGE_FIELDS = ("weights", "latest", "drain", "undrain")


def change_args(data: Any) -> dict[str, Any]:
    """A change's keywords for ``change`` from a JSON object (``PATCH``'s body):
    ``weights`` (version -> weight), ``latest``, ``drain``, ``undrain`` (versions);
    ``InvalidKnob`` naming what is wrong."""
    if not isinstance(data, dict) or not set(data) <= set(CHANGE_FIELDS):
        raise InvalidKnob(f"a versions change is an object of {', '.join(CHANGE_FIELDS)}")
    weights = data.get("weights", {})
    if not isinstance(weights, dict):
        raise InvalidKnob("weights must be an object of version -> weight")
    for key in ("latest", "drain", "undrain"):
        if not isinstance(data.get(key, ""), str):
            raise InvalidKnob(f"{key} must be a version (a string)")
    return {"weights": weights, **{k: data[k] for k in ("latest", "drain", "undrain")
                                   if k in data}}


async def describe(redis: aioredis.Redis, model: str, table: Table | None = None
                   ) -> dict[str, Any]:
    """The table as ``GET /v1/models/{model}/versions`` and ``redbatch versions`` show
    it: each version with its served name, weight, share of unpinned traffic, whether
    it is latest or draining, and its live workers."""
    check_base(model)
    table = await load(redis, model) if table is None else table
    if not table:
        return await _unversioned(redis, model)
    weights, latest = table.weights(), table.latest
    total = sum(weights.values()) or 1.0
    now = protocol.now_ms()
    async with redis.pipeline(transaction=False) as pipe:
        for version in table.ordered():
            pipe.zcount(protocol.workers_key(table.served(model, version)), now, "+inf")
        live = await pipe.execute()
    return {"model": model, "latest": latest, "pinned_latest": table.pinned_latest,
            "versions": [{"version": v, "name": table.served(model, v),
                          **table.versions[v].to_json(),
                          "share": round(weights.get(v, 0.0) / total, 6),
                          "latest": v == latest, "live_workers": int(n)}
                         for v, n in zip(table.ordered(), live, strict=True)]}


async def _unversioned(redis: aioredis.Redis, model: str) -> dict[str, Any]:
    """A model served without versions: its one row (version "1"), as ``/v1/models``
    lists it; ``UnknownModel`` for a name that nothing serves (no metadata)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(protocol.meta_key(model))
        pipe.zcount(protocol.workers_key(model), protocol.now_ms(), "+inf")
        meta, live = await pipe.execute(raise_on_error=False)
    if not meta or not _readable_meta(meta) or isinstance(live, Exception):
        raise UnknownModel(f"unknown model {model!r}: no version and no worker serves it"
                           + ("" if not meta else " (its keys in Redis cannot be read)"))
    row = unversioned_row(model, int(live), 0)
    del row["queue_depth"]  # (as the rows of a table of versions)
    return {"model": model, "latest": UNVERSIONED, "pinned_latest": None, "versions": [row]}


def _readable_meta(meta: Any) -> bool:
    """Whether a model's metadata (a GET's answer) is a JSON object: one that is not
    (another type of key, not JSON) leaves the model unknown, as the models' listing
    leaves it out."""
    if isinstance(meta, Exception):
        return False
    try:
        return isinstance(orjson.loads(meta), dict)
    except orjson.JSONDecodeError:
        return False


def unversioned_row(model: str, live_workers: int, queue_depth: int) -> dict[str, Any]:
    """The one row of a model served without versions, as ``describe`` lists a version."""
    return {"version": UNVERSIONED, "name": model, **Version().to_json(), "share": 1.0,
            "latest": True, "live_workers": live_workers, "queue_depth": queue_depth}
