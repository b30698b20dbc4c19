"""A bulk job's progress: counters published into the RQ job's ``meta`` after each chunk.

``job.meta`` keys: ``model``, ``total``, ``done`` (items answered, failed ones included),
``failed``, ``errors`` (the first few, ``"item 17: invalid_payload: ..."``),
``items_per_s``, ``throttled_s`` (time spent waiting for the queue to drain),
``elapsed_s`` and ``updated_at`` (epoch seconds).
"""

from __future__ import annotations

import time
from typing import Any

from rq.job import Job

from redbatch.jobs.errors import ItemError

META_KEYS = ("model", "total", "done", "failed", "errors", "items_per_s", "throttled_s",
             "elapsed_s", "updated_at")


class Progress:
    def __init__(self, job: Job | None, model: str, total: int, max_errors: int) -> None:
        self.job = job
        self.model = model
        self.total = total
        self.max_errors = max_errors
        self.done = 0
        self.failed = 0
        self.errors: list[str] = []
        self.throttled_s = 0.0
        self._started = time.monotonic()

    def record(self, first_index: int, results: list[Any]) -> None:
        """Count one chunk's results (``ItemError`` for a failed item)."""
        self.done += len(results)
        for offset, result in enumerate(results):
            if isinstance(result, ItemError):
                self.failed += 1
                if len(self.errors) < self.max_errors:
                    self.errors.append(f"item {first_index + offset}: {result.code}: "
                                       f"{result.message}")

    def as_meta(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._started
        return {"model": self.model, "total": self.total, "done": self.done,
                "failed": self.failed, "errors": list(self.errors),
                "items_per_s": round(self.done / elapsed, 1) if elapsed > 0 else 0.0,
                "throttled_s": round(self.throttled_s, 3), "elapsed_s": round(elapsed, 3),
                "updated_at": round(time.time(), 3)}

    def publish(self) -> None:
        """Save the counters into the RQ job's meta (nothing outside an RQ job)."""
        if self.job is not None:
            self.job.meta.update(self.as_meta())
            self.job.save_meta()  # type: ignore[no-untyped-call]  # rq leaves it unannotated
