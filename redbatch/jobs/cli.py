"""``redbatch jobs submit | status``: bulk inference jobs on RQ (see ``docs/jobs.md``).

``register(subparsers)`` adds the ``jobs`` command to a parser; ``main(args)`` runs it.

    redbatch jobs submit MODEL SOURCE [--output PATH] [--queue NAME] [--wait]
    redbatch jobs status JOB_ID [--watch] [--json]

``submit`` prints the job id on stdout; ``--wait`` / ``--watch`` draw a progress bar
(from the job's ``meta``) on stderr until the job ends, then print a summary line.
Exit status: 0 (submitted, finished, or still running), 1 (the job failed, was stopped
or canceled), 2 (an error: Redis unreachable, unknown job, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import redis
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from redbatch import defaults
from redbatch.config import count_flag, positive_flag, seconds_flag
from redbatch.errors import ConfigError, RedbatchError
from redbatch.jobs.submit import TERMINAL, job_status, submit_bulk
from redbatch.jobs.tasks import BulkOptions
from redbatch.jobs.urls import JOBS_URL_ENV, queues_url, rq_settings
from redbatch.redis_conn import sync_client

DONE_STATES = frozenset(status.value for status in TERMINAL)


JOBS_HELP = """Bulk inference jobs on RQ: a job feeds its items through the model's workers,
behind interactive traffic (docs/jobs.md).

    redbatch jobs submit MODEL SOURCE [--output PATH] [--queue NAME] [--wait]
    redbatch jobs status JOB_ID [--watch] [--json]

submit prints the job id on stdout; --wait / --watch draw a progress bar on stderr
until the job ends, then print a summary line. Exit status: 0 (submitted, finished,
or still running), 1 (the job failed, was stopped or canceled), 2 (an error: Redis
unreachable, unknown job, bad arguments)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
             ) -> argparse.ArgumentParser:
    """Add ``jobs submit`` and ``jobs status`` to ``subparsers``; return the ``jobs`` parser."""
    jobs = subparsers.add_parser("jobs", help="bulk inference jobs on RQ (submit, status)",
                                 description=JOBS_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = jobs.add_subparsers(dest="jobs_command", required=True)
    submit = sub.add_parser("submit", help="enqueue a bulk job on the RQ queue")
    submit.add_argument("model", help="model name")
    submit.add_argument("source", help="a .npy or .jsonl path or http(s) URL, or a JSON "
                        "array of inputs ('[1, 2, 3]')")
    submit.add_argument("--output", help="write the outputs to this .npy or .jsonl path "
                        "(default: keep them in the job's result)")
    submit.add_argument("--queue", default=defaults.BULK_QUEUE,
                        help=f"RQ queue ({defaults.BULK_QUEUE})")
    submit.add_argument("--wait", action="store_true", help="follow the job to its end")
    _add_pacing(submit)
    status = sub.add_parser("status", help="a job's status and progress")
    status.add_argument("job_id")
    status.add_argument("--watch", action="store_true", help="follow the job to its end")
    status.add_argument("--json", action="store_true", help="print the whole status as JSON")
    for parser in (submit, status):
        parser.add_argument("--redis-url", help=f"Redis of the RQ queue (default: "
                            f"${JOBS_URL_ENV}, else $REDIS_URL): a plain Redis")
        parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (INFO)")
        parser.add_argument("--poll-s", type=seconds_flag, default=defaults.JOB_POLL_S,
                            help=f"how often --wait/--watch read the job ({defaults.JOB_POLL_S})")
    return jobs


def _add_pacing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-size", type=int,
                        help=f"items per round trip ({defaults.JOB_CHUNK_SIZE})")
    parser.add_argument("--low-water", type=int, help="push a chunk only while the model "
                        "queue holds at most this many requests (2 x chunk size)")
    parser.add_argument("--max-wait-s", type=float, help="longest wait for the queue to "
                        f"drain before one chunk ({defaults.JOB_MAX_WAIT_S:g})")
    parser.add_argument("--timeout-s", type=float,
                        help=f"deadline of each item ({defaults.JOB_ITEM_TIMEOUT_S:g})")
    parser.add_argument("--priority", type=int, help="the items' priority level, for a model "
                        "of several (1 most urgent; default: the model's default level)")
    parser.add_argument("--wait-workers-s", type=float, help="fail when the model has no "
                        f"live worker for this long ({defaults.JOB_WAIT_WORKERS_S:g})")
    parser.add_argument("--retries", type=count_flag, default=defaults.JOB_RETRIES,
                        help=f"RQ retries of a failed job ({defaults.JOB_RETRIES})")
    parser.add_argument("--result-ttl", type=positive_flag, default=defaults.JOB_RESULT_TTL_S,
                        help=f"seconds RQ keeps the result ({defaults.JOB_RESULT_TTL_S})")
    parser.add_argument("--job-timeout", type=positive_flag, default=defaults.JOB_TIMEOUT_S,
                        help=f"seconds before RQ kills the job ({defaults.JOB_TIMEOUT_S})")
    parser.add_argument("--bulk-redis-url", help="Redis of redbatch's queues, when not the "
                        f"RQ Redis (default: $REDIS_URL when ${JOBS_URL_ENV} is set)")


def main(args: argparse.Namespace) -> int:
    """Run ``redbatch jobs ...``; return the exit status."""
    try:
        conn = sync_client(rq_settings(args.redis_url))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.jobs_command == "submit":
            return _submit(args, conn)
        return _status(args, conn)
    except (RedbatchError, redis.RedisError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        conn.close()


def _options(args: argparse.Namespace) -> BulkOptions:
    names = ("chunk_size", "low_water", "max_wait_s", "timeout_s", "wait_workers_s",
             "priority")
    return BulkOptions(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})


def _source(text: str) -> Any:
    """A JSON array given on the command line, else a path or URL."""
    return json.loads(text) if text.lstrip().startswith("[") else text


def _submit(args: argparse.Namespace, conn: redis.Redis) -> int:
    job = submit_bulk(conn, args.model, _source(args.source), queue=args.queue,
                      output=args.output, result_ttl=args.result_ttl, retry=args.retries,
                      job_timeout=args.job_timeout, options=_options(args),
                      redis_url=queues_url(args.bulk_redis_url, args.redis_url))
    print(job.id, flush=True)
    if not args.wait:
        return 0
    return _report(follow(conn, job.id, args.poll_s), as_json=False)


def _status(args: argparse.Namespace, conn: redis.Redis) -> int:
    info = follow(conn, args.job_id, args.poll_s) if args.watch else job_status(conn,
                                                                               args.job_id)
    return _report(info, as_json=args.json)


def follow(conn: redis.Redis, job_id: str, poll_s: float = defaults.JOB_POLL_S,
           console: Console | None = None) -> dict[str, Any]:
    """Draw a progress bar from the job's meta until the job ends; return its status."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(stderr=True)) as bar:
        task = bar.add_task("queued", total=None, detail="")
        while True:
            info = job_status(conn, job_id)
            bar.update(task, description=info["status"], total=info["total"],
                       completed=info["done"] or 0,
                       detail=f"{info['items_per_s'] or 0} items/s, "
                              f"{info['failed'] or 0} failed")
            if info["status"] in DONE_STATES:
                return info
            time.sleep(poll_s)


def _report(info: dict[str, Any], *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(summary_line(info))
        for error in info.get("errors") or []:
            print(f"  {error}")
    return 0 if info["status"] not in DONE_STATES or info["status"] == "finished" else 1


def summary_line(info: dict[str, Any]) -> str:
    line = (f"job {info['id']} {info['status']}: {info['done'] or 0}/"
            f"{info['total'] if info['total'] is not None else '?'} done, "
            f"{info['failed'] or 0} failed, {info['items_per_s'] or 0} items/s")
    if info.get("output"):
        line += f", outputs in {info['output']}"
    if info.get("error"):
        line += f"; error: {info['error']}"
    return line
