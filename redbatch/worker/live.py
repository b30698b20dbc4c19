"""Live knobs in a worker: the overrides stored in ``config_key`` (read with each
heartbeat) applied to one runner's model between batches (``redbatch.knobs``)."""

from __future__ import annotations

import logging
from typing import Any

from redbatch import knobs
from redbatch.errors import ConfigError
from redbatch.worker.runner import BatchRunner

log = logging.getLogger("redbatch.worker")
MODEL_CHECKED = ("priority_caps", "buckets", "sub_queues")  # checked against the model


class LiveKnobs:
    """Applies the stored overrides of one runner's model when they change; a stored
    override that does not check is logged (once per change) and ignored."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner
        self._seen: dict[Any, Any] | None = None

    def update(self, raw: dict[Any, Any]) -> None:
        """Take the model's ``config_key`` hash as the heartbeat read it."""
        if raw == self._seen:
            return
        self._seen = raw
        model = self._runner.model
        overrides, problems = knobs.decode_stored(raw)
        for problem in problems:
            log.warning("model=%s ignoring the stored knob override %s", model.name, problem)
        for name in [n for n in MODEL_CHECKED if n in overrides]:
            try:  # one that no longer fits this model (stored before a redeploy) alone
                model.check_knob(name, overrides[name])
            except ConfigError as exc:
                log.warning("model=%s ignoring the stored knob override %s=%r: %s",
                            model.name, name, overrides.pop(name), exc)
        try:
            self._apply(knobs.effective(model.knob_defaults, overrides))
        except ConfigError as exc:
            log.warning("model=%s ignoring the stored knob overrides %s: %s", model.name,
                        overrides, exc)

    def _apply(self, values: dict[str, Any]) -> None:
        model = self._runner.model
        before = model.knob_values()
        model.apply_knobs(values)
        for name, value in model.knob_values().items():
            if value != before[name]:
                log.info("model=%s knob %s: %r -> %r (live)", model.name, name,
                         before[name], value)
