"""The plain case of the hot path, answered by one cached look-up.

A request for a model served without versions, of one sub-queue, with a live worker,
and that is no pipeline, needs none of the steps that versions, sub-queues and
pipelines added to a submit (the version pick, the sub-queue choice, the served
check, the pipeline look-up, the name check): it joins the model's own queue.
``PlainModels.plain`` says so from the model's cached live summary alone and from the
pipeline book's answer, judged again only once either may have changed.  Whatever
is stale or not plain takes the full path, which reads anew: a model that gains
versions or sub-queues, or a pipeline of its name, leaves the plain case as soon as
the full path would have seen it.
"""

from __future__ import annotations

import time

from redbatch import protocol
from redbatch.errors import InvalidPayload
from redbatch.pipelines.book import PipelineBook
from redbatch.producer.admission import Admission
from redbatch.registry import LiveSummary


class PlainModels:
    """Which models a request may send straight to their own queue (no I/O).  A
    verdict "plain" holds, unjudged, until the summary it judged goes stale or the
    pipeline book is due a read or changes its answers (``PipelineBook.changes``):
    before then no read can change it, and the check is one look-up per request."""

    def __init__(self, admission: Admission, pipelines: PipelineBook) -> None:
        self._admission = admission
        self._pipelines = pipelines
        self._until: dict[str, tuple[float, int]] = {}  # model -> (until, book changes)

    def plain(self, model: str) -> bool:
        """Whether ``model`` is plain as far as the fresh caches know: False when its
        live summary is stale, or the pipeline book has not answered for it yet."""
        if not isinstance(model, str):
            return False
        held = self._until.get(model)
        if held is not None and held[1] == self._pipelines.changes \
                and time.monotonic() <= held[0]:
            return True
        return self._judge(model)

    def _judge(self, model: str) -> bool:
        """``plain`` from the caches themselves; a verdict "plain" is kept until it
        may change."""
        summary = self._admission.summary_cached(model)
        if summary is None or not is_plain(model, summary):
            return False
        book = self._pipelines
        if not book.settled(model) or book.known(model) is not None:
            return False
        until = min(self._admission.fresh_until(summary), book.quiet_until())
        self._until[model] = (until, book.changes)
        return True


def is_plain(model: str, summary: LiveSummary) -> bool:
    """Whether ``summary`` shows ``model`` (a valid name, not a version's served name)
    served without versions, in one sub-queue, by a live worker."""
    if summary.sub_queues != 1 or summary.versions or not summary.live \
            or protocol.VERSION_SEP in model:
        return False
    try:
        protocol.check_model_name(model)
    except InvalidPayload:
        return False
    return True
