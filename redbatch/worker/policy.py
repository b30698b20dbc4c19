"""Batching policy: how many requests make a batch, and how long to wait for them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redbatch import defaults
from redbatch.errors import ConfigError
from redbatch.knobs import check

_ALIASES = {"timeout_s": "batch_wait_timeout_s"}
_KNOWN = {"max_batch_size", "batch_wait_timeout_s", "stride_s", "allow_small_batch",
          "adaptive", "quiet_s", "max_batch_cost", "max_concurrent_batches", "auto_batch",
          "hold_buckets", "pad_to_longest"}
MAX_CONCURRENT_BATCHES_LIMIT = 64


@dataclass(frozen=True)
class BatchPolicy:
    """``@serve.batch``-style knobs.

    * ``max_batch_size``: most requests in one forward pass.
    * ``batch_wait_timeout_s``: the batch window.  With ``allow_small_batch`` (the
      default, Ray Serve's rule) the window opens when the *oldest* claimed request
      was enqueued, so a request that already waited in the queue is not held back
      further.  0 means opportunistic: take what is queued now and go.
    * Deadlines close a window early: a batch runs at the latest when its most urgent
      request's deadline, less 1.5 measured pass times and a 50 ms margin, comes (the
      margin alone before passes were measured).  A window that ends within the
      margin anyway does not read the deadlines.
    * ``allow_small_batch=False``: a batch runs only when it is full, or when its most
      urgent request's deadline forces it (the rule above); ``batch_wait_timeout_s``
      does not send a small batch then.  It counts (from the claim) only for a batch
      none of whose entries has a readable deadline (malformed entries, answered or
      dead-lettered by the decode step).  A worker that is stopping closes its window
      (within ``block_timeout_s``) and runs what it holds.
    * ``stride_s``: least time between two batch pops of one worker (0 = continuous).
    * ``adaptive`` (with ``allow_small_batch``): a lone request does not sit out the
      window while recent windows brought no other request (a sequential caller, light
      load); one lone batch in ``PROBE_EVERY`` still waits, to notice load returning.
      A claim that finds two or more requests queued always waits.  And the window
      closes early once no request has arrived for a quiet gap (``quiet_s``, default a
      quarter of the window): nobody else is on the way, so the batch goes now.
    * ``max_batch_cost``: most total cost in one forward pass (None: no cost).  An
      item's cost is the model's ``batch_size_fn`` of it, else, for a variable-length
      model, its padded length (a pass costs bucket length x items), else 1.
    * ``max_concurrent_batches`` (1..64, Ray's name): batches a worker keeps between
      claim and publish at once; above 1 an async model's calls overlap, a sync model's
      pass overlaps the others' claims and replies.  Read when the worker starts (not
      a live knob).
    * ``auto_batch``: cut each length bucket's passes at the size measured to give the
      most items/s (``worker/autosize.py``); ``max_batch_size`` is then a cap, not a
      target.  Off: passes of up to ``max_batch_size``.
    * ``hold_buckets`` (with ``auto_batch``, a variable-length model): a busy worker
      may hold an under-filled length bucket's items over to its next batch
      (``worker/hold.py``).  Off: every claimed item runs in its own batch.
    * ``pad_to_longest`` (a variable-length model): each pass is padded to the length
      of its longest item instead of its bucket's boundary, and a bucket's items are
      sorted by length before they are cut into passes, so that each pass pads as
      little as it can.  The buckets still decide which items may share a pass (and
      key ``auto_batch``'s curves).  Off: every pass of a bucket has the bucket's
      length, the shape a compiled or graph-captured model needs.
    """

    max_batch_size: int = defaults.MAX_BATCH_SIZE
    batch_wait_timeout_s: float = defaults.BATCH_WAIT_TIMEOUT_S
    stride_s: float = defaults.STRIDE_S
    allow_small_batch: bool = defaults.ALLOW_SMALL_BATCH
    adaptive: bool = defaults.ADAPTIVE
    quiet_s: float | None = defaults.QUIET_S
    max_batch_cost: float | None = defaults.MAX_BATCH_COST
    max_concurrent_batches: int = defaults.MAX_CONCURRENT_BATCHES
    auto_batch: bool = defaults.AUTO_BATCH
    hold_buckets: bool = defaults.HOLD_BUCKETS
    pad_to_longest: bool = defaults.PAD_TO_LONGEST

    def __post_init__(self) -> None:
        for name, value in self.to_json().items():
            check(name, value)  # the live knobs' types and ranges (redbatch.knobs)
        concurrent = self.max_concurrent_batches
        if isinstance(concurrent, bool) or not isinstance(concurrent, int) or not (
                1 <= concurrent <= MAX_CONCURRENT_BATCHES_LIMIT):
            raise ConfigError(f"max_concurrent_batches must be an integer 1.."
                              f"{MAX_CONCURRENT_BATCHES_LIMIT}, got {concurrent!r}")

    @classmethod
    def from_mapping(cls, knobs: Mapping[str, Any]) -> BatchPolicy:
        """Accept Ray's names and the ``{max_batch_size, timeout_s, stride_s,
        allow_small_batch}`` config spelling; unknown keys are an error."""
        values: dict[str, Any] = {}
        for key, value in knobs.items():
            name = _ALIASES.get(key, key)
            if name not in _KNOWN:
                raise ConfigError(f"unknown batching option {key!r}; known: "
                                  f"{sorted(_KNOWN | set(_ALIASES))}")
            values[name] = value
        return cls(**values)

    def quiet_ms(self) -> int | None:
        """The quiet gap that closes a window early: ``quiet_s``, or a quarter of the
        window when adaptive; ``None`` (wait the whole window) otherwise."""
        if not self.allow_small_batch:
            return None
        if self.quiet_s is not None:
            return max(1, round(self.quiet_s * 1000))
        return max(1, round(self.batch_wait_timeout_s * 250)) if self.adaptive else None

    def window_end_ms(self, oldest_enqueue_ms: int, claimed_ms: int,
                      urgent_ms: int | None = None) -> int:
        """Epoch ms at which the batch must run even if it is not full.  ``urgent_ms``:
        when its most urgent request must start (its deadline less the pass time and
        margins), None if no entry's deadline can be read."""
        wait_ms = round(self.batch_wait_timeout_s * 1000)
        if not self.allow_small_batch:
            return claimed_ms + wait_ms if urgent_ms is None else urgent_ms
        end_ms = oldest_enqueue_ms + wait_ms
        return end_ms if urgent_ms is None else min(end_ms, urgent_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "batch_wait_timeout_s": self.batch_wait_timeout_s,
            "stride_s": self.stride_s,
            "allow_small_batch": self.allow_small_batch,
            "adaptive": self.adaptive,
            "quiet_s": self.quiet_s,
            "max_batch_cost": self.max_batch_cost,
            "auto_batch": self.auto_batch,
            "hold_buckets": self.hold_buckets,
            "pad_to_longest": self.pad_to_longest,
        }
