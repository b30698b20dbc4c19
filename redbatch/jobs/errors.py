"""Errors of bulk jobs, rooted in ``RedbatchError`` like every other redbatch error."""

from __future__ import annotations

from dataclasses import dataclass

from redbatch.errors import RedbatchError


class BulkJobFailed(RedbatchError):
    """Every item of a bulk job failed: the job as a whole fails (and RQ may retry it)."""

    code = "bulk_job_failed"


class BadSource(RedbatchError):
    """A bulk job's input set or output path cannot be read, written or understood."""

    code = "bad_source"


class UnknownJob(RedbatchError):
    """No RQ job of that id (never enqueued, or its result TTL ran out)."""

    code = "unknown_job"


@dataclass(frozen=True, slots=True)
class ItemError:
    """One item that failed (its output's place in the results): the error code of
    ``docs/protocol.md`` and a message."""

    code: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}
