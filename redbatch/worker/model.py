"""The model contract, modelled on Ray Serve's ``@serve.batch``.

A batch function takes a list of inputs (or, with ``stack=True``, one stacked
array) and returns a list, array or tensor of the same length.  ``@batch``
turns such a function into a ``Model``; ``Model.loader`` builds the function
inside the worker process instead, on the device the worker was given.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redbatch import defaults, knobs, levels, protocol
from redbatch.errors import ConfigError
from redbatch.spec import Signature, TensorSpec, model_meta
from redbatch.worker.policy import BatchPolicy

__all__ = ["BatchFn", "CostFn", "Loader", "Model", "batch"]

BatchFn = Callable[[Any], Any]
Loader = Callable[[str], BatchFn]
CostFn = Callable[[Any], float]
OVERSIZE = ("alone", "refuse")
MAX_PRIORITY_SHARE = 0.5  # a worker keeps at most half its claims for the lower levels


@dataclass
class Model:
    """A named batch function plus how to batch it and what its inputs look like."""

    name: str
    fn: BatchFn | None = None
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    spec: TensorSpec | None = None
    input_name: str = defaults.INPUT_NAME
    output_name: str = defaults.OUTPUT_NAME
    stack: bool = False
    loader: Loader | None = None
    # What one output looks like; only its first dimension matters: ``None`` there means
    # per-token, trimmed back to each request's length after a padded pass (a
    # variable-length ``spec`` with ``stack=True``); otherwise outputs stay whole.
    output_spec: TensorSpec | None = None
    # Where a sync batch function runs: True on the event loop, False in the forward
    # thread, None (auto) on the loop while its last passes all took under
    # ``forward.AUTO_INLINE_MS`` on a CPU worker, else in the thread.  Use False for a
    # function that waits on the worker's event loop.  On the loop it
    # skips the thread handoff and the GIL ping-pong with the loop (measured: +7-16 %
    # items/s for the W2 MLP on 2 cores); the heartbeat waits while it runs.
    inline: bool | None = None
    # Limits the gateways apply to this model's requests (published in its meta): a
    # queue cap (the lower of it and the gateway's max_queue_len), and the deadline of
    # requests that set none (instead of the gateway's default_timeout_s, still capped
    # by its max_timeout_s).  None: the gateway's.
    max_queue_len: int | None = None
    default_timeout_s: float | None = None
    # Sub-queues of a hot model (a live knob): producers spread its requests over
    # ``sub_queues`` queues, each in a hash slot of its own (``docs/scaling.md``).
    sub_queues: int = 1
    # Batches by cost (``policy.max_batch_cost``): an item's cost (Ray's
    # ``batch_size_fn``; None: padded length for a variable-length model, else 1), and
    # what happens to an item costlier than the whole budget: it runs in a pass of its
    # own (``alone``), or is answered ``InvalidPayload`` (``refuse``).  A
    # ``batch_size_fn`` without ``max_batch_cost`` uses ``max_batch_size`` as the
    # budget, as Ray does.
    batch_size_fn: CostFn | None = None
    oversize: str = defaults.OVERSIZE
    # Named inputs and outputs (``Signature``), instead of ``spec``: a request is a map
    # input name -> value, a reply a map output name -> value; ``outputs`` as names,
    # or names -> specs (``None`` first dimension: per-token, trimmed).  With
    # ``stack=True`` the function gets a dict name -> stacked array (variable-length
    # inputs: ``(dict, lengths)``) and returns a dict output name -> batched outputs;
    # else a list of dicts, returning a list of dicts.
    inputs: dict[str, TensorSpec | None] | None = None
    outputs: dict[str, TensorSpec | None] | Sequence[str] | None = None
    # Priority levels 1..priority_levels (1 most urgent; read at start): a request that
    # gives none takes ``default_priority``; ``priority_caps`` (a live knob) caps each
    # level's queue; a worker keeps ``priority_share`` of its claims for the levels
    # below the most urgent one that waits (``docs/models.md``).
    priority_levels: int = defaults.PRIORITY_LEVELS
    default_priority: int = defaults.DEFAULT_PRIORITY
    priority_caps: list[int] | None = None
    priority_share: float = defaults.PRIORITY_SHARE
    # A streaming model (``redbatch.worker.stream_batch``): its batch function is a
    # generator (None: found from ``fn``; a loader that builds one needs True).
    # ``continuous``: requests join and leave its running batch at every step; False:
    # each batch runs until its longest member ends.
    streaming: bool | None = None
    continuous: bool = True
    # The version this model serves (``redbatch.versions``): it is served as
    # ``<name>@<version>`` (``name`` becomes that), beside the model's other versions.
    version: str | None = None
    # The length buckets in effect (a live knob): the variable-length spec's boundaries
    # to start with (None: no variable-length input).
    buckets: list[int] | None = field(init=False, default=None)
    # The model's own values of the live knobs (``redbatch.knobs``), before overrides.
    knob_defaults: dict[str, Any] = field(init=False, repr=False, compare=False)
    signature: Signature | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.name = _versioned(self.name, self.version)
        if (self.fn is None) == (self.loader is None):
            raise ConfigError(f"model {self.name!r} needs exactly one of fn or loader")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ConfigError(f"model {self.name!r}: max_queue_len must be >= 1")
        if self.default_timeout_s is not None and not self.default_timeout_s > 0:
            raise ConfigError(f"model {self.name!r}: default_timeout_s must be > 0")
        if self.oversize not in OVERSIZE:
            raise ConfigError(f"model {self.name!r}: oversize must be one of {OVERSIZE}, "
                              f"got {self.oversize!r}")
        levels.check_levels(self.name, self.priority_levels, self.default_priority)
        if not 0 <= self.priority_share <= MAX_PRIORITY_SHARE:
            raise ConfigError(f"model {self.name!r}: priority_share must be "
                              f"0..{MAX_PRIORITY_SHARE}, got {self.priority_share}")
        knobs.check_caps(knobs.check("priority_caps", self.priority_caps), self.priority_levels)
        knobs.check("sub_queues", self.sub_queues)
        self.signature = self._signature()
        self._check_mask()
        if self.streaming is None:
            self.streaming = self.fn is not None and is_stream_fn(self.fn)
        if self.streaming and self.priority_levels > 1:
            raise ConfigError(f"model {self.name!r}: a streaming model has one priority level")
        knobs.check_sub_queues(self.sub_queues, self.streaming)
        length_spec = self.length_spec
        self.buckets = list(length_spec.boundaries) if length_spec is not None else None
        self.knob_defaults = self.knob_values()

    @property
    def length_spec(self) -> TensorSpec | None:
        """The variable-length spec whose buckets group requests, if any."""
        spec = self.signature.length_spec if self.signature else self.spec
        return spec if spec is not None and spec.variable else None

    @property
    def priorities(self) -> levels.Levels:
        """The model's priority levels, with the per-level caps in effect now."""
        caps = None if self.priority_caps is None else tuple(self.priority_caps)
        return levels.Levels(self.priority_levels, self.default_priority, caps)

    def _signature(self) -> Signature | None:
        """The named inputs and outputs, checked against the other fields."""
        if self.inputs is None and self.outputs is None:
            return None
        if self.inputs is None or self.outputs is None:
            raise ConfigError(f"model {self.name!r}: inputs and outputs go together (a "
                              "model with one input has spec, input_name and output_name)")
        if self.spec is not None or self.output_spec is not None:
            raise ConfigError(f"model {self.name!r}: inputs and spec (or output_spec) are "
                              "mutually exclusive: give each input its spec in inputs, "
                              "each output its spec in outputs")
        return Signature.of(self.inputs, self.outputs)

    def _check_mask(self) -> None:
        """A spec's mask field (callers' padding, cut by the gateway) goes beside the
        model's one input, under a name of its own."""
        if self.spec is not None and self.spec.mask == self.input_name:
            raise ConfigError(f"model {self.name!r}: the spec's mask field cannot be the "
                              f"input field {self.input_name!r} itself")
        masked = [n for n, s in (self.inputs or {}).items() if s is not None and s.mask]
        if masked:
            raise ConfigError(f"model {self.name!r}: input {masked[0]!r} has a mask; a "
                              "mask field goes with a model's one input (a model with "
                              "named inputs takes its mask as an input of its own)")

    def knob_values(self) -> dict[str, Any]:
        """The live knobs' values now: the policy's fields and the model's own."""
        policy = self.policy.to_json()
        return {name: policy[name] if knob.part == "policy" else getattr(self, name)
                for name, knob in knobs.KNOBS.items()}

    def apply_knobs(self, values: dict[str, Any]) -> None:
        """Put live knob values (checked: ``knobs.effective``) into effect; a policy
        that does not hold together raises ``ConfigError`` and changes nothing."""
        split = knobs.parts(values)
        for name, value in split["model"].items():
            self.check_knob(name, value)
        policy = dataclasses.replace(self.policy, **split["policy"])
        self.policy = policy
        for name, value in split["model"].items():
            setattr(self, name, value)

    def check_knob(self, name: str, value: Any) -> None:
        """``ConfigError`` if the knob ``name`` (one checked against the model itself:
        ``priority_caps``, ``buckets``, ``sub_queues``) cannot take ``value`` here."""
        if name == "priority_caps":
            knobs.check_caps(value, self.priority_levels)
        elif name == "buckets":
            knobs.check_buckets(value, self.knob_defaults["buckets"])
        elif name == "sub_queues":
            knobs.check_sub_queues(value, bool(self.streaming))

    @property
    def is_async(self) -> bool:
        return self.fn is not None and inspect.iscoroutinefunction(self.fn)

    def bind(self, device: str) -> BatchFn:
        """The batch function to run on ``device`` (builds it if there is a loader)."""
        if self.loader is not None:
            return self.loader(device)
        assert self.fn is not None
        return self.fn

    def __call__(self, items: Sequence[Any]) -> Any:
        """Call the batch function directly, as ``@serve.batch`` methods can be."""
        return self.bind("cpu")(list(items))

    def _published_defaults(self) -> dict[str, Any]:
        """The knob values a worker publishes: a streaming model's leave out
        ``sub_queues``, so that no producer splits its queue (``LIVE_SUMMARY`` reads a
        stored override only when the meta names the knob)."""
        if not self.streaming:
            return self.knob_defaults
        return {k: v for k, v in self.knob_defaults.items() if k != "sub_queues"}

    def meta(self) -> dict[str, Any]:
        """What gateways need to know: published to ``meta_key(name)`` by workers."""
        meta = model_meta(self.name, input_name=self.input_name,
                          output_name=self.output_name, spec=self.spec,
                          policy=self.policy.to_json(),
                          limits={"max_queue_len": self.max_queue_len,
                                  "default_timeout_s": self.default_timeout_s},
                          defaults=self._published_defaults(), signature=self.signature)
        if self.priority_levels > 1:  # read by producers (LIVE_SUMMARY): levels, caps
            meta["priority"] = self.priorities.to_json()
            meta["limits"]["priority_caps"] = self.priority_caps
        if self.sub_queues > 1:  # read by producers (LIVE_SUMMARY) and foreign clients
            meta["limits"]["sub_queues"] = meta["sub_queues"] = self.sub_queues
        if self.buckets is not None:  # a variable-length model: the buckets in effect
            meta["limits"]["buckets"] = self.buckets
        if self.streaming:
            meta[protocol.F_STREAMING] = True
        if self.output_spec is not None:  # v2 metadata; a per-token one (first dim None)
            meta["output_spec"] = self.output_spec.to_json()  # tells v2 runs to refuse
        return meta


def is_stream_fn(fn: Any) -> bool:
    """Whether ``fn`` is a streaming batch function: a generator, sync or async."""
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    return inspect.isgeneratorfunction(call) or inspect.isasyncgenfunction(call)


def _versioned(name: str, version: str | None) -> str:
    """The name a model is served under: ``name@version`` for a version (a name
    already of that form, as ``dataclasses.replace`` passes it, stays)."""
    protocol.check_model_name(name)
    base, own = protocol.split_name(name)
    if version is None or own == version:
        return name
    if own is not None:
        raise ConfigError(f"model {name!r} is version {own!r}, not {version!r}")
    return protocol.served_name(base, protocol.check_version(version))


def batch(*, name: str | None = None, max_batch_size: int = defaults.MAX_BATCH_SIZE,
          batch_wait_timeout_s: float = defaults.BATCH_WAIT_TIMEOUT_S,
          stride_s: float = defaults.STRIDE_S,
          allow_small_batch: bool = defaults.ALLOW_SMALL_BATCH, spec: TensorSpec | None = None,
          inputs: dict[str, TensorSpec | None] | None = None,
          outputs: dict[str, TensorSpec | None] | Sequence[str] | None = None,
          input_name: str = defaults.INPUT_NAME, output_name: str = defaults.OUTPUT_NAME,
          stack: bool = False, timeout_s: float | None = None,
          output_spec: TensorSpec | None = None,
          max_batch_cost: float | None = defaults.MAX_BATCH_COST,
          batch_size_fn: CostFn | None = None,
          oversize: str = defaults.OVERSIZE,
          max_concurrent_batches: int = defaults.MAX_CONCURRENT_BATCHES,
          auto_batch: bool = defaults.AUTO_BATCH,
          hold_buckets: bool = defaults.HOLD_BUCKETS,
          pad_to_longest: bool = defaults.PAD_TO_LONGEST,
          priority_levels: int = defaults.PRIORITY_LEVELS,
          default_priority: int = defaults.DEFAULT_PRIORITY,
          priority_share: float = defaults.PRIORITY_SHARE,
          priority_caps: list[int] | None = None, continuous: bool = True,
          version: str | None = None, sub_queues: int = 1
          ) -> Callable[[BatchFn], Model]:
    """Decorate a list-in/list-out function as a ``Model`` (Ray's ``@serve.batch``).

    The knobs are Ray's; ``timeout_s`` is accepted as another name for
    ``batch_wait_timeout_s`` (the ``{max_batch_size, timeout_s, stride_s,
    allow_small_batch}`` config spelling; ``BatchPolicy.from_mapping`` takes a dict).
    ``max_batch_cost``, ``batch_size_fn`` and ``oversize``: batches by cost (``Model``);
    ``max_concurrent_batches``: batches in flight per worker; ``auto_batch``: the pass
    size per length bucket by measurement; ``hold_buckets``: with it, an under-filled
    bucket may wait a batch; ``pad_to_longest``: a variable-length pass padded to its
    longest item (all ``BatchPolicy``); ``inputs`` and
    ``outputs``: named inputs and outputs instead of one ``spec``; ``priority_levels``,
    ``default_priority``, ``priority_share``, ``priority_caps``: priority levels;
    ``continuous``: a streaming model's batch lets requests join and leave at every
    step; ``version``: the version it serves; ``sub_queues``: a hot model's queue split
    over that many (all ``Model``)."""
    wait_s = batch_wait_timeout_s if timeout_s is None else timeout_s
    policy = BatchPolicy(max_batch_size, wait_s, stride_s, allow_small_batch,
                         max_batch_cost=max_batch_cost,
                         max_concurrent_batches=max_concurrent_batches,
                         auto_batch=auto_batch, hold_buckets=hold_buckets,
                         pad_to_longest=pad_to_longest)

    def wrap(fn: BatchFn) -> Model:
        return Model(name=name or str(getattr(fn, "__name__", "model")), fn=fn, policy=policy,
                     spec=spec, inputs=inputs, outputs=outputs, input_name=input_name,
                     output_name=output_name, stack=stack,
                     output_spec=output_spec, batch_size_fn=batch_size_fn, oversize=oversize,
                     priority_levels=priority_levels, default_priority=default_priority,
                     priority_share=priority_share, priority_caps=priority_caps,
                     continuous=continuous, version=version, sub_queues=sub_queues)

    return wrap
