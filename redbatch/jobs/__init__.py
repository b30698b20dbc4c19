"""Bulk / offline inference as RQ jobs, through the same batching workers as the
real-time traffic (see ``docs/jobs.md``).

* ``submit_bulk(conn, model, source, output=...)`` enqueues ``tasks.run_bulk`` on the
  ``redbatch-bulk`` RQ queue; ``job_status(conn, job_id)`` reads its progress.
* ``rq worker redbatch-bulk --url $REDIS_URL`` runs the jobs.
* ``redbatch jobs submit|status`` is the command line (``redbatch.jobs.cli``).
"""

from redbatch.defaults import BULK_QUEUE
from redbatch.jobs.errors import BadSource, BulkJobFailed, ItemError, UnknownJob
from redbatch.jobs.submit import job_status, submit_bulk
from redbatch.jobs.tasks import BulkOptions, run_bulk

__all__ = [
    "BULK_QUEUE",
    "BadSource",
    "BulkJobFailed",
    "BulkOptions",
    "ItemError",
    "UnknownJob",
    "job_status",
    "run_bulk",
    "submit_bulk",
]
