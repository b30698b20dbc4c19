"""Bulk inference as RQ jobs (``redbatch.jobs``): a real ``rq worker`` process runs the
jobs against the test's Redis; the redbatch worker runs on the test's loop."""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry

from redbatch import Client, TensorSpec, batch, defaults, protocol
from redbatch.jobs import BULK_QUEUE, BulkOptions, job_status, submit_bulk
from redbatch.jobs.cli import main as jobs_main
from redbatch.jobs.cli import register
from redbatch.jobs.errors import BadSource, ItemError
from redbatch.jobs.sinks import write_output
from redbatch.jobs.submit import TERMINAL
from redbatch.jobs.tasks import url_of
from redbatch.jobs.throttle import queue_of
from redbatch.worker.process import Worker
from tests.conftest import ROOT, Proc, free_port, test_env


@batch(name="inc", max_batch_size=16, batch_wait_timeout_s=0.002)
def inc(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


@batch(name="double", max_batch_size=16, batch_wait_timeout_s=0.002,
       spec=TensorSpec("float32", (4,)))
def double(xs: list[np.ndarray]) -> list[np.ndarray]:
    return [x * 2 for x in xs]


@batch(name="paced", max_batch_size=16, batch_wait_timeout_s=0.0)
def paced(xs: list[int]) -> list[int]:
    time.sleep(0.005)  # at most ~3200 items/s: a large job takes a while
    return [x + 1 for x in xs]


@pytest.fixture
def rq_worker(spawn: Callable[..., Proc], redis_url: str) -> Proc:
    """A real, long-running ``rq worker redbatch-bulk`` process (stopped at teardown)."""
    return spawn([sys.executable, "-m", "rq.cli", "worker", BULK_QUEUE, "--url", redis_url],
                 name="rq-worker")


async def wait_job(job: Job, worker: Proc, timeout_s: float = 40.0) -> str:
    """Poll (without blocking the loop that runs the redbatch worker) until the job ends."""
    deadline = time.monotonic() + timeout_s
    status = job.get_status()
    while status not in TERMINAL:
        if time.monotonic() > deadline:
            pytest.fail(f"job still {status} after {timeout_s} s:\n{worker.log()}")
        await asyncio.sleep(0.05)
        status = job.get_status()
    return str(status.value)


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[str]:
    """``tmp_path`` served over HTTP; yields the base URL."""
    handler = functools.partial(QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_inline_list_job_returns_outputs_and_progress(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, rq_worker: Proc) -> None:
    start_worker([inc])
    job = submit_bulk(raw_redis, "inc", list(range(200)), options=BulkOptions(chunk_size=32))
    assert await wait_job(job, rq_worker) == "finished", rq_worker.log()
    result = job.return_value(refresh=True)
    assert result["outputs"] == list(range(1, 201))
    assert result["failed_items"] == []
    meta = job.get_meta()
    assert meta["done"] == meta["total"] == 200
    assert meta["failed"] == 0 and meta["items_per_s"] > 0
    assert 0 < raw_redis.ttl(job.key) <= defaults.JOB_RESULT_TTL_S  # kept for the result TTL
    status = job_status(raw_redis, job.id)
    assert status["status"] == "finished" and status["done"] == 200
    assert status["queue"] == BULK_QUEUE and "inc" in status["description"]


async def test_a_job_at_a_low_priority_paces_on_its_level(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str,
        rq_worker: Proc) -> None:
    levels = batch(name="inc_levels", max_batch_size=16, batch_wait_timeout_s=0.002,
                   priority_levels=3)(lambda xs: [x + 1 for x in xs])
    start_worker([levels])
    job = submit_bulk(raw_redis, "inc_levels", list(range(100)),
                      options=BulkOptions(chunk_size=16, priority=3))
    assert await wait_job(job, rq_worker) == "finished", rq_worker.log()
    assert job.return_value(refresh=True)["outputs"] == list(range(1, 101))
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await queue_of(client, "inc_levels", 3) == protocol.queue_key("inc_levels", 3)
        assert await queue_of(client, "inc_levels", None) == protocol.queue_key("inc_levels")
    finally:
        await client.aclose()


async def test_npy_over_http_with_npy_output(start_worker: Callable[..., Worker],
                                             raw_redis: redis.Redis, rq_worker: Proc,
                                             tmp_path: Path, http_dir: str) -> None:
    start_worker([double])
    rows = np.arange(300 * 4, dtype=np.float32).reshape(300, 4)
    np.save(tmp_path / "in.npy", rows)
    out = tmp_path / "out.npy"
    job = submit_bulk(raw_redis, "double", f"{http_dir}/in.npy", output=out,
                      options=BulkOptions(chunk_size=50))
    assert await wait_job(job, rq_worker) == "finished", rq_worker.log()
    np.testing.assert_array_equal(np.load(out), rows * 2)
    result = job.return_value(refresh=True)
    assert result["output"] == str(out) and "outputs" not in result
    assert job.get_meta()["done"] == 300
    assert not list(tmp_path.glob("*.tmp-*"))  # written atomically


async def test_jsonl_with_a_malformed_line(start_worker: Callable[..., Worker],
                                           raw_redis: redis.Redis, rq_worker: Proc,
                                           tmp_path: Path) -> None:
    start_worker([inc])
    lines = [json.dumps(i) for i in range(50)]
    lines[7] = "{not json"
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n\n")  # a blank line is not an item
    out = tmp_path / "out.jsonl"
    job = submit_bulk(raw_redis, "inc", source, output=out, options=BulkOptions(chunk_size=8))
    assert await wait_job(job, rq_worker) == "finished", rq_worker.log()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 50
    assert rows[7]["error"]["code"] == "invalid_payload"
    assert [r["output"] for i, r in enumerate(rows) if i != 7] == [i + 1 for i in range(50)
                                                                   if i != 7]
    meta = job.get_meta()
    assert (meta["done"], meta["failed"]) == (50, 1)
    assert meta["errors"][0].startswith("item 7: invalid_payload: line 8")


async def test_one_bad_row_fails_alone(start_worker: Callable[..., Worker],
                                       raw_redis: redis.Redis, rq_worker: Proc) -> None:
    start_worker([double])
    rows: list[Any] = [[i, i, i, i] for i in range(40)]
    rows[5] = [1.0, 2.0, 3.0]  # the model's spec wants 4 floats
    job = submit_bulk(raw_redis, "double", rows, options=BulkOptions(chunk_size=16))
    assert await wait_job(job, rq_worker) == "finished", rq_worker.log()
    result = job.return_value(refresh=True)
    assert result["failed_items"] == [5] and result["outputs"][5] is None
    for i, output in enumerate(result["outputs"]):
        if i != 5:
            np.testing.assert_array_equal(output, np.full(4, 2 * i, np.float32))
    assert (result["done"], result["failed"]) == (40, 1)
    assert "item 5: invalid_payload" in result["errors"][0]
    assert job_status(raw_redis, job.id)["failed"] == 1


@pytest.mark.parametrize("case", ["no_worker", "unreachable_redis", "every_item_fails"])
async def test_unservable_job_is_retried_then_failed(case: str,
                                                     start_worker: Callable[..., Worker],
                                                     raw_redis: redis.Redis,
                                                     rq_worker: Proc) -> None:
    model, source, url = "inc", list(range(10)), None
    if case == "no_worker":
        model = "nobody"
    elif case == "unreachable_redis":
        url = f"redis://127.0.0.1:{free_port()}/0"
        start_worker([inc])
    else:
        model, source = "double", [[1.0]] * 10  # every row breaks the spec
        start_worker([double])
    job = submit_bulk(raw_redis, model, source, retry=Retry(max=1), redis_url=url,
                      options=BulkOptions(wait_workers_s=0.3))
    assert await wait_job(job, rq_worker) == "failed", rq_worker.log()
    registry = FailedJobRegistry(queue=Queue(BULK_QUEUE, connection=raw_redis))
    assert job.id in registry.get_job_ids()
    job.refresh()
    assert job.retries_left == 0  # ran twice: the first try and one retry
    expected = {"no_worker": "NoLiveWorkers", "unreachable_redis": "RedisUnavailable",
                "every_item_fails": "BulkJobFailed"}[case]
    error = job_status(raw_redis, job.id)["error"]
    assert expected in error, error
    runs = rq_worker.log().count(f"job {job.id}: exception raised while executing")
    assert runs == 2, rq_worker.log()


def test_rq_info_lists_the_queue(raw_redis: redis.Redis, redis_url: str) -> None:
    submit_bulk(raw_redis, "inc", [1, 2, 3])  # no RQ worker: the job stays queued
    info = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", redis_url],
                          capture_output=True, text=True, timeout=30, env=test_env(),
                          cwd=ROOT, check=True).stdout
    assert re.search(rf"^{BULK_QUEUE} \|\S* 1\b", info, re.M), info  # one job queued
    assert "1 queues" in info, info


async def test_interactive_requests_go_first(start_worker: Callable[..., Worker],
                                             raw_redis: redis.Redis, redis_url: str,
                                             rq_worker: Proc) -> None:
    """A 4000-item job never lifts the queue far above its low-water mark, so requests
    sent meanwhile wait behind a few bulk items only."""
    start_worker([paced])
    chunk, low_water = 16, 16
    opts = BulkOptions(chunk_size=chunk, low_water=low_water, max_inflight_chunks=16)
    job = submit_bulk(raw_redis, "paced", list(range(4000)), options=opts)
    depths: list[int] = []
    progress: set[int] = set()
    latencies: list[float] = []
    sampler = aioredis.Redis.from_url(redis_url)
    try:
        async with Client(redis_url) as client:
            while job.get_status() not in TERMINAL:
                depths.append(await sampler.llen(protocol.queue_key("paced")))
                progress.add(int(job.get_meta().get("done") or 0))
                started = time.monotonic()
                assert await client.predict("paced", -1, timeout_s=10) == 0
                latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.005)
    finally:
        await sampler.aclose()
    assert job.get_status() == JobStatus.FINISHED, rq_worker.log()
    assert job.return_value(refresh=True)["outputs"] == list(range(1, 4001))
    assert max(depths) <= low_water + chunk + 1, f"queue depth went to {max(depths)}"
    busy = [d for d in depths if d > 0]
    assert len(busy) >= 20, f"the bulk job was hardly seen running: {depths}"
    assert len(progress - {0, 4000}) >= 3, f"progress not updated per chunk: {progress}"
    assert len(latencies) >= 20 and max(latencies) < 1.0, latencies


async def test_cli_submit_wait_and_status(start_worker: Callable[..., Worker],
                                          redis_url: str, rq_worker: Proc, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    start_worker([inc])
    parser = argparse.ArgumentParser(prog="redbatch")
    register(parser.add_subparsers(dest="command", required=True))
    np.save(tmp_path / "in.npy", np.arange(20))
    out = tmp_path / "out.jsonl"
    args = parser.parse_args(["jobs", "submit", "inc", str(tmp_path / "in.npy"), "--output",
                              str(out), "--wait", "--redis-url", redis_url, "--poll-s", "0.1",
                              "--chunk-size", "8"])
    assert await asyncio.to_thread(jobs_main, args) == 0, capsys.readouterr()
    captured = capsys.readouterr()
    job_id, summary = captured.out.splitlines()[:2]
    assert f"job {job_id} finished: 20/20 done, 0 failed" in summary, captured
    assert "20/20" in captured.err  # the progress bar
    assert [json.loads(line)["output"] for line in out.read_text().splitlines()] == list(
        range(1, 21))

    args = parser.parse_args(["jobs", "status", job_id, "--json", "--redis-url", redis_url])
    assert jobs_main(args) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["status"], status["done"], status["output"]) == ("finished", 20, str(out))

    args = parser.parse_args(["jobs", "status", "no-such-job", "--redis-url", redis_url])
    assert jobs_main(args) == 2
    assert "no job 'no-such-job'" in capsys.readouterr().err


def test_npy_output_has_nan_rows_for_failed_items(tmp_path: Path) -> None:
    out = tmp_path / "out.npy"
    write_output(str(out), [np.array([1, 2]), ItemError("model_error", "boom"), np.array([5, 6])])
    saved = np.load(out)
    assert saved.dtype == np.float64 and saved.shape == (3, 2)
    np.testing.assert_array_equal(saved[[0, 2]], [[1, 2], [5, 6]])
    assert np.isnan(saved[1]).all()
    with pytest.raises(BadSource, match="different shapes"):
        write_output(str(out), [np.zeros(2), np.zeros(3)])
    np.testing.assert_array_equal(np.load(out), saved)  # a failed write leaves the old file


def test_bad_sources_are_refused_at_submit(raw_redis: redis.Redis, tmp_path: Path) -> None:
    with pytest.raises(BadSource, match="unknown format"):
        submit_bulk(raw_redis, "inc", str(tmp_path / "inputs.csv"))
    with pytest.raises(BadSource, match="output"):
        submit_bulk(raw_redis, "inc", [1], output="https://example.com/out.npy")
    with pytest.raises(BadSource):
        submit_bulk(raw_redis, "inc", 42)
    assert Queue(BULK_QUEUE, connection=raw_redis).count == 0


def test_url_of_an_rq_connection() -> None:
    for url in ("redis://127.0.0.1:6380/3", "redis://u:p%40ss@h:1/0", "rediss://h:1/2",
                "unix:///tmp/r.sock?db=2&password=x",
                # a Unix socket's ACL user (it was dropped), an IPv6 host (unbracketed)
                "unix:///tmp/r.sock?db=1&username=bulk&password=p%26w",
                "redis://[::1]:6393/2", "redis://u:p@[::1]:6393/0"):
        conn = redis.Redis.from_url(url)
        kwargs = conn.connection_pool.connection_kwargs
        again = redis.Redis.from_url(url_of(conn)).connection_pool.connection_kwargs
        for key in ("host", "port", "db", "username", "password", "path"):
            assert again.get(key) == kwargs.get(key), (url, key)
        conn.close()


def test_a_jsonl_line_fails_alone_when_too_deep_or_not_utf8() -> None:
    """A line nested past the parser's depth raised ``RecursionError`` and lost the
    whole job; a UTF-16 file was read line by line as guessed encodings (a garbled
    output marked a success, and a line that does not exist)."""
    from redbatch.jobs.sources import BadRow, _jsonl_rows

    lines = [b"1\n", b"[" * 100_000 + b"]" * 100_000 + b"\n", b"3\n",
             '"\u20acuro"\n'.encode("utf-16"), '"caf\u00e9"\n'.encode()]
    rows = list(_jsonl_rows(iter(lines)))
    assert rows[0] == 1 and rows[2] == 3 and rows[4] == "caf\u00e9"
    assert isinstance(rows[1], BadRow) and "invalid JSON" in str(rows[1])
    assert isinstance(rows[3], BadRow) and "not UTF-8" in str(rows[3])
    assert list(_jsonl_rows(iter([b'\xef\xbb\xbf"bom"\n']))) == ["bom"]  # UTF-8 with a BOM


def test_the_output_is_written_through_a_fresh_file_never_a_planted_link(
        tmp_path: Path) -> None:
    """The temporary file had a predictable name (``<output>.tmp-<pid>``): a link
    planted there made the job write over the file it pointed at."""
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    (tmp_path / f"out.jsonl.tmp-{os.getpid()}").symlink_to(victim)
    write_output(str(out), [1, 2])
    assert victim.read_text() == "precious"
    assert out.read_text() == '{"output": 1}\n{"output": 2}\n' and not out.is_symlink()
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # as a plain open makes it


def test_jobs_that_could_not_run_are_refused_at_submit(raw_redis: redis.Redis) -> None:
    """An empty queue name (the job waited where no RQ worker looks), a source URL
    with a password, its scheme in any case (stored in the job in clear), and chunks
    past the requests one process may have waiting (every run failed ``QueueFull``)."""
    from redbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="queue name"):
        submit_bulk(raw_redis, "inc", [1], queue=" ")
    for scheme in ("https", "HTTPS", "Http"):  # (any case: it was taken as a file path)
        with pytest.raises(BadSource, match="user or password"):
            submit_bulk(raw_redis, "inc", f"{scheme}://u:pw@example.com/in.jsonl")
    with pytest.raises(ConfigError, match="at most 10000"):
        BulkOptions(chunk_size=20_000)
    assert Queue(BULK_QUEUE, connection=raw_redis).count == 0


def test_an_output_json_cannot_hold_is_that_items_error_line(tmp_path: Path) -> None:
    """``{"output": NaN}`` is no JSON: such an item's line says why instead."""
    out = tmp_path / "out.jsonl"
    write_output(str(out), [1.5, float("nan"), [1, float("inf")]])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"output": 1.5}
    assert [line["error"]["code"] for line in lines[1:]] == ["model_error"] * 2


def test_a_missing_output_directory_fails_the_job_before_any_inference(
        tmp_path: Path) -> None:
    from redbatch.jobs.tasks import run_bulk

    with pytest.raises(BadSource, match="directory does not exist"):
        run_bulk("inc", [1, 2], str(tmp_path / "nodir" / "out.jsonl"),
                 redis_url="redis://127.0.0.1:1/0")  # (never reached: no Redis there)
