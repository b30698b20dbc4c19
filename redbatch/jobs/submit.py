"""Enqueue bulk jobs on an RQ queue and read their status.

```python
import redis
from redbatch.jobs import submit_bulk, job_status

conn = redis.Redis.from_url("redis://localhost:6379/0")
job = submit_bulk(conn, "mlp", "/data/inputs.npy", output="/data/outputs.npy")
job_status(conn, job.id)   # {"status": "started", "done": 640, "total": 10000, ...}
```

Run the jobs with the plain RQ worker: ``rq worker redbatch-bulk --url $REDIS_URL``.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from redbatch import defaults, protocol
from redbatch.errors import ConfigError
from redbatch.jobs.errors import UnknownJob
from redbatch.jobs.progress import META_KEYS
from redbatch.jobs.sources import check_output, check_source, describe
from redbatch.jobs.tasks import BulkOptions, run_bulk
from redbatch.jobs.urls import portable

TERMINAL = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED,
                      JobStatus.CANCELED})


def submit_bulk(redis_conn: redis.Redis, model: str, source: Any, *,
                queue: str = defaults.BULK_QUEUE,
                output: str | os.PathLike[str] | None = None,
                result_ttl: int = defaults.JOB_RESULT_TTL_S,
                retry: Retry | int | None = defaults.JOB_RETRIES,
                failure_ttl: int = defaults.JOB_FAILURE_TTL_S,
                job_timeout: int = defaults.JOB_TIMEOUT_S,
                options: BulkOptions | None = None, redis_url: str | None = None,
                job_id: str | None = None) -> Job:
    """Enqueue ``run_bulk(model, source, output)`` on the RQ queue ``queue``.

    ``source``: a list or array (stored in the job: keep it small), or a ``.npy`` /
    ``.jsonl`` path (made absolute; the RQ worker must see the same file) or http(s)
    URL.  ``retry``: an ``rq.Retry``, or a number of immediate retries (0: none); a
    ``Retry`` with intervals needs ``rq worker --with-scheduler``.  ``redis_url``: where
    redbatch's queues are, when not on the RQ job's own Redis (stored in the job's
    arguments without its passwords, which the RQ worker takes from its own
    ``$REDIS_URL``: ``urls.with_password``)."""
    protocol.check_model_name(model)
    if not queue.strip():  # (RQ files it under "rq:queue:", where no worker looks)
        raise ConfigError("the RQ queue name must not be empty")
    source = check_source(source)
    out = check_output(output)
    description = f"redbatch bulk: {model} <- {describe(source)}" + (f" -> {out}" if out else "")
    return Queue(queue, connection=redis_conn).enqueue(
        run_bulk, args=(model, source, out),
        kwargs={"options": options or BulkOptions(), "redis_url": portable(redis_url)},
        job_timeout=job_timeout, result_ttl=result_ttl, failure_ttl=failure_ttl,
        retry=_retry(retry), description=description, job_id=job_id,
        meta={"model": model, "total": None, "done": 0, "failed": 0})


def _retry(retry: Retry | int | None) -> Retry | None:
    if isinstance(retry, int):
        return Retry(max=retry) if retry > 0 else None
    return retry


def job_status(redis_conn: redis.Redis, job_id: str) -> dict[str, Any]:
    """A job's RQ status, its progress (``job.meta``), and its output path or error."""
    try:
        job = Job.fetch(job_id, connection=redis_conn)
    except NoSuchJobError as exc:
        raise UnknownJob(f"no job {job_id!r} (never enqueued, or expired)") from exc
    status = JobStatus(job.get_status(refresh=False))
    info: dict[str, Any] = {
        "id": job.id, "status": status.value, "queue": job.origin,
        "description": job.description, "enqueued_at": _iso(job.enqueued_at),
        "started_at": _iso(job.started_at), "ended_at": _iso(job.ended_at),
        "retries_left": job.retries_left, **{key: job.meta.get(key) for key in META_KEYS}}
    if status == JobStatus.FINISHED:
        result = job.return_value()
        if isinstance(result, dict):
            info["output"] = result.get("output")
    elif status == JobStatus.FAILED:
        info["error"] = _last_error(job)
    return info


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _last_error(job: Job) -> str | None:
    """The last line of the latest failure's traceback (the exception and message)."""
    latest = job.latest_result()
    text = (latest.exc_string or "") if latest is not None else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None
